"""Public attention functions with flash-attn 2.x call signatures."""

import torch
import torch.nn.functional as F

_ALIGN_ELEMS = 8  # the kernels move 16-byte (8-element) chunks


def _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes):
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented yet in flash_attn_cuda")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)}: sliding-window attention is not implemented yet")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented yet")


def _kernel_ready(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pads head_dim to a multiple of 8 and copies only when strides or alignment rule out 16-byte loads."""
    if head_dim % _ALIGN_ELEMS != 0:
        x = F.pad(x, (0, _ALIGN_ELEMS - head_dim % _ALIGN_ELEMS))
    aligned = x.stride(-1) == 1 and all(
        s % _ALIGN_ELEMS == 0 for size, s in zip(x.shape[:-1], x.stride()[:-1]) if size > 1
    )
    # Allocations are 16-byte aligned, so the view's offset decides. Dynamo cannot trace storage_offset()
    # into a graph; under torch.compile a misaligned view is reported by the op's own check instead.
    if aligned and not torch.compiler.is_compiling():
        aligned = x.storage_offset() * x.element_size() % 16 == 0
    return x if aligned else x.contiguous()


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Exact attention softmax(q k^T * softmax_scale) v without materializing the score matrix.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 or bfloat16, on a CUDA device.
        k, v: (batch, seqlen_k, nheads_k, head_dim); nheads must be a multiple of nheads_k
            (multi-query and grouped-query attention share each k/v head among nheads / nheads_k query heads).
        dropout_p: attention dropout probability; only 0.0 is supported so far.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal: query i attends to key j only if j <= i + seqlen_k - seqlen_q (aligned to the bottom-right
            corner of the score matrix). Queries that see no key produce zeros.
        window_size, softcap, alibi_slopes: accepted for signature compatibility; only the defaults are supported so far.
        deterministic: make the backward pass bitwise reproducible (dq is summed in a fixed order, at some cost
            in speed); no effect on the forward pass.
        return_attn_probs: also return the log-sum-exp and the dropout mask (None without dropout).

    head_dim may be any size up to 256; sizes that are not a multiple of 8 are zero-padded internally.

    Returns:
        out (batch, seqlen_q, nheads, head_dim), or (out, softmax_lse, S_dmask) with return_attn_probs, where
        softmax_lse is float32 (batch, nheads, seqlen_q): the natural-log sum of exp(scaled scores) per query row.
    """
    _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, nheads, head_dim)")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"k and v must have the same head_dim as q ({head_dim}), got {k.shape[-1]} and {v.shape[-1]}")
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if softmax_scale < 0:
        # (-q) k^T * |scale| equals q k^T * scale; the kernel needs a non-negative scale.
        q, softmax_scale = -q, -softmax_scale
    q, k, v = (_kernel_ready(t, head_dim) for t in (q, k, v))
    out, softmax_lse = torch.ops.flash_attn2.fwd(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if return_attn_probs:
        return out, softmax_lse, None
    return out
