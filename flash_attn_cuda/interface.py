"""Public attention functions with flash-attn 2.x call signatures."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _ops, dropout, serving
from .plan import forced, override_string

_ALIGN_ELEMS = 8  # the kernels move 16-byte (8-element) chunks

# What the attention functions return: out alone, or (out, softmax_lse, S_dmask) with return_attn_probs (S_dmask
# None without dropout).
AttnOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class Variants(NamedTuple):
    """The attention ops' variant arguments, in their schema order (the op table's variants group; a CPU test
    checks the two agree). The ops take them as their trailing arguments."""

    window_left: int
    window_right: int
    softcap: float
    alibi_slopes: torch.Tensor | None
    dropout_p: float
    rng_state: torch.Tensor | None
    learnable_sink: torch.Tensor | None


# The dtypes a learnable sink may come in; the ops take float32, so the others are converted (and their gradient
# converted back by autograd).
_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _sink_argument(learnable_sink: torch.Tensor | None, s_aux: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """The sink, given as learnable_sink or under its alias s_aux, and the name it was given under (for messages)."""
    if s_aux is None:
        return learnable_sink, "learnable_sink"
    if learnable_sink is not None:
        raise ValueError("learnable_sink and s_aux are two names for the same argument; give one of them")
    return s_aux, "s_aux"


def _check_sink(q: torch.Tensor, sink: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """The sink as the ops take it: float32, contiguous, (nheads,) on q's device. Raises ValueError naming the
    argument otherwise; a bfloat16 or float16 sink is converted, differentiably."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape (nheads,), got {type(sink).__name__}")
    if sink.dtype not in _SINK_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {sink.dtype}")
    # A q of the wrong kind or rank is reported by the checks of q that follow; the sink is judged against a valid q.
    if isinstance(q, torch.Tensor) and q.dim() >= 2:
        nheads = q.shape[-2]
        if sink.dim() != 1 or sink.shape[0] != nheads:
            raise ValueError(f"{name} must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}")
        if sink.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {sink.device}")
    return sink.float().contiguous()


def _variants(
    q: torch.Tensor,
    dropout_p: float,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    learnable_sink: torch.Tensor | None = None,
    sink_name: str = "learnable_sink",
) -> Variants:
    """The ops' variant arguments for the public functions' ones; with dropout, a fresh rng_state drawn from
    torch's generator. learnable_sink is checked and converted (_check_sink); sink_name is the name the caller
    gave it under."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of integers, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size must hold integers >= -1 (-1: unbounded), got {tuple(window_size)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    sink = _check_sink(q, learnable_sink, sink_name)
    rng_state = _ops.rng_state(q) if dropout_p > 0.0 else None
    return Variants(int(left), int(right), float(softcap), alibi_slopes, float(dropout_p), rng_state, sink)


def _kernel_ready(x: torch.Tensor, head_dim: int, compiling: bool) -> torch.Tensor:
    """Pads head_dim to a multiple of 8 and copies only when strides or alignment rule out 16-byte loads."""
    # Early returns, cheapest test first: this runs three times per call, and decoding-sized calls are
    # host-bound. Contiguous with head_dim % 8 == 0 means every stride is a multiple of 8 elements.
    if head_dim % _ALIGN_ELEMS != 0:
        # F.pad keeps a permuted layout (a head dim that is not innermost); contiguous() is free otherwise.
        x = F.pad(x, (0, _ALIGN_ELEMS - head_dim % _ALIGN_ELEMS)).contiguous()
    elif not x.is_contiguous():
        *strides, last_stride = x.stride()
        if last_stride != 1:
            return x.contiguous()
        for size, stride in zip(x.shape, strides):
            if stride % _ALIGN_ELEMS != 0 and size > 1:
                return x.contiguous()
    # Allocations are 16-byte aligned, so the view's offset decides. Dynamo cannot trace storage_offset()
    # into a graph; under torch.compile a misaligned view is reported by the op's own check instead.
    if compiling or x.storage_offset() * x.element_size() % 16 == 0:
        return x
    # contiguous() would return a contiguous view unchanged, misaligned.
    return x.clone(memory_format=torch.contiguous_format)


def _common_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: tuple[str, str]) -> tuple[int, int, int]:
    """(head dim of q and k, head dim of v, the width q and k run at): k must have q's head dim, v may have its
    own (DeepSeek's 192 and 128, say), each at most 256. Most kernels take one head dim, so a narrower side is
    zero-padded to the wider one's (_widen): zero columns of q and k add nothing to the scores, and zero columns
    of v give output columns that are cut off. Exact, at the cost of the padded copies and the padded columns'
    work. A narrower v is left to the ops where they take one (_prepare), which run it on a kernel of its own
    where one exists. names: how k and v are called in messages."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{names[0]} must have the head_dim of q ({head_dim}), got {k.shape[-1]}")
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    if not 0 < head_dim_v <= 256:
        raise ValueError(f"the head_dim of {names[1]} must be in [1, 256], got {head_dim_v}")
    return head_dim, head_dim_v, max(head_dim, head_dim_v)


def _widen(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """x with its head dim zero-padded to width (a new tensor), or x itself when it has that width."""
    if x is None or x.shape[-1] == width:
        return x
    return F.pad(x, (0, width - x.shape[-1]))


def _ready_at(x: torch.Tensor, width: int, compiling: bool) -> torch.Tensor:
    """x kernel-ready at the call's head dim `width` (_kernel_ready): a narrower x is zero-padded straight to width
    rounded up to a multiple of 8, in one copy rather than one per padding."""
    if x.shape[-1] == width:
        return _kernel_ready(x, width, compiling)
    padded = -(-width // _ALIGN_ELEMS) * _ALIGN_ELEMS
    return _kernel_ready(_widen(x, padded), padded, compiling)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, rank: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int, bool]:
    """Checks q, k, v of the given rank, resolves the default and negative softmax_scale, and makes the
    tensors kernel-ready: v may have a head dim of its own (_common_head_dim). Returns (q, k, v, softmax_scale, the
    output's head dim (v's), whether torch.compile is tracing)."""
    if not (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dim() == rank
        and k.dim() == rank
        and v.dim() == rank
    ):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                raise ValueError(f"{name} must be a {rank}-D tensor {layout}")
    head_dim, head_dim_v, width = _common_head_dim(q, k, v, ("k", "v"))
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif softmax_scale < 0:
        # (-q) k^T * |scale| equals q k^T * scale; the kernel needs a non-negative scale.
        q, softmax_scale = -q, -softmax_scale
    compiling = torch.compiler.is_compiling()
    # A V narrower than Q and K keeps its own head dim (rounded up to a multiple of 8): the ops run it on a kernel
    # of its own where one exists (DeepSeek's 192 and 128), and pad it to Q's head dim themselves otherwise.
    width_v = width if head_dim_v >= head_dim else -(-head_dim_v // _ALIGN_ELEMS) * _ALIGN_ELEMS
    return (
        _ready_at(q, width, compiling),
        _ready_at(k, width, compiling),
        _ready_at(v, width_v, compiling),
        float(softmax_scale),
        head_dim_v,
        compiling,
    )


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> AttnOutput:
    """Exact attention softmax(q k^T * softmax_scale) v without materializing the score matrix.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 or bfloat16, on a CUDA device.
        k, v: (batch, seqlen_k, nheads_k, head_dim), v's head dim possibly its own (head_dim_v, below); nheads must
            be a multiple of nheads_k (multi-query and grouped-query attention share each k/v head among
            nheads / nheads_k query heads).
        dropout_p: attention dropout probability in [0, 1): probabilities are dropped after the softmax, with
            probability p' = round(256 dropout_p) / 256 (8 random bits each, as flash-attn 2.x; at least 1/256),
            and the kept ones scaled by 1 / (1 - dropout_p), as flash-attn 2.x scales them. The mask comes from
            torch's CUDA generator (one draw per call), so torch.manual_seed reproduces it; the backward
            regenerates it. Use 0.0 for evaluation.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal: query i attends to key j only if j <= i + seqlen_k - seqlen_q (aligned to the bottom-right
            corner of the score matrix). Queries that see no key produce zeros.
        window_size: (left, right) sliding window: the query at position p = i + seqlen_k - seqlen_q sees keys
            [p - left, p + right]; -1 leaves that side unbounded. causal=True sets right to 0. Key blocks outside
            the window are skipped, so the cost follows the window.
        softcap: if > 0, scores become softcap * tanh(softmax_scale * q k^T / softcap) (Gemma 2, Grok).
        alibi_slopes: float32 (nheads,) or (batch, nheads): adds -slope * |p - j| to the (scaled) scores.
        deterministic: make the backward pass bitwise reproducible (dq is summed in a fixed order, at some cost
            in speed); no effect on the forward pass.
        return_attn_probs: also return the log-sum-exp and, with dropout, S_dmask (see Returns).
        learnable_sink: keyword only; optional (nheads,) tensor, float32, bfloat16 or float16, on q's device: one
            learnable logit per query head, an attention sink (FlashAttention-4's learnable_sink, vLLM's s_aux,
            gpt-oss). It joins the softmax denominator of every query row of its head and carries no value:
            with s_ij the score after softmax_scale, softcap and ALiBi, and M_i = max(max_j s_ij, sink_h),
            out_i = sum_j exp(s_ij - M_i) v_j / (sum_j exp(s_ij - M_i) + exp(sink_h - M_i)). The rows' weights
            thus sum to less than 1, and a row that sees no key gives out 0. Dropout drops only the keys'
            probabilities, never the sink's share. The sink is differentiable: its gradient is
            d sink_h = -sum over the batch and the rows i of exp(sink_h - lse_i) * sum_d(dout_i * out_i), with lse
            the returned softmax_lse; it comes back in the sink's dtype (the kernels compute it in float32).

    head_dim may be any size up to 256; sizes that are not a multiple of 8 are zero-padded internally. v may have a
    head dim of its own, head_dim_v, also up to 256 (DeepSeek's 192 for q and k, 128 for v): out and dv then have
    head_dim_v. A forward with q and k of head dim 161-192 and v of at most 128 runs on kernels of their own
    (dense calls with no window, softcap, ALiBi or dropout that the plan does not split into key ranges; on Hopper
    those with more than 64 query rows); every other such call, and the backward, runs at the wider of the two head
    dims, the narrower tensors zero-padded into copies (exact; the padded columns cost their share of the work).

    Returns:
        out (batch, seqlen_q, nheads, head_dim_v), or (out, softmax_lse, S_dmask) with return_attn_probs, where
        softmax_lse is float32 (batch, nheads, seqlen_q): the natural-log sum of exp(scores) per query row, of
        the softmax before dropout; with learnable_sink, log(sum_j exp(s_ij) + exp(sink_h)), which is sink_h in a
        row that sees no key. S_dmask is None without dropout; with it, a testing aid computed apart from the
        kernels (in float32 PyTorch, memory quadratic in the lengths): (batch, nheads, seqlen_q rounded up to 128,
        seqlen_k rounded up to 128) in q's dtype, the softmax probabilities with the entries dropout removed
        negated, and zeros outside the mask. With a sink, the probabilities are exp(s_ij - lse_i): the sink is in
        their denominator, so a row's probabilities sum to 1 - exp(sink_h - lse_i).
    """
    variants = _variants(q, dropout_p, window_size, softcap, alibi_slopes, learnable_sink)
    q_in, k_in, scale_in = q, k, softmax_scale
    q, k, v, softmax_scale, head_dim, compiling = _prepare(
        q, k, v, softmax_scale, 4, "(batch, seqlen, nheads, head_dim)"
    )
    num_splits, plan_override = forced()
    out, softmax_lse = _ops.fwd(
        q, k, v, softmax_scale, bool(causal), bool(deterministic), num_splits, plan_override, variants, compiling
    )
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if return_attn_probs:
        s_dmask = None
        if variants.dropout_p > 0.0:
            s_dmask = dropout.s_dmask(
                q_in,
                k_in,
                scale_in,
                bool(causal),
                tuple(window_size),
                variants.softcap,
                alibi_slopes,
                variants.dropout_p,
                variants.rng_state,
                learnable_sink=variants.learnable_sink,
            )
        return out, softmax_lse, s_dmask
    return out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> AttnOutput:
    """Attention over a batch of sequences of different lengths packed without padding.

    Args:
        q: (total_q, nheads, head_dim): the queries of all sequences, one after another.
        k, v: (total_k, nheads_k, head_dim), v's head dim possibly its own (as in flash_attn_func).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b owns rows
            [cu_seqlens[b], cu_seqlens[b + 1]). Rows outside every sequence are left unwritten in the output.
        max_seqlen_q, max_seqlen_k: Python ints, the longest query and key sequence (they size the launch;
            the kernels never read cu_seqlens on the host, so the call is CUDA-graph safe).
        causal, window_size, alibi_slopes: per sequence, aligned to the bottom-right corner of its own score
            matrix; (batch, nheads) slopes are indexed by sequence. Dropout masks are per sequence too.
        block_table: int32 (batch, max_pages) for paged keys and values (inference only: no dropout, no backward).
            k and v are then caches of pages (num_pages, page_size, nheads_k, head_dim), page_size a multiple of
            16; sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows, found in pages
            block_table[b, 0], block_table[b, 1], ... (any pages, in any order). Inputs may require grad: the
            outputs then carry a grad_fn, but a backward pass through them raises a RuntimeError naming
            block_table.
        learnable_sink: keyword only; the (nheads,) attention sink logits as in flash_attn_func, shared by every
            sequence. With block_table too (forward only there, like q, k and v).
        s_aux: keyword only; another name for learnable_sink (vLLM's). Give at most one of the two.
        seqused_q, seqused_k: keyword only; optional int32 (batch,): only the first seqused_q[b] queries and
            seqused_k[b] keys of sequence b take part (FlashAttention-3's arguments, for buffers padded per
            sequence); values are clamped to [0, the sequence's length]. Output rows of unused queries are 0 and
            their LSE +inf. With block_table, cu_seqlens_k may be None when seqused_k is given: sequence b's keys
            are then its first seqused_k[b] cache rows. Not with dropout.
        num_splits: keyword only; 0 or 1 (these kernels never split a varlen call's keys). flash_attn_with_kvcache
            takes any count.
        pack_gqa: keyword only; accepted for FlashAttention-3's callers: varlen calls never run the query heads of
            a key/value head as rows of one head, whatever it says.
        out, lse_out: keyword only; preallocated tensors of out's and softmax_lse's shapes and dtypes, which the
            results are copied into and which the call returns in their place.
        The other arguments are as in flash_attn_func.

    Returns:
        out (total_q, nheads, head_dim_v), or (out, softmax_lse, S_dmask) with return_attn_probs, where softmax_lse
        is float32 (nheads, total_q) (with the sink, as in flash_attn_func) and S_dmask is as in flash_attn_func,
        (batch, nheads, max_seqlen_q and max_seqlen_k rounded up to 128), each sequence's from the top-left corner
        (None without dropout).
    """
    learnable_sink, sink_name = _sink_argument(learnable_sink, s_aux)
    if num_splits not in (0, 1):
        raise ValueError(f"num_splits must be 0 or 1 for varlen calls, whose keys are never split, got {num_splits}")
    if (seqused_q is not None or seqused_k is not None) and dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0 with seqused_q or seqused_k, got {dropout_p}")
    if block_table is not None:
        if seqused_q is not None:
            raise ValueError("seqused_q is not supported with block_table; cut the queries with cu_seqlens_q")
        if seqused_k is not None:
            cu_seqlens_k = serving.paged_lengths(q, cu_seqlens_q, cu_seqlens_k, seqused_k)
        elif cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k may be None only with seqused_k")
        result = _varlen_paged(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            True,
            block_table,
            learnable_sink,
            sink_name,
        )
        out, softmax_lse = serving.write_outputs(result[0], result[1], out, lse_out)
        return (out, softmax_lse, None) if return_attn_probs else out
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k may be None only with block_table and seqused_k")
    if seqused_q is not None or seqused_k is not None:
        cu_seqlens_q, cu_seqlens_k = serving.used_sequences(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2:
            # (batch, nheads) slopes are indexed by sequence: each part of sequence b takes b's.
            alibi_slopes = alibi_slopes.repeat_interleave(serving.PARTS_PER_SEQUENCE, dim=0)
    variants = _variants(q, dropout_p, window_size, softcap, alibi_slopes, learnable_sink, sink_name)
    q_in, k_in, scale_in = q, k, softmax_scale
    q, k, v, softmax_scale, head_dim, compiling = _prepare(q, k, v, softmax_scale, 3, "(total, nheads, head_dim)")
    out_given = out
    out, softmax_lse = _ops.varlen_fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        softmax_scale,
        bool(causal),
        bool(deterministic),
        forced()[1],
        variants,
        compiling,
    )
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if out_given is not None or lse_out is not None:
        out, softmax_lse = serving.write_outputs(out, softmax_lse, out_given, lse_out)
    if return_attn_probs:
        s_dmask = None
        if variants.dropout_p > 0.0:
            s_dmask = dropout.s_dmask(
                q_in,
                k_in,
                scale_in,
                bool(causal),
                tuple(window_size),
                variants.softcap,
                alibi_slopes,
                variants.dropout_p,
                variants.rng_state,
                cu_seqlens_q,
                cu_seqlens_k,
                int(max_seqlen_q),
                int(max_seqlen_k),
                learnable_sink=variants.learnable_sink,
            )
        return out, softmax_lse, s_dmask
    return out


def _check_cache_operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_rank: int,
    q_layout: str,
    names: tuple[str, str] = ("k_cache", "v_cache"),
) -> tuple[int, int, int]:
    """Checks the ranks and head dims of a cache call's q and caches (named `names` in messages); returns the head
    dims of q and k, of v, and the width the kernels run (_common_head_dim)."""
    if not isinstance(q, torch.Tensor) or q.dim() != q_rank:
        raise ValueError(f"q must be a {q_rank}-D tensor {q_layout}")
    for name, t in zip(names, (k_cache, v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (batch_cache, seqlen_cache, nheads_k, head_dim), or "
                "(num_pages, page_size, nheads_k, head_dim) with a block_table"
            )
    return _common_head_dim(q, k_cache, v_cache, names)


def _pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """A cache with its head dim zero-padded to width rounded up to a multiple of 8 (a new tensor), or x itself
    when it has that head dim already."""
    return _widen(x, -(-width // _ALIGN_ELEMS) * _ALIGN_ELEMS)


def _varlen_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_attn_probs: bool,
    block_table: torch.Tensor,
    learnable_sink: torch.Tensor | None,
    sink_name: str,
) -> AttnOutput:
    """flash_attn_varlen_func with a block_table: varlen queries against paged caches, forward only (a backward
    through its outputs raises)."""
    head_dim, head_dim_v, width = _check_cache_operands(
        q, k_cache, v_cache, 3, "(total_q, nheads, head_dim)", ("k", "v")
    )
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0 with block_table (paged calls are for inference), got {dropout_p}")
    variants = _variants(q, 0.0, window_size, softcap, alibi_slopes, learnable_sink, sink_name)
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    compiling = torch.compiler.is_compiling()
    q = _ready_at(q, width, compiling)
    k_cache, v_cache = _pad_head_dim(k_cache, width), _pad_head_dim(v_cache, width)
    # Inputs that require grad are taken: the outputs then carry a node whose backward raises, naming block_table
    # (flash-attn 2.x's tests run this forward with such inputs and skip only its backward).
    out, softmax_lse = _ops.varlen_fwd_paged(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        block_table,
        float(softmax_scale),
        bool(causal),
        forced()[1],
        variants.window_left,
        variants.window_right,
        variants.softcap,
        variants.alibi_slopes,
        learnable_sink=variants.learnable_sink,
        compiling=compiling,
    )
    if out.shape[-1] != head_dim_v:
        out = out[..., :head_dim_v]
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    pack_gqa: bool | None = None,
    scheduler_metadata: serving.SchedulerMetadata | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention against a KV cache, for decoding and for prefill into a cache (inference: no backward pass).

    When k and v are given they are first written into k_cache and v_cache in place, sequence b's at cache rows
    cache_seqlens[b], cache_seqlens[b] + 1, ...; attention then covers the cache up to its new length. The call
    never copies the caches to the host or reads their lengths there, so a decoding step can be captured in a
    CUDA graph and replayed as the lengths grow, and torch.compile traces it whole.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 or bfloat16.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, head_dim), or with block_table a paged cache
            (num_pages, page_size, nheads_k, head_dim) with page_size any multiple of 16. nheads must be a
            multiple of nheads_k (MQA/GQA; with one query row and no ALiBi the heads that share a key/value head are
            computed together, so each cache row is read once).
        k, v: optional (batch, seqlen_new, nheads_k, head_dim): keys and values to append (cache_seqlens needed).
            Rows that would fall past the cache's end are dropped.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) in q's dtype, with seqlen_ro at least the
            cache's rows per sequence and rotary_dim even and at most head_dim; only with k and v. Rotary
            embedding rotates the new keys at their cache positions, and q at positions cache_seqlens[b] + i when
            causal or windowed, else all of a sequence's query rows at cache_seqlens[b] (flash-attn 2.x's rule).
            The rotated keys are what the cache stores.
        rotary_interleaved: rotate element pairs (0, 1), (2, 3), ... (GPT-J) when True, else pairs
            (i, i + rotary_dim / 2) (GPT-NeoX). Elements past rotary_dim are left as they are.
        cache_seqlens: int, or int32 (batch,): the keys already in each sequence's cache (before the append).
            None: the whole cache. An int is checked against the cache's size; a tensor is read on the device
            only, and lengths past the cache are clamped to it.
        cache_batch_idx: optional int32 (batch,): the batch row of the cache that sequence b uses (not with
            block_table). Without it, sequence b uses row b.
        cache_leftpad: optional int32 (batch,): sequence b's keys start at that cache row (left padding);
            cache_seqlens still counts from row 0.
        block_table: optional int32 (batch, max_pages): the pages of sequence b in order, any pages in any order.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash_attn_func, with positions aligned
            to the bottom-right corner of each sequence's own (seqlen_q, keys) score matrix.
        num_splits: key splits per query block (0: chosen from the shape and the GPU; 1: none).
        return_softmax_lse: also return the float32 (batch, nheads, seqlen_q) log-sum-exp (with the sink's term when
            there is one).
        learnable_sink: keyword only; the (nheads,) attention sink logits as in flash_attn_func: each query row's
            softmax denominator gains exp(sink_h), whatever the key splits. No gradient here.
        s_aux: keyword only; another name for learnable_sink (vLLM's). Give at most one of the two.
        pack_gqa: keyword only; False runs each query head on its own; None or True lets the plan run the query
            heads of a key/value head as rows of one head (one query row, no ALiBi), reading each cache row once.
        scheduler_metadata: keyword only; what get_scheduler_metadata computed for this call's sizes: the call then
            runs that plan's key splits and kernels (num_splits and pack_gqa give way to it).
        out, lse_out: keyword only; preallocated tensors of out's and softmax_lse's shapes and dtypes, which the
            results are copied into and which the call returns in their place.

    head_dim may be any size up to 256; with a size that is not a multiple of 8 the caches are padded into
    copies and the appended rows copied back (slow, but correct). v_cache (and v) may have a head dim of their own,
    head_dim_v (as in flash_attn_func): the narrower cache is then padded into a copy the same way, and out has
    head_dim_v.

    Returns:
        out (batch, seqlen_q, nheads, head_dim_v), or (out, softmax_lse) with return_softmax_lse.
    """
    head_dim, head_dim_v, width = _check_cache_operands(q, k_cache, v_cache, 4, "(batch, seqlen_q, nheads, head_dim)")
    learnable_sink, sink_name = _sink_argument(learnable_sink, s_aux)
    variants = _variants(q, 0.0, window_size, softcap, alibi_slopes, learnable_sink, sink_name)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    new_dims = (k.shape[-1], v.shape[-1]) if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) else None
    if new_dims is not None and new_dims != (head_dim, head_dim_v):
        # The caches are widened to one head dim for the kernels: a narrower k or v would be padded silently.
        raise ValueError(
            f"k and v must have the head dims of k_cache and v_cache ({head_dim} and {head_dim_v}), got "
            f"{k.shape[-1]} and {v.shape[-1]}"
        )
    paged = isinstance(block_table, torch.Tensor) and block_table.dim() == 2
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        new = 0 if k is None else k.shape[1]
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(
                f"cache_seqlens ({cache_seqlens}) plus the {new} appended rows must fit in the cache "
                f"({capacity} rows per sequence)"
            )
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if isinstance(rotary_cos, torch.Tensor) and isinstance(rotary_sin, torch.Tensor) and rotary_cos.dim() == 2:
        if 2 * rotary_cos.shape[1] > head_dim:
            raise ValueError(
                f"rotary_cos: rotary_dim (2 * {rotary_cos.shape[1]}) must be at most head_dim ({head_dim})"
            )
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif softmax_scale < 0:
        # Rotary embedding is linear, so rotating -q gives -(rotated q).
        q, softmax_scale = -q, -softmax_scale
    compiling = torch.compiler.is_compiling()
    q = _ready_at(q, width, compiling)
    if k is not None:
        k, v = (_ready_at(x, width, compiling) for x in (k, v))
    k_cache_in, v_cache_in = k_cache, v_cache
    k_cache, v_cache = _pad_head_dim(k_cache, width), _pad_head_dim(v_cache, width)
    forced_splits, plan_override = forced()
    num_splits = int(num_splits) if num_splits else forced_splits
    if pack_gqa is False:
        plan_override = ";".join(filter(None, (plan_override, override_string(gqa_pack=False))))
    if scheduler_metadata is not None:
        if not isinstance(scheduler_metadata, serving.SchedulerMetadata):
            raise ValueError("scheduler_metadata must be what flash_attn_cuda.get_scheduler_metadata returned")
        scheduler_metadata.check((q.shape[0], q.shape[2], k_cache.shape[2], head_dim, head_dim_v, q.dtype))
        num_splits = scheduler_metadata.num_splits
        plan_override = ";".join(filter(None, (plan_override, scheduler_metadata.plan_override)))
    out_given = out
    out, softmax_lse = torch.ops.flash_attn2.fwd_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        float(softmax_scale),
        bool(causal),
        variants.window_left,
        variants.window_right,
        variants.softcap,
        bool(rotary_interleaved),
        variants.alibi_slopes,
        num_splits,
        plan_override,
        learnable_sink=variants.learnable_sink,
    )
    if k is not None:
        # The appended rows went into the padded copies: back into the caches given.
        if k_cache is not k_cache_in:
            k_cache_in.copy_(k_cache[..., :head_dim])
        if v_cache is not v_cache_in:
            v_cache_in.copy_(v_cache[..., :head_dim_v])
    if out.shape[-1] != head_dim_v:
        out = out[..., :head_dim_v]
    if out_given is not None or lse_out is not None:
        out, softmax_lse = serving.write_outputs(out, softmax_lse, out_given, lse_out)
    return (out, softmax_lse) if return_softmax_lse else out


def _unpack(packed: torch.Tensor, dim: int, count: int, name: str, layout: str) -> tuple[torch.Tensor, ...]:
    if not isinstance(packed, torch.Tensor) or packed.dim() <= dim or packed.shape[dim] != count:
        raise ValueError(f"{name} must have shape {layout}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> AttnOutput:
    """flash_attn_func on q, k, v packed as qkv (batch, seqlen, 3, nheads, head_dim).

    q, k and v are read in place from qkv (no copy when head_dim is a multiple of 8), and the gradient comes back
    as one tensor shaped like qkv. learnable_sink (keyword only): the attention sink logits of flash_attn_func.
    """
    q, k, v = _unpack(qkv, 2, 3, "qkv", "(batch, seqlen, 3, nheads, head_dim)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> AttnOutput:
    """flash_attn_func with k and v packed as kv (batch, seqlen_k, 2, nheads_k, head_dim), read in place.
    learnable_sink (keyword only): the attention sink logits of flash_attn_func."""
    k, v = _unpack(kv, 2, 2, "kv", "(batch, seqlen_k, 2, nheads_k, head_dim)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> AttnOutput:
    """flash_attn_varlen_func on q, k, v packed as qkv (total, 3, nheads, head_dim), sharing cu_seqlens and
    max_seqlen; read in place, with the gradient shaped like qkv. learnable_sink (keyword only): the attention sink
    logits of flash_attn_func."""
    q, k, v = _unpack(qkv, 1, 3, "qkv", "(total, 3, nheads, head_dim)")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> AttnOutput:
    """flash_attn_varlen_func with k and v packed as kv (total_k, 2, nheads_k, head_dim), read in place.
    learnable_sink (keyword only): the attention sink logits of flash_attn_func."""
    k, v = _unpack(kv, 1, 2, "kv", "(total_k, 2, nheads_k, head_dim)")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
    )
