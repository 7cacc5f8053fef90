"""Serving-engine arguments with FlashAttention-3's names and meanings: per-sequence used lengths inside padded
varlen buffers (``seqused_q``, ``seqused_k``), preallocated outputs (``out``, ``lse_out``), plans computed ahead
(``get_scheduler_metadata`` / ``scheduler_metadata=``), and ``flash_attn_combine``, which merges partial attention
results (cascade attention over a shared prefix, context parallelism).

The public functions in interface.py take the arguments; this module holds what they share.
"""

from __future__ import annotations

import dataclasses

import torch

from .plan import Plan, override_string, plan

# seqused_q / seqused_k turn each sequence b into three, so that the kernels' contiguous (start, length) view of a
# sequence can leave out unused rows: sequence b's used queries against its used keys; its unused queries against
# no key (their output rows are 0, their LSE +inf); its unused keys against no query. All on the device from
# cu_seqlens and seqused, with no host synchronization (CUDA graphs, torch.compile).
PARTS_PER_SEQUENCE = 3


def _check_lengths(x: torch.Tensor | None, name: str, batch: int, q: torch.Tensor) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.shape != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape (batch,) = ({batch},)")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


def _check_cu_seqlens(x: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != 1 or x.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of shape (batch + 1,)")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


def used_sequences(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens_q and cu_seqlens_k of PARTS_PER_SEQUENCE * batch sequences that attend as the batch does with
    sequence b's queries and keys cut to its first seqused_q[b] and seqused_k[b] rows (clamped to [0, its
    length]). Sequence 3b is the used part; 3b + 1 the unused queries, which see no key; 3b + 2 the unused keys,
    which no query sees."""
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q)
    _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q)
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have the shape of cu_seqlens_q ({batch + 1},)")
    _check_lengths(seqused_q, "seqused_q", batch, q)
    _check_lengths(seqused_k, "seqused_k", batch, q)
    starts_q, ends_q = cu_seqlens_q[:-1], cu_seqlens_q[1:]
    starts_k, ends_k = cu_seqlens_k[:-1], cu_seqlens_k[1:]
    used_q = ends_q if seqused_q is None else starts_q + torch.minimum(seqused_q.clamp(min=0), ends_q - starts_q)
    used_k = ends_k if seqused_k is None else starts_k + torch.minimum(seqused_k.clamp(min=0), ends_k - starts_k)
    cu_q = torch.cat((torch.stack((starts_q, used_q, ends_q), dim=1).flatten(), cu_seqlens_q[-1:]))
    cu_k = torch.cat((torch.stack((starts_k, used_k, used_k), dim=1).flatten(), cu_seqlens_k[-1:]))
    return cu_q, cu_k


def paged_lengths(
    q: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None, seqused_k: torch.Tensor
) -> torch.Tensor:
    """A paged call's cu_seqlens_k for keys cut to seqused_k: a paged sequence's keys start at its first page, so
    cu_seqlens_k only gives lengths, here seqused_k[b] (clamped to [0, the given length], if cu_seqlens_k is
    given)."""
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q)
    batch = cu_seqlens_q.shape[0] - 1
    _check_lengths(seqused_k, "seqused_k", batch, q)
    lengths = seqused_k.clamp(min=0)
    if cu_seqlens_k is not None:
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q)
        if cu_seqlens_k.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_k must have the shape of cu_seqlens_q ({batch + 1},)")
        lengths = torch.minimum(lengths, cu_seqlens_k[1:] - cu_seqlens_k[:-1])
    return torch.cat((lengths.new_zeros(1), lengths.cumsum(0).to(torch.int32)))


def write_outputs(
    out: torch.Tensor, softmax_lse: torch.Tensor, out_given: torch.Tensor | None, lse_given: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and softmax_lse copied into the preallocated tensors the call gave (those it gave), which are returned
    in their place. A copy, the same in eager mode, under torch.compile and in a CUDA graph."""
    for name, given, result in (("out", out_given, out), ("lse_out", lse_given, softmax_lse)):
        if given is None:
            continue
        if not isinstance(given, torch.Tensor) or given.shape != result.shape or given.dtype != result.dtype:
            raise ValueError(
                f"{name} must be a {result.dtype} tensor of shape {tuple(result.shape)}, got "
                + (f"{given.dtype} {tuple(given.shape)}" if isinstance(given, torch.Tensor) else type(given).__name__)
            )
        if given.device != result.device:
            raise ValueError(f"{name} must be on q's device ({result.device}), got {given.device}")
    if out_given is not None:
        out = out_given.copy_(out)
    if lse_given is not None:
        softmax_lse = lse_given.copy_(softmax_lse)
    return out, softmax_lse


@dataclasses.dataclass(frozen=True)
class SchedulerMetadata:
    """A forward plan computed ahead by get_scheduler_metadata: the key splits and the kernel choices that the call
    given it as ``scheduler_metadata=`` runs, whatever its own heuristics would pick, and the sizes it was made
    for, which the call must have."""

    num_splits: int
    plan_override: str
    sizes: tuple  # (batch, nheads, nheads_k, head_dim, head_dim_v, dtype)
    plan: Plan

    def check(self, sizes: tuple) -> None:
        if sizes != self.sizes:
            names = ("batch", "nheads", "nheads_k", "head_dim", "head_dim_v", "dtype")
            made = ", ".join(f"{n}={v}" for n, v in zip(names, self.sizes))
            given = ", ".join(f"{n}={v}" for n, v in zip(names, sizes))
            raise ValueError(f"scheduler_metadata was computed for {made}; this call has {given}")


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    headdim: int,
    cache_seqlens: torch.Tensor | None = None,
    qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_size: int | None = None,
    max_seqlen_k_new: int = 0,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    has_softcap: bool = False,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    *,
    arch: int | None = None,
    num_sms: int | None = None,
) -> SchedulerMetadata:
    """The plan of a flash_attn_with_kvcache call, computed ahead (FlashAttention-3's signature), to pass back as
    its ``scheduler_metadata=``: that call then runs these key splits and kernels.

    The plans here depend only on sizes, never on the contents of cache_seqlens or cu_seqlens, so computing one
    costs no device work and no synchronization, and a call given it does the same host work as one without it.
    What it adds is a pinned choice: a step captured in a CUDA graph and the same step run eagerly, or calls
    whose own arguments would lead the heuristic elsewhere (num_splits, pack_gqa), run the same kernels.

    Args:
        batch_size, max_seqlen_q, num_heads_q, num_heads_kv, headdim, headdim_v (None: headdim), qkv_dtype,
            causal, window_size, has_softcap: the call's.
        max_seqlen_k: the cache's rows per sequence (with page_size: pages per sequence times page_size).
        page_size: the pages' size for a paged cache (block_table), else None.
        num_splits: 0 lets the heuristic choose; n > 0 fixes the key splits.
        pack_gqa: False never runs the query heads of a key/value head as rows of one; None or True lets the plan
            do so where the kernels can.
        cache_seqlens, cu_seqlens_q, cu_seqlens_k_new, cache_leftpad, max_seqlen_k_new: accepted for
            FlashAttention-3's callers; the plan does not depend on them.
        attention_chunk, sm_margin: FlashAttention-3's; only 0 is supported.
        arch, num_sms: keyword only; the GPU to plan for (e.g. 90 and 132), else the current CUDA device.
    """
    if attention_chunk != 0:
        raise ValueError(f"attention_chunk must be 0 (chunked attention is not supported), got {attention_chunk}")
    if sm_margin != 0:
        raise ValueError(f"sm_margin must be 0 (every SM is used), got {sm_margin}")
    if qkv_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"qkv_dtype must be torch.float16 or torch.bfloat16, got {qkv_dtype}")
    headdim_v = headdim if headdim_v is None else headdim_v
    left, right = window_size
    override = override_string(gqa_pack=False) if pack_gqa is False else ""
    planned = plan(
        "fwd",
        batch=int(batch_size),
        seqlen_q=int(max_seqlen_q),
        seqlen_k=int(max_seqlen_k),
        nheads=int(num_heads_q),
        nheads_k=int(num_heads_kv),
        # The call pads its head dims to the wider one, rounded up to a multiple of 8 (interface._ready_at).
        head_dim=-(-max(int(headdim), int(headdim_v)) // 8) * 8,
        causal=bool(causal),
        num_splits=int(num_splits),
        override=override,
        arch=arch,
        num_sms=num_sms,
        dtype=qkv_dtype,
        window_size=(int(left), int(right)),
        softcap=1.0 if has_softcap else 0.0,
        kvcache=True,
        paged=page_size is not None,
    )
    pinned = override_string(
        kernel=planned.kernel,
        short_keys=planned.short_key_tile,
        ws=planned.warp_specialized,
        gqa_pack=planned.gqa_pack > 1,
    )
    sizes = (int(batch_size), int(num_heads_q), int(num_heads_kv), int(headdim), int(headdim_v), qkv_dtype)
    return SchedulerMetadata(planned.num_splits, pinned, sizes, planned)


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges attention computed over disjoint sets of keys into attention over their union (FlashAttention-3's
    signature): for each row, out = sum_s exp(lse_s - lse) * out_s with lse = log(sum_s exp(lse_s)).

    Args:
        out_partial: float32 (num_splits, batch, seqlen, nheads, head_dim) or (num_splits, total, nheads,
            head_dim): each split's normalized attention output.
        lse_partial: float32 (num_splits, batch, seqlen, nheads) or (num_splits, total, nheads): each split's
            natural-log log-sum-exp. A split whose row saw no key has -inf or +inf there (+inf is this library's
            functions' value for such rows, -inf FlashAttention-3's); it adds nothing.
        out: optional preallocated output of out_partial's shape without its first dim, written and returned.
        out_dtype: the output's dtype (default: out_partial's, or out's when given).

    Returns:
        (out, lse): out of shape out_partial.shape[1:], and float32 lse of shape lse_partial.shape[1:], +inf for a
        row that no split saw a key for (whose out is 0), as this library's functions give.
    """
    if not isinstance(out_partial, torch.Tensor) or out_partial.dim() not in (4, 5):
        raise ValueError(
            "out_partial must be a 4-D or 5-D tensor (num_splits, batch, seqlen, nheads, head_dim) or "
            "(num_splits, total, nheads, head_dim)"
        )
    if not isinstance(lse_partial, torch.Tensor) or lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(
            f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without head_dim), got "
            + (f"{tuple(lse_partial.shape)}" if isinstance(lse_partial, torch.Tensor) else type(lse_partial).__name__)
        )
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if lse_partial.device != out_partial.device:
        raise ValueError(
            f"lse_partial must be on out_partial's device ({out_partial.device}), got {lse_partial.device}"
        )
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != out_partial.shape[1:]:
            raise ValueError(f"out must have shape {tuple(out_partial.shape[1:])}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype}, but out_dtype is {out_dtype}")
    # A row that saw no key carries no mass, whichever infinity marks it.
    lse = lse_partial.masked_fill(lse_partial == float("inf"), float("-inf"))
    top = lse.amax(dim=0)
    top = top.masked_fill(top == float("-inf"), 0.0)
    weights = torch.exp(lse - top)  # (num_splits, ...): 0 for the splits without a key
    total = weights.sum(dim=0)
    # A split without a key adds nothing, whatever its partial output holds (FlashAttention-3 leaves it unwritten).
    weighted = torch.where(weights.unsqueeze(-1) > 0, out_partial * weights.unsqueeze(-1), 0.0)
    merged = weighted.sum(dim=0) / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    merged_lse = torch.where(total > 0, top + torch.log(total), torch.full_like(total, float("inf")))
    if out is not None:
        return out.copy_(merged), merged_lse
    return merged.to(out_dtype if out_dtype is not None else out_partial.dtype), merged_lse
