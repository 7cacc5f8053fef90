"""Launch plans: which kernel, tile and work split a call runs, and how tests force one.

The host computes one plan per call from the shapes, the GPU and the build (``csrc/host/plan.h``); the same
function answers ``torch.ops.flash_attn2.plan``, so a test that forces a path can assert that the call takes
it. A plan also says how much shared memory per block its kernel takes (``Plan.smem``): a call whose kernel
needs more than the GPU offers is refused before any launch, and ``plan(..., max_smem=...)`` shows which calls
a smaller GPU would refuse.

Overrides are op arguments, never environment variables: ``num_splits`` (the dense forward's key splits, as
flash-attn's ``num_splits``) and ``plan_override``, a test-and-benchmark string of ``key=value`` pairs separated
by ``;``:

- ``kernel=mma_sync`` or ``kernel=wgmma``: the kernel family (wgmma only on sm_90 with an sm_90a build);
- ``gqa_walk=0|1``: whether a Hopper GQA/MQA backward CTA walks every query head of its key/value head;
- ``key_blocks=n``: key blocks per Hopper backward CTA (head dims up to 128);
- ``short_keys=0|1``: the Hopper forward's short-key tile: the warp-specialized kernel's under a causal mask at head
  dim 64, else the other kernel's (head dim 128);
- ``short_queries=0|1``: the Hopper backward's 16-row query tile (head dim 128);
- ``max_smem=bytes``: plan as on a GPU with at most this much shared memory per block, so that a larger GPU
  runs a smaller one's tile sets (``max_smem=101376``: the mma.sync kernels' 99 KiB set of sm_86, sm_89 and
  sm_120).
- ``ws=0|1``: the Hopper warp-specialized TMA kernels, else the kernels whose warps all load and compute: the
  forward's (dense calls of the plain kernels without key splits, GQA packing or the short-key tile) and the
  backward's (plain calls at head dims 64 and 128, not on the short-query tile). A deterministic backward at those
  head dims on Hopper runs the warp-specialized kernel whatever is forced, or the mma.sync one.
- ``gqa_pack=0|1``: 0 runs every query head on its own; 1 (the default) runs the query heads that share a
  key/value head as rows of one head where the kernels can (dense forwards with one query row).
- ``stagger=0|1``: in the Hopper backward at head dims above 128 without a mask or variants, key block n starts
  its walk over the query blocks at query block n (modulo their number), so that a head's key blocks add into
  different query blocks' dQ at once. The default in deterministic mode, where its key blocks then do not wait
  for each other's turns, and only there where a sequence's key blocks all fit the SMs at once; the default mode
  measured slower with it.

A key left out keeps the heuristic's choice. ``force_plan`` sets both for the public functions
(``flash_attn_func`` and the others) called inside it, forward and backward. Two environment variables, read
once per process, make whole test runs take another path: ``FLASH_ATTN2_DISABLE_WGMMA=1`` (the mma.sync kernels
on Hopper) and ``FLASH_ATTN2_MAX_SMEM=bytes`` (``max_smem`` for every call; the kernels also launch with each SM's
shared memory cut to what such a GPU's SM holds, that many bytes plus 1 KiB, so that as many blocks share an SM as
there, where a per-call ``max_smem`` leaves the GPU's own).
"""

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from . import _ops  # noqa: F401  (loads torch.ops.flash_attn2)

# (num_splits, plan_override) that the public functions pass to the ops. A plain module global rather than a
# contextvars.ContextVar: torch.compile (Dynamo) reads a global, guarding on its value, but cannot trace a
# ContextVar's get().
_forced = (0, "")

_OVERRIDE_KEYS = (
    "kernel",
    "gqa_walk",
    "key_blocks",
    "short_keys",
    "short_queries",
    "max_smem",
    "ws",
    "gqa_pack",
    "stagger",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one pass of a call runs (fields that do not apply to the pass keep their neutral value)."""

    pass_: str  # "fwd" or "bwd"
    kernel: str  # "wgmma" or "mma_sync"
    kernel_head_dim: int  # the compiled head dim that runs
    block_m: int  # query rows per block (per step of the backward)
    block_n: int  # keys per block
    causal: bool  # the mask that runs: a causal call with one query row runs unmasked; variants run masked
    variants: bool  # the variants kernel (window, softcap, ALiBi, dropout)
    gqa_pack: int  # query heads packed as rows of their key/value head (1: none)
    num_splits: int  # forward: key splits (1: none)
    short_key_tile: bool  # forward: a Hopper short-key tile (the warp-specialized kernel's where that runs)
    warp_specialized: bool  # the Hopper warp-specialized TMA kernel (forward, or backward at head dims 64 and 128)
    short_query_tile: bool  # backward: the Hopper 16-row query tile
    heads_per_cta: int  # backward: query heads one CTA walks (GQA walk when > 1)
    key_blocks_per_cta: int  # backward: consecutive key blocks one CTA walks
    dkv_fp32_slices: bool  # backward: per-query-head fp32 dK/dV slices summed afterwards (GQA without a walk)
    staggered: bool  # backward: the Hopper wide kernel's key blocks start at their own query blocks (stagger)
    smem: int  # bytes of dynamic shared memory per block that the kernel is launched with
    tile_budget: int  # bytes per block the tile set that runs is made for: 166912 or 101376 (mma.sync), 232448
    narrow_v: bool  # a V narrower than Q and K runs unpadded on a kernel of its own (else V is padded)


def override_string(
    kernel: str | None = None,
    gqa_walk: bool | None = None,
    key_blocks: int | None = None,
    short_keys: bool | None = None,
    short_queries: bool | None = None,
    max_smem: int | None = None,
    ws: bool | None = None,
    gqa_pack: bool | None = None,
    stagger: bool | None = None,
) -> str:
    """The ``plan_override`` op argument for these choices (None: the heuristic decides)."""
    values = {
        "kernel": kernel,
        "gqa_walk": gqa_walk,
        "key_blocks": key_blocks,
        "short_keys": short_keys,
        "short_queries": short_queries,
        "max_smem": max_smem,
        "ws": ws,
        "gqa_pack": gqa_pack,
        "stagger": stagger,
    }
    parts = []
    for key in _OVERRIDE_KEYS:
        value = values[key]
        if value is None:
            continue
        parts.append(f"{key}={int(value) if isinstance(value, bool) else value}")
    return ";".join(parts)


@contextlib.contextmanager
def force_plan(num_splits: int = 0, **choices) -> Iterator[None]:
    """Runs the public functions inside the ``with`` block under these plan choices (keywords of
    ``override_string``; ``num_splits`` > 0 forces the dense forward's key splits). Meant for tests and
    benchmarks; the choices reach the ops as arguments, so torch.compile and CUDA graphs see them."""
    global _forced
    previous = _forced
    _forced = (int(num_splits), override_string(**choices))
    try:
        yield
    finally:
        _forced = previous


def forced() -> tuple[int, str]:
    """(num_splits, plan_override) for the ops: what ``force_plan`` set, else (0, "")."""
    return _forced


def _parse(text: str) -> Plan:
    fields = dict(item.split("=", 1) for item in text.split(";"))
    kwargs = {}
    for field in dataclasses.fields(Plan):
        raw = fields[field.name.rstrip("_")]
        kwargs[field.name] = (
            raw if field.type in ("str", str) else (raw == "1" if field.type in ("bool", bool) else int(raw))
        )
    return Plan(**kwargs)


def plan(
    pass_: str,
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    causal: bool = False,
    deterministic: bool = False,
    varlen: bool = False,
    num_splits: int = 0,
    override: str = "",
    arch: int | None = None,
    num_sms: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    window_size: tuple[int, int] = (-1, -1),
    alibi: bool = False,
    dropout: bool = False,
    softcap: float = 0.0,
    kvcache: bool = False,
    paged: bool = False,
    max_smem: int | None = None,
    head_dim_v: int | None = None,
) -> Plan:
    """The plan of one pass ("fwd" or "bwd") of a call with these sizes.

    For varlen calls, ``batch`` is the number of sequences and the lengths are the maxima. ``override`` is a
    ``plan_override`` string (see ``override_string``). ``arch`` (e.g. 80 or 90) and ``num_sms`` describe the
    GPU; left as None they are the current CUDA device's, and the plan is that of this build. Given, the plan
    is computed for that GPU and a build with every kernel family (no GPU needed). ``dtype`` matters only for
    what the build holds (a causal call with one query row runs the non-causal kernel when it is built).
    ``window_size``, ``alibi`` (slopes given), ``dropout`` (dropout_p > 0) and ``softcap`` are the call's
    variants, which the plan heeds: any of them runs the variants kernel (but for softcap alone or dropout alone
    in the forward, which runs the plain kernels' form for it: the mma.sync ones, or on Hopper the warp-specialized
    one where it serves the call), ALiBi and dropout rule out GQA packing
    (windows too, in the backward), and dropout rules out key splits. ``kvcache``: a forward that reads a KV cache
    (flash_attn_with_kvcache, or paged varlen), which runs the variants kernel; ``seqlen_k`` is then the cache's
    capacity per sequence. ``paged``: that cache is paged (``block_table``; needs ``kvcache``).

    ``max_smem``: the shared memory per block, in bytes, that the GPU offers its kernels (CUDA's
    ``cudaDevAttrMaxSharedMemoryPerBlockOptin``). None: with ``arch``, that arch's documented figure (163 KiB =
    166912 for sm_80 and sm_87, 99 KiB = 101376 for sm_86, sm_89, sm_120 and sm_121, 227 KiB = 232448 for sm_90,
    sm_100 and sm_103; another arch needs it given), else the current device's. The plan is returned even when
    its ``smem`` exceeds ``max_smem``: a call of these sizes would then be refused before its launch.

    ``head_dim_v``: V's head dim where it is narrower than ``head_dim`` (a multiple of 8; None: ``head_dim``). Such
    a call runs on a kernel of its own where one exists (``narrow_v``: Q/K kernel head dim 192 with V's at most 128,
    plain calls; forwards that are not split into key ranges, on Hopper's warp-specialized kernel or the mma.sync
    one; backwards on Hopper's kernel), and otherwise with V zero-padded to ``head_dim``.
    """
    text = torch.ops.flash_attn2.plan(
        pass_,
        batch,
        seqlen_q,
        seqlen_k,
        nheads,
        nheads_k,
        head_dim,
        bool(causal),
        bool(deterministic),
        bool(varlen),
        int(num_splits),
        override,
        -1 if arch is None else int(arch),
        -1 if num_sms is None else int(num_sms),
        dtype == torch.bfloat16,
        int(window_size[0]),
        int(window_size[1]),
        bool(alibi),
        bool(dropout),
        float(softcap),
        bool(kvcache),
        bool(paged),
        -1 if max_smem is None else int(max_smem),
        -1 if head_dim_v is None else int(head_dim_v),
    )
    return _parse(text)
