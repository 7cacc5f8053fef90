"""Conversions between padded (batch, seqlen, ...) tensors and the packed (total, ...) layout of the varlen
functions, with the `unpad_input` / `pad_input` signatures of flash-attn 2.7 and later (`unpad_input` returns
five values there; flash-attn 2.6 and earlier returned the first four)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Packs the tokens that attention_mask keeps.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or 0/1: which tokens are real.
        unused_mask: optional (batch, seqlen), tokens that are allocated but not used; they are packed and
            counted in cu_seqlens, but not in the returned used lengths.

    Returns:
        (unpadded (total, ...), indices (total,) int64 positions in the flattened (batch * seqlen) input,
        cu_seqlens (batch + 1,) int32, max_seqlen (int), used_seqlens (batch,) int32).
        max_seqlen is read back to the host, so this call synchronizes with the device.
    """
    kept = attention_mask.bool()
    if unused_mask is not None:
        kept = kept | unused_mask.bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    unpadded = hidden_states.reshape(-1, *hidden_states.shape[2:]).index_select(0, indices)
    return unpadded, indices, cu_seqlens, max_seqlen, used_seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: scatters (total, ...) rows back to (batch, seqlen, ...), zeros elsewhere."""
    padded = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    padded = padded.index_copy(0, indices, hidden_states)
    return padded.view(batch, seqlen, *hidden_states.shape[1:])
