"""The kernels' attention-dropout mask, recomputed in plain PyTorch (a testing aid).

The kernels decide whether to keep an entry of the probability matrix from a counter-based generator,
Philox4x32 with 7 rounds (as flash-attn 2.x), so the mask is a pure function of (seed, offset) and of the entry's
coordinates: it can be rebuilt here, bit for bit, on any device, from the rng_state the Python wrappers hand to
the op.

Layout of the draw (the same in every pass, dense or varlen):

- key = (low 32 bits of seed, high 32 bits of seed)
- one Philox call per counter (i & ~8, j & ~25, b * nheads + h, low 32 bits of offset) serves the sixteen
  entries {i, i + 8} x {j, j + 1, j + 8, j + 9, j + 16, j + 17, j + 24, j + 25} of query head h of batch row
  (varlen: sequence) b, i with bit 3 clear and j with bits 0, 3 and 4 clear; entry (i, j) takes byte
  (j >> 3) & 3 of output word 2 * bit3(i) + bit0(j) (the rows 8 apart, the column pairs and the 8-column groups
  that one thread holds in the kernels' MMA accumulator layouts)
- the entry is dropped iff that byte < round(256 p), at least 1 and at most 255 for p > 0: it drops with
  probability p' = reference.effective_dropout_p(p), and the kept entries are scaled by 1 / (1 - p)
  (reference.dropout_keep_scale, as flash-attn 2.x)

Everything is done on int64 tensors that hold uint32 values, since torch has no unsigned 32-bit arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .reference import attention_probs, effective_dropout_p

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_BUMPS = (0x9E3779B9, 0xBB67AE85)
DROPOUT_ROUNDS = 7  # the rounds of the kernels' Philox (csrc/kernels/dropout.h)
# Entries per chunk of keep_mask. The generator makes one call per sixteen entries and holds a few dozen int64
# temporaries of one word per call, and the (word, byte) decisions, at its peak: tens of MB at 2^20 entries.
_CHUNK_ENTRIES = 1 << 20


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product multiplier * x, for a uint32 constant and uint32 values.

    The product needs 64 unsigned bits, more than int64 holds, so x is split into 16-bit halves: each partial
    product has at most 48 bits, and the high partial product is split again where it crosses bit 32.
    """
    x_lo, x_hi = x & 0xFFFF, x >> 16
    low_part = multiplier * x_lo  # < 2^48
    high_part = multiplier * x_hi  # < 2^48, weighs 2^16
    # multiplier * x = (high_part >> 16) * 2^32 + (high_part & 0xffff) * 2^16 + low_part
    below = ((high_part & 0xFFFF) << 16) + low_part  # < 2^49: no overflow
    return ((high_part >> 16) + (below >> 32)) & _MASK32, below & _MASK32


def philox4x32(
    c0: torch.Tensor | int,
    c1: torch.Tensor | int,
    c2: torch.Tensor | int,
    c3: torch.Tensor | int,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
    rounds: int = DROPOUT_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 with ``rounds`` rounds on int64 tensors (or Python ints) holding uint32 values.

    The inputs broadcast against each other; the four output words come back as int64 tensors of uint32 values.
    Round r (r = 0, 1, ...) uses the key (k0 + r * 0x9E3779B9, k1 + r * 0xBB67AE85) mod 2^32. With ``rounds=10``
    this is Random123's philox4x32_10.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    c0, c1, c2, c3, k0, k1 = (torch.as_tensor(t, dtype=torch.int64) for t in (c0, c1, c2, c3, k0, k1))
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _KEY_BUMPS[0]) & _MASK32
        k1 = (k1 + _KEY_BUMPS[1]) & _MASK32
    return c0, c1, c2, c3


def _threshold(dropout_p: float) -> int:
    """The smallest byte that keeps an entry: 256 p', p' = effective_dropout_p(dropout_p) (0 for p = 0)."""
    return round(effective_dropout_p(dropout_p) * 256.0)


def _seed_and_offset(rng_state: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) of an int64 (2,) rng_state as unsigned 64-bit Python ints (int64 holds their bit patterns)."""
    if rng_state.dtype != torch.int64 or rng_state.shape != (2,):
        raise ValueError(
            f"rng_state must be an int64 tensor of shape (2,), got {rng_state.dtype} {tuple(rng_state.shape)}"
        )
    seed, offset = rng_state.tolist()
    return seed & 0xFFFFFFFFFFFFFFFF, offset & 0xFFFFFFFFFFFFFFFF


def _row_counters(start: int, length: int, device: torch.device | str | None) -> torch.Tensor:
    """The first counter word of the Philox calls covering rows [start, start + length), start a multiple of 16:
    the calls of block n (rows 16 n .. 16 n + 15) are 16 n + r for r < 8, and call 16 n + r serves rows 16 n + r
    (its words 0-1) and 16 n + r + 8 (words 2-3)."""
    blocks = -(-length // 16)
    blocks_start = start + 16 * torch.arange(blocks, device=device)
    return (blocks_start[:, None] + torch.arange(8, device=device)[None, :]).flatten()  # (blocks * 8,)


def _col_counters(length: int, device: torch.device | str | None) -> torch.Tensor:
    """The second counter word of the Philox calls covering columns [0, length): the calls of block m (columns
    32 m .. 32 m + 31) are 32 m + 2 t for t < 4, and call 32 m + 2 t serves columns 32 m + 8 g + 2 t (words 0 and
    2) and 32 m + 8 g + 2 t + 1 (words 1 and 3), g < 4 the byte of each word."""
    blocks = -(-length // 32)
    blocks_start = 32 * torch.arange(blocks, device=device)
    return (blocks_start[:, None] + 2 * torch.arange(4, device=device)[None, :]).flatten()  # (blocks * 4,)


def _keep(
    seed: int,
    offset: int,
    threshold: int,
    first_head: int,
    count: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None,
) -> torch.Tensor:
    """bool (count, seqlen_q, seqlen_k): the keep decisions of the heads b * nheads + h = first_head ... + count - 1
    (the third counter word)."""
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    out = torch.empty(count, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if out.numel() == 0:
        return out

    # The rows are rounded up to whole 16-blocks and the columns to whole 32-blocks, so that the sixteen bytes of
    # each call land in a fixed pattern; the rows and the heads are processed in chunks of about _CHUNK_ENTRIES
    # entries.
    col_counters = _col_counters(seqlen_k, device)
    col_blocks = len(col_counters) // 4
    cols = col_blocks * 32
    rows_per_chunk = max(16, _CHUNK_ENTRIES // cols // 16 * 16)
    heads_per_chunk = max(1, _CHUNK_ENTRIES // (min(rows_per_chunk, seqlen_q) * cols))
    heads = torch.arange(first_head, first_head + count, device=device)
    byte_shifts = 8 * torch.arange(4, device=device)
    for h0 in range(0, count, heads_per_chunk):
        head_counters = heads[h0 : h0 + heads_per_chunk] & _MASK32
        for r0 in range(0, seqlen_q, rows_per_chunk):
            rows = min(rows_per_chunk, seqlen_q - r0)
            row_counters = _row_counters(r0, rows, device)
            counters = (
                row_counters[None, :, None],
                col_counters[None, None, :],
                head_counters[:, None, None],
                offset & _MASK32,
            )
            words = torch.stack(torch.broadcast_tensors(*philox4x32(*counters, *key)))
            # (word, head, call row, call column, byte); word = 2 * row bit 3 + column bit 0, byte = column bits 3-4.
            kept = ((words[..., None] >> byte_shifts) & 0xFF) >= threshold
            h, row_blocks = len(head_counters), len(row_counters) // 8
            # Split the word index into its row and column bits and put each next to its position:
            # (row bit, column bit, head, row block, row in half-block, column block, column pair, byte)
            # -> (head, row block, row bit, row, column block, byte, column pair, column bit).
            kept = kept.view(2, 2, h, row_blocks, 8, col_blocks, 4, 4).permute(2, 3, 0, 4, 5, 7, 6, 1)
            kept = kept.reshape(h, row_blocks * 16, cols)
            out[h0 : h0 + h, r0 : r0 + rows] = kept[:, :rows, :seqlen_k]
    return out


def keep_mask(
    rng_state: torch.Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int
) -> torch.Tensor:
    """The kernels' dropout decisions for a dense call.

    Args:
        rng_state: int64 (2,) tensor [seed, offset], as handed to the op.
        dropout_p: dropout probability in [0, 1).
        batch, nheads, seqlen_q, seqlen_k: the call's sizes (nheads: query heads).

    Returns:
        bool (batch, nheads, seqlen_q, seqlen_k) on rng_state's device, True where the entry is kept.
    """
    seed, offset = _seed_and_offset(rng_state)
    keep = _keep(seed, offset, _threshold(dropout_p), 0, batch * nheads, seqlen_q, seqlen_k, rng_state.device)
    return keep.view(batch, nheads, seqlen_q, seqlen_k)


def varlen_keep_mask(
    rng_state: torch.Tensor,
    dropout_p: float,
    nheads: int,
    lens_q: Sequence[int] | torch.Tensor,
    lens_k: Sequence[int] | torch.Tensor,
) -> list[torch.Tensor]:
    """The kernels' dropout decisions for a varlen call, one mask per sequence.

    Args:
        rng_state, dropout_p: as keep_mask.
        nheads: query heads.
        lens_q, lens_k: the sequence lengths (sequences of ints, or 1-D tensors).

    Returns:
        A list whose entry b is bool (nheads, lens_q[b], lens_k[b]) on rng_state's device: sequence b draws as
        batch row b of a dense call, with positions counted from the start of the sequence.
    """
    lens_q, lens_k = (x.tolist() if torch.is_tensor(x) else list(x) for x in (lens_q, lens_k))
    if len(lens_q) != len(lens_k):
        raise ValueError(f"lens_q and lens_k must have the same length, got {len(lens_q)} and {len(lens_k)}")
    seed, offset = _seed_and_offset(rng_state)
    threshold = _threshold(dropout_p)
    return [
        _keep(seed, offset, threshold, b * nheads, nheads, len_q, len_k, rng_state.device)
        for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k))
    ]


def _round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple


def _signed_probs(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """P where kept, -P where dropped; +0 (not -0) where P is 0, so that zeros carry no sign."""
    return torch.where(keep | (probs == 0), probs, -probs)


def s_dmask(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    rng_state: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The S_dmask that return_attn_probs gives with dropout: the float32 reference probabilities, negated where
    dropout removed the entry, 0 where masked and in the padding.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), or (total_q, nheads, head_dim) with cu_seqlens_q.
        k: (batch, seqlen_k, nheads_k, head_dim), or (total_k, nheads_k, head_dim) with cu_seqlens_k.
        softmax_scale, causal, window_size, softcap, alibi_slopes: the call's variants (attention_ref).
        dropout_p, rng_state: the call's dropout (keep_mask).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) sequence offsets of a varlen call (read on the host).
        max_seqlen_q, max_seqlen_k: varlen only; default to the longest sequences.
        learnable_sink: the call's (nheads,) attention sink, which joins each row's denominator as in the kernels'
            probabilities (attention_probs).

    Returns:
        q.dtype (batch, nheads, round_up(seqlen_q, 128), round_up(seqlen_k, 128)) (varlen: of max_seqlen_q/k),
        on q's device, not attached to autograd.
    """
    # A testing aid, not part of the differentiable output: no autograd graph through the reference.
    q, k = q.detach(), k.detach()
    sink = None if learnable_sink is None else learnable_sink.detach()
    variants = dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, learnable_sink=sink
    )
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads = q.shape[:3]
        seqlen_k = k.shape[1]
        probs = attention_probs(q, k, alibi_slopes=alibi_slopes, **variants)
        keep = keep_mask(rng_state, dropout_p, batch, nheads, seqlen_q, seqlen_k).to(q.device)
        out = torch.zeros(batch, nheads, _round_up(seqlen_q), _round_up(seqlen_k), dtype=q.dtype, device=q.device)
        out[:, :, :seqlen_q, :seqlen_k] = _signed_probs(probs, keep)
        return out

    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [b - a for a, b in zip(starts_q, starts_q[1:])]
    lens_k = [b - a for a, b in zip(starts_k, starts_k[1:])]
    max_seqlen_q = max(lens_q, default=0) if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = max(lens_k, default=0) if max_seqlen_k is None else max_seqlen_k
    if max(lens_q, default=0) > max_seqlen_q or max(lens_k, default=0) > max_seqlen_k:
        raise ValueError("a sequence is longer than max_seqlen_q / max_seqlen_k")
    nheads = q.shape[1]
    keeps = varlen_keep_mask(rng_state, dropout_p, nheads, lens_q, lens_k)
    out = torch.zeros(
        len(lens_q), nheads, _round_up(max_seqlen_q), _round_up(max_seqlen_k), dtype=q.dtype, device=q.device
    )
    for b, keep in enumerate(keeps):
        q_b = q[starts_q[b] : starts_q[b + 1]].unsqueeze(0)
        k_b = k[starts_k[b] : starts_k[b + 1]].unsqueeze(0)
        # Per-batch slopes (batch, nheads) give this sequence its row; shared slopes (nheads,) pass as they are.
        slopes = alibi_slopes[b : b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        probs = attention_probs(q_b, k_b, alibi_slopes=slopes, **variants)[0]
        out[b, :, : lens_q[b], : lens_k[b]] = _signed_probs(probs, keep.to(q.device))
    return out
