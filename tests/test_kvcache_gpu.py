"""flash_attn_with_kvcache and paged varlen attention on a CUDA device.

Every correctness check runs the call on fresh random inputs, with its outputs carved from NaN-poisoned memory
(conftest.poison_allocator) and the cache rows it appends into set to NaN beforehand, so that a missed write
shows. The rest of the caches holds random data. It then applies the correctness rule of conftest.check_results
to out, the LSE and the appended cache rows against flash_attn_cuda.reference.kvcache_ref in float32 on upcast
inputs (ref) and in the input dtype (ref_lowp), and asserts that every other cache row is bit-identical to what it
was before the call.

The default run covers: decoding at every kernel head dim with both dtypes and both kernel families
(kernel=mma_sync forced, and the default, the warpgroup-MMA kernels on Hopper); rotary embedding in both layouts,
with partial rotary dims, under the query-position rule of flash-attn 2.x (per row when causal or windowed) and
with cache_leftpad; paged caches with shuffled page tables and unused pages, page sizes 16 to 256 (48 among them),
lengths and appends at page edges; cache_batch_idx; GQA, MQA and MHA; one, several and no new rows; empty
sequences; every attention variant; head dims that are not a multiple of 8; forced key splits; large inputs;
strided caches; paged varlen prefill; CUDA-graph replays over growing lengths; torch.compile; opcheck; argument
validation; out-of-range device values (clamped, never a crash); and the absence of host synchronization.
``--exhaustive`` adds the cross products. Configurations whose kernels were not compiled are skipped.
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    check_results,
    cu_seqlens,
    poison_allocator,
    rand,
    requires_gpu,
    varlen_attention_ref,
)

import flash_attn_cuda
from flash_attn_cuda import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import attention_ref, kvcache_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

ops = torch.ops.flash_attn2
NAN = float("nan")


# ---------------------------------------------------------------- dtypes and kernel families

# (dtype, kernel) pairs. "default" is what the plan picks (the warpgroup-MMA kernels on Hopper), "mma_sync" forces
# the kernels that Ampere runs. A matrix over PAIRS meets both dtypes and both families; ALL_PAIRS crosses them.
PAIRS = [(torch.float16, "default"), (torch.bfloat16, "mma_sync")]
ALL_PAIRS = PAIRS + [(torch.bfloat16, "default"), (torch.float16, "mma_sync")]


def pair_id(pair):
    dtype, kernel = pair
    return f"{dict(zip(DTYPES, DTYPE_IDS)).get(dtype, str(dtype))}-{kernel}"


def kernel_force(kernel):
    return {} if kernel == "default" else {"kernel": kernel}


def require_kernels(head_dim, dtype):
    """Skips unless the forward variants kernel that KV-cache calls run is compiled for this head dim and dtype."""
    if not flash_attn_cuda.kernel_available(head_dim, dtype, True, variants=True):
        pytest.skip(f"variants forward kernel for head_dim={head_dim} {dtype} not compiled")


def round8(n):
    return -(-n // 8) * 8


# ---------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One flash_attn_with_kvcache call, in sizes.

    cache_seqlens: each sequence's cached rows before the append. capacity: rows per sequence (dense: the cache's
    dim 1; paged: rounded up to whole pages). seqlen_new: rows appended (0: k=None, or empty k and v with
    empty_new). batch_idx: None, "perm" (a permutation of the batch) or "extra" (a cache with two more batch rows
    than the batch, rows picked at random). leftpad: each sequence's first key row. rotary_dim: 0 for none.
    alibi: None, "heads" ((nheads,) slopes) or "batch_heads" ((batch, nheads)). gain multiplies q and every key.
    seqlens_as: how cache_seqlens is passed: "tensor" (int32 on the device), "int" (all lengths equal) or "none"
    (the whole cache, no append).
    """

    batch: int = 3
    seqlen_q: int = 1
    seqlen_new: int = 1
    cache_seqlens: tuple = (37, 0, 100)
    capacity: int = 128
    nheads: int = 8
    nheads_k: int = 2
    head_dim: int = 64
    page_size: int | None = None
    extra_pages: int = 3
    batch_idx: str | None = None
    leftpad: tuple | None = None
    rotary_dim: int = 0
    interleaved: bool = True
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None
    gain: float = 1.0
    seqlens_as: str = "tensor"
    softmax_scale: float | None = None
    empty_new: bool = False


@dataclasses.dataclass
class Call:
    """The tensors of one call built from a Case (build), and where its appended rows go."""

    case: Case
    dtype: torch.dtype
    capacity: int
    lens: list  # cache lengths before the append (what the appended mask follows)
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    seqlens: torch.Tensor | None  # int32 (batch,): the reference's cache_seqlens (None: the whole cache)
    batch_idx: torch.Tensor | None
    leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    slopes: torch.Tensor | None
    appended: torch.Tensor | None = None  # bool (cache.shape[0], cache.shape[1]): entries the call writes

    @property
    def seqlen_new(self):
        return 0 if self.k is None else self.k.shape[1]


def make_slopes(kind, batch, nheads):
    """fp32 ALiBi slopes: None, the geometric 2^(-8 i / nheads) (i = 1..nheads), or random (batch, nheads) ones."""
    if kind is None:
        return None
    if kind == "heads":
        return torch.tensor(
            [2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)], dtype=torch.float32, device="cuda"
        )
    assert kind == "batch_heads", kind
    return torch.rand(batch, nheads, dtype=torch.float32, device="cuda") * 0.5


def rotary_tables(seqlen_ro, rotary_dim, dtype):
    """cos and sin (seqlen_ro, rotary_dim / 2) in ``dtype`` of random angles (any angles make a valid table)."""
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device="cuda") * (2 * math.pi)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def cache_entries(call, b, rows):
    """(first indices, second indices) of the cache entries holding sequence b's logical rows ``rows``."""
    rows = list(rows)
    page = call.case.page_size
    if page:
        table = call.block_table[b].tolist()
        return [table[r // page] for r in rows], [r % page for r in rows]
    row = b if call.batch_idx is None else int(call.batch_idx[b])
    return [row] * len(rows), rows


def appended_mask(call):
    """bool (cache.shape[:2]): the entries that the append writes, from call.lens and the new rows."""
    mask = torch.zeros(call.k_cache.shape[:2], dtype=torch.bool, device=call.k_cache.device)
    for b, n in enumerate(call.lens):
        first, second = cache_entries(call, b, range(n, n + call.seqlen_new))
        mask[first, second] = True
    return mask


def build(case, dtype, *, poison_rows=True, nan_outside=False):
    """The tensors of ``case``. poison_rows: the rows the append will write hold NaN. nan_outside: every cache
    entry outside the sequences' key ranges [leftpad, cache_seqlens + seqlen_new) holds NaN (a kernel must never
    read them), pages and batch rows that no sequence uses included."""
    b, h, hk, d = case.batch, case.nheads, case.nheads_k, case.head_dim
    assert len(case.cache_seqlens) == b
    new = case.seqlen_new
    if case.page_size:
        page = case.page_size
        max_pages = -(-case.capacity // page)
        capacity = max_pages * page
        num_pages = b * max_pages + case.extra_pages
        # Shuffled pages; the last extra_pages of the cache belong to no sequence.
        block_table = torch.randperm(num_pages, device="cuda")[: b * max_pages].view(b, max_pages).to(torch.int32)
        cache_shape = (num_pages, page, hk, d)
        batch_idx = None
        assert case.batch_idx is None, "cache_batch_idx cannot be combined with block_table"
    else:
        capacity = case.capacity
        rows = b + (2 if case.batch_idx == "extra" else 0)
        cache_shape = (rows, capacity, hk, d)
        block_table = None
        batch_idx = None
        if case.batch_idx == "perm":
            batch_idx = torch.randperm(b, device="cuda").to(torch.int32)
        elif case.batch_idx == "extra":
            batch_idx = torch.randperm(rows, device="cuda")[:b].to(torch.int32)
    for n in case.cache_seqlens:
        assert 0 <= n and n + new <= capacity, (case, capacity)
    if case.seqlens_as == "none":
        assert new == 0 and all(n == capacity for n in case.cache_seqlens), case
    if case.seqlens_as == "int":
        assert len(set(case.cache_seqlens)) == 1, case

    q = rand(b, case.seqlen_q, h, d, dtype=dtype)
    k_cache, v_cache = rand(*cache_shape, dtype=dtype), rand(*cache_shape, dtype=dtype)
    k = v = None
    if new > 0 or case.empty_new:
        k, v = rand(b, new, hk, d, dtype=dtype), rand(b, new, hk, d, dtype=dtype)
    if case.gain != 1.0:
        # A power of two: the scaling is exact.
        q, k_cache = q * case.gain, k_cache * case.gain
        if k is not None:
            k = k * case.gain
    cos = sin = None
    if case.rotary_dim:
        # Rows past the cache too: with seqlen_q > seqlen_new, per-row query positions run past the new keys.
        cos, sin = rotary_tables(capacity + case.seqlen_q + 8, case.rotary_dim, dtype)
    seqlens = None
    if case.seqlens_as != "none":
        seqlens = torch.tensor(case.cache_seqlens, dtype=torch.int32, device="cuda")
    leftpad = None
    if case.leftpad is not None:
        leftpad = torch.tensor(case.leftpad, dtype=torch.int32, device="cuda")
    call = Call(
        case,
        dtype,
        capacity,
        list(case.cache_seqlens),
        q,
        k_cache,
        v_cache,
        k,
        v,
        cos,
        sin,
        seqlens,
        batch_idx,
        leftpad,
        block_table,
        make_slopes(case.alibi, b, h),
    )
    call.appended = appended_mask(call)
    if nan_outside:
        inside = torch.zeros_like(call.appended)
        for i, n in enumerate(call.lens):
            start = 0 if case.leftpad is None else case.leftpad[i]
            first, second = cache_entries(call, i, range(start, n + new))
            inside[first, second] = True
        k_cache[~inside] = NAN
        v_cache[~inside] = NAN
    if poison_rows:
        k_cache[call.appended] = NAN
        v_cache[call.appended] = NAN
    return call


def call_kwargs(call, num_splits=0):
    """flash_attn_with_kvcache's keyword arguments for ``call`` (LSE returned)."""
    case = call.case
    seqlens = {"tensor": call.seqlens, "int": case.cache_seqlens[0], "none": None}[case.seqlens_as]
    return dict(
        k=call.k,
        v=call.v,
        rotary_cos=call.cos,
        rotary_sin=call.sin,
        cache_seqlens=seqlens,
        cache_batch_idx=call.batch_idx,
        cache_leftpad=call.leftpad,
        block_table=call.block_table,
        softmax_scale=case.softmax_scale,
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        rotary_interleaved=case.interleaved,
        alibi_slopes=call.slopes,
        num_splits=num_splits,
        return_softmax_lse=True,
    )


def ref_kwargs(call):
    case = call.case
    return dict(
        k=call.k,
        v=call.v,
        rotary_cos=call.cos,
        rotary_sin=call.sin,
        cache_seqlens=call.seqlens,
        cache_batch_idx=call.batch_idx,
        cache_leftpad=call.leftpad,
        block_table=call.block_table,
        softmax_scale=case.softmax_scale,
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        rotary_interleaved=case.interleaved,
        alibi_slopes=call.slopes,
    )


def bits(t):
    """The raw 16-bit patterns of a float16/bfloat16 tensor (so that NaN compares equal to itself)."""
    return t.contiguous().view(torch.int16)


def check_call(call, out, lse, k_before, v_before):
    """The correctness rule on out, lse and the appended cache rows against kvcache_ref on the caches as they
    were before the call (k_before, v_before); every other cache entry bit-identical to before."""
    b, sq, h, _ = call.q.shape
    assert out.shape == call.q.shape and out.dtype == call.dtype, (out.shape, out.dtype)
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    kwargs = ref_kwargs(call)
    ref = kvcache_ref(call.q, k_before, v_before, upcast=True, **kwargs)
    lowp = kvcache_ref(call.q, k_before, v_before, upcast=False, **kwargs)
    check_results(("out", "lse"), (out, lse), ref[:2], lowp[:2], call.dtype)
    app = call.appended
    for name, ours, before, r, lp in zip(
        ("k_cache", "v_cache"), (call.k_cache, call.v_cache), (k_before, v_before), ref[2:], lowp[2:]
    ):
        if app.any():
            check_results((name,), (ours[app],), (r[app],), (lp[app],), call.dtype)
        assert torch.equal(bits(ours[~app]), bits(before[~app])), f"{name}: an entry outside the appended rows changed"


def check_plan(call, kernel="default", num_splits=0):
    """The plan of the call on this GPU: the variants kernel, the forced kernel family and splits, and GQA packing
    exactly for one query row without ALiBi."""
    case = call.case
    p = plan(
        "fwd",
        batch=case.batch,
        seqlen_q=case.seqlen_q,
        seqlen_k=call.capacity,
        nheads=case.nheads,
        nheads_k=case.nheads_k,
        head_dim=round8(case.head_dim),
        causal=case.causal,
        num_splits=num_splits,
        override=override_string(**kernel_force(kernel)),
        dtype=call.dtype,
        window_size=case.window,
        alibi=case.alibi is not None,
        softcap=case.softcap,
        kvcache=True,
        paged=case.page_size is not None,
    )
    assert p.variants, p
    if kernel != "default":
        assert p.kernel == kernel, p
    if num_splits:
        assert p.num_splits == num_splits, p
    packs = case.seqlen_q == 1 and case.nheads > case.nheads_k and case.alibi is None
    assert p.gqa_pack == (case.nheads // case.nheads_k if packs else 1), p
    # Paged decoding on Hopper at head dim 128 runs the short-key tile, whose paged loads are unrolled.
    short = (
        case.page_size is not None
        and p.kernel == "wgmma"
        and p.kernel_head_dim == 128
        and case.seqlen_q * p.gqa_pack <= 64
    )
    assert not short or p.short_key_tile, p
    return p


def run_call(call, kernel="default", num_splits=0):
    """The call on poisoned memory under the kernel family, checked. Returns (out, lse)."""
    check_plan(call, kernel, num_splits)
    k_before, v_before = call.k_cache.clone(), call.v_cache.clone()
    poison_allocator(call.q.device)
    with force_plan(**kernel_force(kernel)):
        out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call_kwargs(call, num_splits))
    check_call(call, out, lse, k_before, v_before)
    return out, lse


def run_case(case, dtype, kernel="default", num_splits=0, **build_kwargs):
    require_kernels(case.head_dim, dtype)
    call = build(case, dtype, **build_kwargs)
    run_call(call, kernel, num_splits)
    return call


# ---------------------------------------------------------------- decoding at every kernel head dim


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_decode_head_dims(head_dim, pair):
    """One new token per sequence, GQA 8:2 (packed), rotary (full or half the head dim, both layouts), dense or
    paged (alternating), lengths 37, 0 (the new token alone) and 100."""
    dtype, kernel = pair
    index = KERNEL_HEAD_DIMS.index(head_dim) + ALL_PAIRS.index(pair)
    case = Case(
        head_dim=head_dim,
        rotary_dim=head_dim if index % 2 else head_dim // 2,
        interleaved=index % 2 == 0,
        page_size=32 if index % 2 else None,
    )
    run_case(case, dtype, kernel)


# ---------------------------------------------------------------- rotary embedding

# Where flash_attn_with_kvcache rotates the queries (reference.rotary_per_row): per row (cache_seqlens + i) when
# causal or windowed, else every row at cache_seqlens; a window side at or past the capacity counts as unbounded.
ROTARY_MODES = {
    "plain": dict(),  # every row at cache_seqlens
    "causal": dict(causal=True),  # per row
    "window": dict(window=(16, 4)),  # per row
    "window-cap-1": dict(window=(127, -1)),  # per row; sees every key all the same
    "window-at-cap": dict(window=(128, 128)),  # unbounded both sides: every row at cache_seqlens
}


@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("mode", list(ROTARY_MODES))
def test_rotary_query_positions(mode, interleaved, rotary):
    """Seven query rows and three new keys: the query-position rule decides the output. The lengths leave one
    sequence with fewer keys than queries (rows with no key under causal)."""
    dtype, kernel = PAIRS[int(interleaved)]
    case = Case(
        batch=3,
        seqlen_q=7,
        seqlen_new=3,
        cache_seqlens=(40, 3, 100),
        capacity=128,
        nheads=6,
        nheads_k=2,
        head_dim=64,
        rotary_dim=64 if rotary == "full" else 32,
        interleaved=interleaved,
        **ROTARY_MODES[mode],
    )
    run_case(case, dtype, kernel)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("mode", list(ROTARY_MODES))
def test_rotary_leftpad_paged(mode, interleaved):
    """Rotary over a paged cache with left padding (positions count from cache row 0, not from the padding), and
    a rotary dim of 10 (five pairs, not a multiple of 16)."""
    dtype, kernel = PAIRS[1 - int(interleaved)]
    case = Case(
        batch=3,
        seqlen_q=7,
        seqlen_new=3,
        cache_seqlens=(40, 3, 100),
        leftpad=(17, 3, 64),
        capacity=128,
        page_size=32,
        nheads=6,
        nheads_k=2,
        head_dim=64,
        rotary_dim=10,
        interleaved=interleaved,
        **ROTARY_MODES[mode],
    )
    run_case(case, dtype, kernel)


# ---------------------------------------------------------------- paged caches

PAGE_SIZES = [16, 32, 48, 64, 256]


def page_edge_case(page, edge):
    """Lengths at a page edge, for page size ``page``, in a table of four pages per sequence (the last unused)."""
    base = dict(batch=3, capacity=4 * page, page_size=page, nheads=6, nheads_k=2)
    if edge == "append-last-row":  # the new token fills a page's last row
        return Case(cache_seqlens=(page - 1, 2 * page - 1, 0), seqlen_new=1, seqlen_q=1, **base)
    if edge == "append-first-row":  # the new token opens a page
        return Case(cache_seqlens=(page, 2 * page, 1), seqlen_new=1, seqlen_q=1, rotary_dim=32, **base)
    if edge == "read-at-edges":  # no append: lengths page - 1, page, page + 1
        return Case(cache_seqlens=(page + 1, page - 1, page), seqlen_new=0, seqlen_q=3, causal=True, **base)
    assert edge == "append-across", edge  # five new rows across an edge
    return Case(
        cache_seqlens=(page - 2, 2 * page - 3, 0),
        seqlen_new=5,
        seqlen_q=5,
        causal=True,
        rotary_dim=64,
        interleaved=False,
        **base,
    )


PAGE_EDGES = ["append-last-row", "append-first-row", "read-at-edges", "append-across"]


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("edge", PAGE_EDGES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_page_edges(page_size, edge, pair):
    dtype, kernel = pair
    case = dataclasses.replace(page_edge_case(page_size, edge), head_dim=64 if kernel == "default" else 128)
    run_case(case, dtype, kernel)


# Paged decoding at head dim 128 runs the Hopper short-key tile (64 rows, two CTAs per SM), whose paged loads are
# unrolled (check_plan asserts the tile). Long caches so that only the paged rule picks it; left padding and a
# window folded into the keys start key blocks off the page grid.
PAGED_DECODE = {
    "gqa-window-leftpad": Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(700, 33, 1000),
        leftpad=(5, 0, 77),
        capacity=1100,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        window=(300, 0),
        rotary_dim=64,
    ),
    "mha-softcap-gain": Case(
        batch=2,
        seqlen_q=1,
        seqlen_new=0,
        cache_seqlens=(1999, 517),
        capacity=2000,
        nheads=4,
        nheads_k=4,
        head_dim=128,
        softcap=20.0,
        gain=16.0,
    ),
    "mqa-causal-rows": Case(
        batch=2,
        seqlen_q=5,
        seqlen_new=5,
        cache_seqlens=(1301, 0),
        capacity=1400,
        nheads=8,
        nheads_k=1,
        head_dim=128,
        causal=True,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("name", list(PAGED_DECODE))
def test_paged_decode_short_key_tile(name, page_size, dtype):
    case = dataclasses.replace(PAGED_DECODE[name], page_size=page_size)
    run_case(case, dtype, num_splits=3 if page_size == 48 else 0)


# ---------------------------------------------------------------- cache_batch_idx and cache_leftpad


@pytest.mark.parametrize("new", [0, 2])
@pytest.mark.parametrize("leftpad", [False, True], ids=["no-leftpad", "leftpad"])
@pytest.mark.parametrize("mode", ["perm", "extra"])
def test_cache_batch_idx(mode, leftpad, new):
    """A permuted mapping, and a cache with more batch rows than the batch; with left padding one sequence's
    padding covers every cached row (no key at all without an append)."""
    dtype, kernel = PAIRS[new // 2]
    case = Case(
        batch=3,
        seqlen_q=2 if new else 1,
        seqlen_new=new,
        cache_seqlens=(40, 7, 90),
        leftpad=(10, 7, 0) if leftpad else None,
        capacity=96,
        nheads=4,
        nheads_k=2,
        head_dim=128,
        batch_idx=mode,
        causal=bool(new),
    )
    run_case(case, dtype, kernel)


# ---------------------------------------------------------------- heads and lengths

HEADS = {"gqa8-2": (8, 2), "gqa6-2": (6, 2), "mqa": (4, 1), "mha": (4, 4)}


@pytest.mark.parametrize("new", [0, 1, 5])
@pytest.mark.parametrize("seqlen_q", [1, 7, 64])
@pytest.mark.parametrize("heads", list(HEADS))
def test_heads_and_lengths(heads, seqlen_q, new):
    """GQA, MQA and MHA; decoding and longer query chunks (causal); no, one and several new rows; cache lengths
    0 (no key at all without an append) and 1."""
    h, hk = HEADS[heads]
    dtype, kernel = ALL_PAIRS[(seqlen_q + new + len(heads)) % 4]
    case = Case(
        batch=3,
        seqlen_q=seqlen_q,
        seqlen_new=new,
        cache_seqlens=(0, 1, 50),
        capacity=128,
        nheads=h,
        nheads_k=hk,
        head_dim=64,
        causal=seqlen_q > 1,
    )
    run_case(case, dtype, kernel)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_empty_new_rows(layout):
    """k and v with zero rows: nothing appended, and the rotary tables still rotate q."""
    case = Case(
        batch=2,
        seqlen_q=3,
        seqlen_new=0,
        empty_new=True,
        cache_seqlens=(0, 33),
        capacity=64,
        page_size=16 if layout == "paged" else None,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        rotary_dim=32,
        causal=True,
    )
    run_case(case, torch.bfloat16)


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("length", ["zero", "middle", "full"])
def test_int_cache_seqlens(length, layout):
    """cache_seqlens as a Python int, up to the last rows that fit."""
    n = {"zero": 0, "middle": 20, "full": 64 - 3}[length]
    case = Case(
        batch=2,
        seqlen_q=3,
        seqlen_new=3,
        cache_seqlens=(n, n),
        seqlens_as="int",
        capacity=64,
        page_size=16 if layout == "paged" else None,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        causal=True,
        rotary_dim=16,
    )
    run_case(case, torch.float16, "mma_sync" if layout == "paged" else "default")


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_whole_cache_without_seqlens(layout):
    """cache_seqlens=None: every row of the cache is a key."""
    case = Case(
        batch=2,
        seqlen_q=4,
        seqlen_new=0,
        cache_seqlens=(96, 96),
        seqlens_as="none",
        capacity=96,
        page_size=48 if layout == "paged" else None,
        nheads=4,
        nheads_k=1,
        head_dim=64,
        window=(30, 0),
    )
    run_case(case, torch.bfloat16)


# ---------------------------------------------------------------- attention variants

VARIANTS = {
    "causal": dict(causal=True),
    "win-left": dict(window=(20, -1)),
    "win-right": dict(window=(-1, 5)),
    "win-both": dict(window=(30, 10)),
    "win-0-0": dict(window=(0, 0)),
    "causal-left": dict(causal=True, window=(25, -1)),
    "softcap": dict(softcap=5.0, gain=2.0),
    "alibi-h": dict(alibi="heads"),
    "alibi-bh-causal": dict(causal=True, alibi="batch_heads"),
    "combo": dict(window=(40, 8), softcap=10.0, alibi="batch_heads"),
    "combo-causal": dict(causal=True, window=(32, -1), softcap=15.0, alibi="heads"),
}

VARIANT_SHAPES = {
    # One query row: GQA packed (windows folded into the key range) unless ALiBi.
    "decode-gqa": Case(
        batch=3, seqlen_q=1, seqlen_new=1, cache_seqlens=(100, 0, 250), capacity=256, nheads=8, nheads_k=2, head_dim=128
    ),
    # Seven rows with rotary and left padding, one sequence whose keys are the new ones only.
    "chunk-leftpad-rotary": Case(
        batch=2,
        seqlen_q=7,
        seqlen_new=3,
        cache_seqlens=(60, 9),
        leftpad=(20, 9),
        capacity=128,
        nheads=6,
        nheads_k=2,
        head_dim=64,
        rotary_dim=32,
        interleaved=False,
    ),
    # A prefill of 64 rows into a paged cache of 48-row pages, MQA.
    "prefill-paged48": Case(
        batch=2,
        seqlen_q=64,
        seqlen_new=64,
        cache_seqlens=(0, 70),
        capacity=144,
        page_size=48,
        nheads=4,
        nheads_k=1,
        head_dim=96,
    ),
}


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("shape", list(VARIANT_SHAPES))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants(name, shape, pair):
    run_case(dataclasses.replace(VARIANT_SHAPES[shape], **VARIANTS[name]), *pair)


@pytest.mark.parametrize("scale", [0.05, -0.3])
def test_explicit_softmax_scale(scale):
    """softcap applies after the scale; a negative scale (run as -q with |scale|, rotated all the same) changes
    nothing."""
    case = Case(
        batch=2,
        seqlen_q=3,
        seqlen_new=3,
        cache_seqlens=(20, 41),
        capacity=64,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        rotary_dim=64,
        causal=True,
        softcap=10.0,
        softmax_scale=scale,
    )
    run_case(case, torch.bfloat16)


@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
def test_large_magnitude_fp16(kernel):
    """fp16 q and keys times 16 (scores in the thousands): no NaN or overflow (check_close rejects any NaN)."""
    case = Case(
        batch=2,
        seqlen_q=3,
        seqlen_new=3,
        cache_seqlens=(50, 200),
        capacity=256,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        gain=16.0,
        causal=True,
        rotary_dim=128,
        softcap=30.0 if kernel == "mma_sync" else 0.0,
    )
    run_case(case, torch.float16, kernel)


# ---------------------------------------------------------------- head dims that are not a multiple of 8


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rotary", "rotary"])
@pytest.mark.parametrize("layout", ["dense", "paged32"])
@pytest.mark.parametrize("head_dim", [60, 100])
def test_head_dim_padding(head_dim, layout, rotary):
    """The wrapper pads the caches into copies: the appended rows must still land in the caller's caches (which
    check_call compares), and nothing else there may change."""
    case = Case(
        batch=2,
        seqlen_q=2,
        seqlen_new=2,
        cache_seqlens=(31, 5),
        capacity=64,
        page_size=32 if layout == "paged32" else None,
        nheads=4,
        nheads_k=2,
        head_dim=head_dim,
        rotary_dim=32 if rotary else 0,
        causal=True,
    )
    run_case(case, torch.float16 if rotary else torch.bfloat16)


# ---------------------------------------------------------------- key splits

SPLIT_SHAPES = {
    # One query row over up to 1000 keys, one sequence empty of keys but its new token.
    "dense-decode": Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(700, 0, 1000),
        capacity=1024,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        causal=True,
        rotary_dim=64,
    ),
    # Seven rows into a paged cache with a causal window and ALiBi.
    "paged-chunk": Case(
        batch=2,
        seqlen_q=7,
        seqlen_new=7,
        cache_seqlens=(1000, 513),
        capacity=1088,
        page_size=64,
        nheads=4,
        nheads_k=4,
        head_dim=64,
        window=(200, 0),
        alibi="heads",
    ),
}


@pytest.mark.parametrize("shape", list(SPLIT_SHAPES))
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_forced_num_splits(num_splits, shape):
    """num_splits forces the key splits (the plan says so); every split count meets the bar."""
    run_case(SPLIT_SHAPES[shape], torch.bfloat16, num_splits=num_splits)


# ---------------------------------------------------------------- memory the kernels must not read or write


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_rows_outside_the_sequences_are_never_read(layout):
    """Every cache entry outside [leftpad, cache_seqlens + seqlen_new) of each sequence is NaN, unused batch rows
    and pages included: one read of them would make the output NaN."""
    case = Case(
        batch=3,
        seqlen_q=4,
        seqlen_new=2,
        cache_seqlens=(30, 5, 60),
        leftpad=(10, 0, 33),
        capacity=80,
        page_size=16 if layout == "paged" else None,
        batch_idx="extra" if layout == "dense" else None,
        nheads=6,
        nheads_k=2,
        head_dim=64,
        causal=True,
    )
    run_case(case, torch.bfloat16, nan_outside=True)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_strided_caches_and_new_rows(layout):
    """Caches and new rows that are views of interleaved k/v buffers ((..., 2, nheads_k, head_dim)): the append
    writes through the strides, and leaves the other half of each buffer alone."""
    case = Case(
        batch=2,
        seqlen_q=1,
        seqlen_new=3,
        cache_seqlens=(14, 45),
        capacity=64,
        page_size=16 if layout == "paged" else None,
        nheads=8,
        nheads_k=2,
        head_dim=64,
        rotary_dim=64,
    )
    require_kernels(64, torch.bfloat16)
    call = build(case, torch.bfloat16)
    kv_cache = torch.stack((call.k_cache, call.v_cache), dim=2)
    kv_new = torch.stack((call.k, call.v), dim=2)
    call.k_cache, call.v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]
    call.k, call.v = kv_new[:, :, 0], kv_new[:, :, 1]
    assert not call.k_cache.is_contiguous() and not call.k.is_contiguous()
    run_call(call)


# ---------------------------------------------------------------- paged varlen prefill

VARLEN_LENS_Q = [3, 0, 17, 1, 40, 5]
VARLEN_LENS_K = [40, 0, 300, 1, 16, 0]  # an empty sequence, and queries against no key


def run_varlen_paged(
    lens_q,
    lens_k,
    h,
    hk,
    d,
    dtype,
    page_size,
    kernel="default",
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
):
    """flash_attn_varlen_func with a block table against varlen_attention_ref on each sequence's keys gathered
    from its pages; the caches must come out untouched."""
    require_kernels(d, dtype)
    batch = len(lens_q)
    max_pages = max(1, -(-max(lens_k) // page_size)) + 1  # one table column that no key reaches
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages, device="cuda")[: batch * max_pages].view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    k_cache = rand(num_pages, page_size, hk, d, dtype=dtype)
    v_cache = rand(num_pages, page_size, hk, d, dtype=dtype)
    q = rand(sum(lens_q), h, d, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    slopes = make_slopes(alibi, batch, h)
    p = plan(
        "fwd",
        batch=batch,
        seqlen_q=max(lens_q),
        seqlen_k=max(lens_k),
        nheads=h,
        nheads_k=hk,
        head_dim=round8(d),
        causal=causal,
        varlen=True,
        override=override_string(**kernel_force(kernel)),
        dtype=dtype,
        window_size=window,
        alibi=alibi is not None,
        softcap=softcap,
        kvcache=True,
        paged=True,
    )
    assert p.variants and p.gqa_pack == 1 and p.num_splits == 1, p
    if kernel != "default":
        assert p.kernel == kernel, p
    k_before, v_before = k_cache.clone(), v_cache.clone()
    poison_allocator(q.device)
    with force_plan(**kernel_force(kernel)):
        out, lse, s_dmask = flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            max(lens_q),
            max(lens_k),
            causal=causal,
            window_size=window,
            softcap=softcap,
            alibi_slopes=slopes,
            return_attn_probs=True,
            block_table=block_table,
        )
    assert s_dmask is None
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32
    rows = [k_cache[block_table[b].long()].flatten(0, 1)[: lens_k[b]] for b in range(batch)]
    k_dense = torch.cat(rows)
    v_dense = torch.cat([v_cache[block_table[b].long()].flatten(0, 1)[: lens_k[b]] for b in range(batch)])

    def attend(upcast):
        return varlen_attention_ref(
            q,
            k_dense,
            v_dense,
            lens_q,
            lens_k,
            None,
            causal,
            upcast,
            window_size=window,
            softcap=softcap,
            alibi_slopes=slopes,
        )

    check_results(("out", "lse"), (out, lse), attend(True), attend(False), dtype)
    assert torch.equal(bits(k_cache), bits(k_before)) and torch.equal(bits(v_cache), bits(v_before))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_varlen_paged(page_size, causal):
    dtype, kernel = PAIRS[([16, 48, 256].index(page_size) + causal) % 2]  # both families at each page size
    run_varlen_paged(
        VARLEN_LENS_Q, VARLEN_LENS_K, 6, 2, 64 if kernel == "default" else 128, dtype, page_size, kernel, causal=causal
    )


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize(
    "variant",
    [dict(window=(30, 5), softcap=8.0, alibi="batch_heads"), dict(causal=True, window=(20, -1), alibi="heads")],
    ids=["combo", "combo-causal"],
)
def test_varlen_paged_variants(variant, pair):
    run_varlen_paged(VARLEN_LENS_Q, VARLEN_LENS_K, 4, 1, 96, pair[0], 32, pair[1], **variant)


def paged_sequences(lens_q, lens_k, h, hk, d, dtype, page_size):
    """(q, k_cache, v_cache, cu_q, cu_k, block_table, k_dense, v_dense) of a paged varlen call on random data, with
    shuffled pages; k_dense and v_dense are each sequence's keys and values gathered from its pages, packed."""
    batch = len(lens_q)
    max_pages = max(1, -(-max(lens_k) // page_size))
    num_pages = batch * max_pages + 2
    block_table = torch.randperm(num_pages, device="cuda")[: batch * max_pages].view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    k_cache = rand(num_pages, page_size, hk, d, dtype=dtype)
    v_cache = rand(num_pages, page_size, hk, d, dtype=dtype)
    q = rand(sum(lens_q), h, d, dtype=dtype)
    k_dense, v_dense = (
        torch.cat([cache[block_table[b].long()].flatten(0, 1)[: lens_k[b]] for b in range(batch)])
        for cache in (k_cache, v_cache)
    )
    return q, k_cache, v_cache, cu_seqlens(lens_q), cu_seqlens(lens_k), block_table, k_dense, v_dense


def sink_varlen_ref(q, k, v, lens_q, lens_k, causal, sink, upcast):
    """reference.attention_ref with a sink on each sequence, packed again: out (total_q, h, d), lse (h, total_q)."""
    outs, lses = [], []
    starts_q, starts_k = cu_seqlens(lens_q).tolist(), cu_seqlens(lens_k).tolist()
    for b in range(len(lens_q)):
        out, lse = attention_ref(
            q[None, starts_q[b] : starts_q[b + 1]],
            k[None, starts_k[b] : starts_k[b + 1]],
            v[None, starts_k[b] : starts_k[b + 1]],
            None,
            causal,
            upcast=upcast,
            learnable_sink=sink,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


PAGED_GRAD_OF = {"q": ("q",), "caches": ("k", "v"), "sink": ("sink",), "all": ("q", "k", "v", "sink")}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad_of", list(PAGED_GRAD_OF))
def test_varlen_paged_forward_with_grad_inputs(grad_of, compiled):
    """flash-attn 2.x's test_flash_attn_varlen_causal runs the paged forward with q and the caches requiring grad and
    skips only the backward. Here: the forward runs with such inputs (the sink among them), its outputs are right
    (the correctness rule) and bit-identical to the same call's under torch.no_grad(), they carry a grad_fn, and a
    backward through them raises naming block_table; eagerly and under torch.compile(fullgraph=True). dropout_p != 0
    stays refused."""
    dtype = torch.bfloat16
    require_kernels(64, dtype)
    lens_q, lens_k = [5, 9, 1, 17], [20, 9, 33, 40]
    q, k_cache, v_cache, cu_q, cu_k, block_table, k_dense, v_dense = paged_sequences(
        lens_q, lens_k, 4, 2, 64, dtype, 16
    )
    sink = torch.randn(4, device="cuda")
    inputs = dict(q=q, k=k_cache, v=v_cache, sink=sink)
    for name in PAGED_GRAD_OF[grad_of]:
        inputs[name].requires_grad_()

    def call(q, k, v, sink):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(lens_q),
            max(lens_k),
            causal=True,
            return_attn_probs=True,
            block_table=block_table,
            learnable_sink=sink,
        )
        return out, lse

    if compiled:
        torch._dynamo.reset()
    run = torch.compile(call, fullgraph=True) if compiled else call
    poison_allocator(q.device)
    out, lse = run(**inputs)
    assert out.requires_grad and out.grad_fn is not None and lse.grad_fn is not None
    with torch.no_grad():
        out_ng, lse_ng = call(**inputs)
    assert torch.equal(bits(out.detach()), bits(out_ng)) and torch.equal(lse.detach(), lse_ng)

    def attend(upcast):
        return sink_varlen_ref(q.detach(), k_dense, v_dense, lens_q, lens_k, True, sink.detach(), upcast)

    check_results(("out", "lse"), (out.detach(), lse.detach()), attend(True), attend(False), dtype)
    # What code that never calls backward does with such outputs works; a backward raises.
    loss = out.float().sum() + lse.sum()
    with pytest.raises(RuntimeError, match="block_table"):
        loss.backward()
    assert all(inputs[name].grad is None for name in PAGED_GRAD_OF[grad_of])
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=0.1, block_table=block_table
        )


# ---------------------------------------------------------------- CUDA graphs, torch.compile, opcheck


@pytest.mark.parametrize("layout", ["dense", "paged16"])
def test_cuda_graph_replays_as_lengths_grow(layout):
    """One decoding step (append one token, rotate, attend) captured once with a device cache_seqlens, then
    replayed five times with fresh q, k, v and cache_seqlens.add_(1) between replays, across page edges: each
    replay is right, which also shows that the step never reads the lengths on the host (capture would fail on
    a synchronization, and a replay would reuse stale lengths)."""
    dtype = torch.bfloat16
    require_kernels(128, dtype)
    case = Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(13, 0, 29),
        leftpad=(3, 0, 0),
        capacity=48,
        page_size=16 if layout == "paged16" else None,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        rotary_dim=64,
        interleaved=False,
        causal=True,
    )
    call = build(case, dtype, poison_rows=False)
    kwargs = call_kwargs(call)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs)
    for _ in range(5):
        for t in (call.q, call.k, call.v):
            t.copy_(torch.randn_like(t))
        call.appended = appended_mask(call)
        call.k_cache[call.appended] = NAN
        call.v_cache[call.appended] = NAN
        k_before, v_before = call.k_cache.clone(), call.v_cache.clone()
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_call(call, out, lse, k_before, v_before)
        call.seqlens.add_(1)
        call.lens = [n + 1 for n in call.lens]


def test_compile_decode_step_matches_eager():
    """torch.compile(fullgraph=True) of a step that appends to paged caches (graph inputs) and attends: outputs and
    caches bitwise equal to eager mode over three steps (the same kernels run), and eager mode right."""
    dtype = torch.bfloat16
    require_kernels(128, dtype)
    case = Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(15, 0, 40),
        capacity=64,
        page_size=16,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        rotary_dim=128,
        interleaved=False,
        causal=True,
    )
    call = build(case, dtype, poison_rows=False)

    def step(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, block_table):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=True,
            rotary_interleaved=False,
            return_softmax_lse=True,
        )

    compiled = torch.compile(step, fullgraph=True)
    k_eager, v_eager = call.k_cache.clone(), call.v_cache.clone()
    k_comp, v_comp = call.k_cache.clone(), call.v_cache.clone()
    for i in range(3):
        q, k, v = torch.randn_like(call.q), torch.randn_like(call.k), torch.randn_like(call.v)
        k_before, v_before = k_eager.clone(), v_eager.clone()
        out_e, lse_e = step(q, k_eager, v_eager, k, v, call.cos, call.sin, call.seqlens, call.block_table)
        out_c, lse_c = compiled(q, k_comp, v_comp, k, v, call.cos, call.sin, call.seqlens, call.block_table)
        assert torch.equal(out_e, out_c), i
        assert torch.equal(lse_e, lse_c), i
        assert torch.equal(k_eager, k_comp) and torch.equal(v_eager, v_comp), i
        if i == 0:
            call.q, call.k, call.v, call.k_cache, call.v_cache = q, k, v, k_eager, v_eager
            call.appended = appended_mask(call)
            check_call(call, out_e, lse_e, k_before, v_before)
        call.seqlens.add_(1)
        call.lens = [n + 1 for n in call.lens]


@pytest.mark.parametrize("append", [False, True], ids=["read-only", "append"])
def test_opcheck_fwd_kvcache(append):
    """torch.library.opcheck with its default tests (schema, autograd registration, fake tensor, AOT dispatch with
    dynamic shapes). They run the op several times on copies of the arguments: without k and v the op only reads
    the caches; with them, a repeated call appends the same rotated rows at the same positions (cache_seqlens does
    not move), so every run mutates the caches the same way and the checks compare like with like."""
    dtype = torch.bfloat16
    require_kernels(64, dtype)
    case = Case(
        batch=2,
        seqlen_q=1 if append else 4,
        seqlen_new=2 if append else 0,
        cache_seqlens=(9, 30),
        leftpad=(2, 0),
        capacity=48,
        page_size=16,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        rotary_dim=32 if append else 0,
    )
    call = build(case, dtype, poison_rows=False)
    slopes = make_slopes("batch_heads", 2, 4)
    args = (
        call.q,
        call.k_cache,
        call.v_cache,
        call.k,
        call.v,
        call.cos,
        call.sin,
        call.seqlens,
        None,
        call.leftpad,
        call.block_table,
        0.125,
        True,
        20,
        -1,
        10.0,
        True,
        slopes,
        0,
        "",
    )
    torch.library.opcheck(ops.fwd_kvcache.default, args)


# ---------------------------------------------------------------- no host synchronization


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_no_host_sync(layout):
    """A decoding step under torch.cuda.set_sync_debug_mode("error"): no device-to-host copy or synchronization
    (with a tensor cache_seqlens, and with an int one, which the wrapper turns into a device tensor)."""
    dtype = torch.float16
    require_kernels(128, dtype)
    case = Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(20, 20, 20),
        leftpad=(0, 4, 2),
        capacity=64,
        page_size=16 if layout == "paged" else None,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        rotary_dim=64,
        causal=True,
        window=(30, -1),
        softcap=20.0,
    )
    call = build(case, dtype, poison_rows=False)
    kwargs = call_kwargs(call)
    k_before, v_before = call.k_cache.clone(), call.v_cache.clone()
    flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs)  # first call: lazy initializations
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs)
        flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **{**kwargs, "cache_seqlens": 20})
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    # Each call appended the same rows at the same positions: one append's worth, checked against the reference.
    check_call(call, out, lse, k_before, v_before)


# ---------------------------------------------------------------- argument validation


def bad_base(dtype, device, paged=False):
    """Valid arguments for a batch of 2, 4 query heads, 2 key/value heads, head dim 64: a dense cache of 64 rows
    (paged: 6 pages of 16 rows, 3 per sequence), one new row, cache_seqlens (3, 5)."""
    args = dict(q=rand(2, 1, 4, 64, dtype=dtype, device=device))
    if paged:
        args["k_cache"], args["v_cache"] = (rand(6, 16, 2, 64, dtype=dtype, device=device) for _ in range(2))
        args["block_table"] = torch.tensor([[0, 1, 2], [5, 4, 3]], dtype=torch.int32, device=device)
    else:
        args["k_cache"], args["v_cache"] = (rand(2, 64, 2, 64, dtype=dtype, device=device) for _ in range(2))
    args["k"], args["v"] = (rand(2, 1, 2, 64, dtype=dtype, device=device) for _ in range(2))
    args["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32, device=device)
    return args


def _rotary(args, rows, pairs, dtype=None):
    like = args["q"]
    args["rotary_cos"], args["rotary_sin"] = (
        torch.rand(rows, pairs, dtype=dtype or like.dtype, device=like.device) for _ in range(2)
    )


def _set(**changes):
    def apply(args):
        device, dtype = args["q"].device, args["q"].dtype
        for name, value in changes.items():
            args[name] = value(device, dtype) if callable(value) else value

    return apply


def _i32(*values, dtype=torch.int32):
    return lambda device, _: torch.tensor(values, dtype=dtype, device=device)


def _randn(*shape):
    return lambda device, dtype: rand(*shape, dtype=dtype, device=device)


# id: (paged base, what to change, what the ValueError's message must name).
BAD_ARGS = {
    "page-size-24": (True, _set(k_cache=_randn(6, 24, 2, 64), v_cache=_randn(6, 24, 2, 64)), "page size"),
    "block-table-int64": (True, lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    "block-table-1d": (True, lambda a: a.update(block_table=a["block_table"].flatten()), "block_table"),
    "block-table-batch": (
        True,
        _set(block_table=lambda d, _: torch.zeros(3, 3, dtype=torch.int32, device=d)),
        "block_table",
    ),
    "cache-seqlens-int-past": (False, _set(cache_seqlens=64), "cache_seqlens"),
    "cache-seqlens-int-past-paged": (True, _set(cache_seqlens=48), "cache_seqlens"),
    "cache-seqlens-int-negative": (False, _set(cache_seqlens=-1), "cache_seqlens"),
    "cache-seqlens-missing": (False, _set(cache_seqlens=None), "cache_seqlens"),
    "cache-seqlens-int64": (False, _set(cache_seqlens=_i32(3, 5, dtype=torch.int64)), "cache_seqlens"),
    "cache-seqlens-shape": (False, _set(cache_seqlens=_i32(3, 5, 7)), "cache_seqlens"),
    "rotary-dim-over-head-dim": (False, lambda a: _rotary(a, 64, 40), "rotary_cos"),
    "rotary-without-k": (False, lambda a: (_rotary(a, 64, 16), a.update(k=None, v=None)), "rotary_cos"),
    "rotary-too-few-rows": (False, lambda a: _rotary(a, 63, 16), "rotary_cos"),
    "rotary-fp32": (False, lambda a: _rotary(a, 64, 16, torch.float32), "rotary_cos"),
    "k-without-v": (False, _set(v=None), "k and v"),
    "v-without-k": (False, _set(k=None), "k and v"),
    "batch-idx-with-block-table": (True, _set(cache_batch_idx=_i32(1, 0)), "cache_batch_idx"),
    "batch-idx-int64": (False, _set(cache_batch_idx=_i32(1, 0, dtype=torch.int64)), "cache_batch_idx"),
    "leftpad-shape": (False, _set(cache_leftpad=_i32(0, 0, 0)), "cache_leftpad"),
    "k-heads": (False, _set(k=_randn(2, 1, 4, 64), v=_randn(2, 1, 4, 64)), "k must have shape"),
    "k-longer-than-cache": (False, _set(k=_randn(2, 65, 2, 64), v=_randn(2, 65, 2, 64)), "seqlen_new"),
    "cache-batch-rows": (False, _set(k_cache=_randn(1, 64, 2, 64), v_cache=_randn(1, 64, 2, 64)), "k_cache"),
    "v-cache-shape": (False, _set(v_cache=_randn(2, 32, 2, 64)), "v_cache"),
    "q-3d": (False, _set(q=_randn(2, 4, 64)), "q must be a 4-D"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_rejects_bad_arguments(case):
    """ValueError naming the argument (Python checks, and the op's own before any launch)."""
    paged, change, name = BAD_ARGS[case]
    args = bad_base(torch.bfloat16, "cuda", paged)
    change(args)
    with pytest.raises(ValueError, match=name):
        flash_attn_with_kvcache(**args)


# ---------------------------------------------------------------- out-of-range device values


def _bad_block_table(call, values):
    for (b, j), value in values.items():
        call.block_table[b, j] = value


# id: (paged, what to change on the built call). Page indices, batch indices, lengths and left padding out of
# range: the kernels clamp them, so the call completes with finite outputs (which ones is unspecified).
OUT_OF_RANGE = {
    "block-table-negative": (True, lambda c: _bad_block_table(c, {(0, 0): -5, (1, 3): -5, (2, 1): -5})),
    "block-table-past-end": (
        True,
        lambda c: _bad_block_table(c, {(0, 1): c.k_cache.shape[0] + 7, (2, 0): c.k_cache.shape[0] + 7}),
    ),
    "batch-idx": (False, lambda c: c.batch_idx.copy_(torch.tensor([c.k_cache.shape[0] + 5, -3, 1]))),
    "seqlens-past-capacity": (False, lambda c: c.seqlens.copy_(torch.tensor([c.capacity + 10, c.capacity - 1, 1000]))),
    "seqlens-negative": (True, lambda c: c.seqlens.copy_(torch.tensor([-4, 3, -1]))),
    "leftpad": (False, lambda c: c.leftpad.copy_(torch.tensor([-2, 1000, 5]))),
    "everything-paged": (
        True,
        lambda c: (
            _bad_block_table(c, {(0, 0): -5, (1, 1): 10**6}),
            c.seqlens.copy_(torch.tensor([c.capacity + 3, -7, 2])),
            c.leftpad.copy_(torch.tensor([2 * c.capacity, -1, 0])),
        ),
    ),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_out_of_range_device_values_never_crash(case):
    paged, change = OUT_OF_RANGE[case]
    dtype = torch.bfloat16
    require_kernels(64, dtype)
    shape = Case(
        batch=3,
        seqlen_q=3,
        seqlen_new=2,
        cache_seqlens=(10, 20, 30),
        leftpad=(0, 0, 0),
        capacity=64,
        page_size=16 if paged else None,
        batch_idx=None if paged else "extra",
        nheads=4,
        nheads_k=2,
        head_dim=64,
        rotary_dim=32,
        causal=True,
    )
    # No NaN anywhere in the caches: a clamped index may legitimately read any row of them.
    call = build(shape, dtype, poison_rows=False)
    change(call)
    poison_allocator(call.q.device)
    out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call_kwargs(call))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "out has NaN or inf"
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert torch.isfinite(call.k_cache).all() and torch.isfinite(call.v_cache).all()


# Extreme values, where arithmetic on a length could overflow 32 bits: in a child process, so that a crash (an
# illegal address is sticky for the whole CUDA context) fails this test alone.
EXTREME_SCRIPT = r"""
import torch
from flash_attn_cuda import flash_attn_varlen_func, flash_attn_with_kvcache

torch.manual_seed(0)
BIG, SMALL = 2**31 - 1, -2**31
dt, dev = torch.bfloat16, "cuda"
i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)
q = torch.randn(3, 2, 4, 64, dtype=dt, device=dev)
k, v = torch.randn(3, 3, 2, 64, dtype=dt, device=dev), torch.randn(3, 3, 2, 64, dtype=dt, device=dev)
cos, sin = torch.rand(80, 16, dtype=dt, device=dev), torch.rand(80, 16, dtype=dt, device=dev)
results = []
dense = torch.randn(5, 64, 2, 64, dtype=dt, device=dev)
for seqlens in ((BIG, BIG - 1, 5), (BIG - 2, SMALL, 0)):
    kc, vc = dense.clone(), dense.clone()
    results.append(flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=i32(*seqlens),
                                           cache_batch_idx=i32(BIG, SMALL, 2), cache_leftpad=i32(BIG, SMALL, 1),
                                           causal=True, num_splits=3))
pages = torch.randn(12, 16, 2, 64, dtype=dt, device=dev)
table = i32(BIG, SMALL, 3, 4, 5, 6, 7, BIG, 0, SMALL, 1, 2).view(3, 4)
kc, vc = pages.clone(), pages.clone()
results.append(flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=i32(BIG, 62, SMALL), cache_leftpad=i32(0, BIG, SMALL),
                                       block_table=table, window_size=(10, 3)))
results.append(flash_attn_varlen_func(q.flatten(0, 1), pages, pages, i32(0, 2, 4, 6), i32(0, 64, 64, 80), 2, 64,
                                      block_table=table, causal=True))
torch.cuda.synchronize()
assert all(torch.isfinite(out).all() for out in results)
print("kvcache extremes ok")
"""


def test_extreme_device_values_in_a_child_process():
    """cache_seqlens of 2^31 - 1 with three new rows (cache_seqlens + i overflows int32), and page, batch and
    left-padding indices of +-2^31: the call completes, nothing crashes, outputs are finite."""
    require_kernels(64, torch.bfloat16)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_cuda.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", EXTREME_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and "kvcache extremes ok" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------- exhaustive

EXHAUSTIVE_LAYOUTS = {"dense": None, "paged16": 16, "paged48": 48, "paged80": 80}
# (seqlen_q, seqlen_new, cache lengths): decoding, reading only, a chunk, a prefill.
EXHAUSTIVE_LENGTHS = {
    "decode": (1, 1, (100, 0, 250)),
    "read-only": (1, 0, (100, 1, 250)),
    "chunk": (7, 3, (60, 9, 200)),
    "prefill": (64, 64, (0, 70, 150)),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("layout", list(EXHAUSTIVE_LAYOUTS))
@pytest.mark.parametrize("lengths", list(EXHAUSTIVE_LENGTHS))
@pytest.mark.parametrize("name", ["plain", *VARIANTS])
def test_exhaustive_kvcache(name, lengths, layout, head_dim, pair):
    """Every variant at every kernel head dim, layout and length profile; GQA, MQA and MHA, rotary (both layouts)
    and left padding in turn."""
    sq, new, lens = EXHAUSTIVE_LENGTHS[lengths]
    index = KERNEL_HEAD_DIMS.index(head_dim) + len(name) + len(layout)
    h, hk = list(HEADS.values())[index % 4]
    rotary_dim = (0, head_dim, head_dim // 2)[index % 3] if new else 0  # rotary needs new rows
    case = Case(
        batch=3,
        seqlen_q=sq,
        seqlen_new=new,
        cache_seqlens=lens,
        capacity=256,
        page_size=EXHAUSTIVE_LAYOUTS[layout],
        nheads=h,
        nheads_k=hk,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=index % 2 == 0,
        leftpad=(index % 50, 0, 7) if index % 2 else None,
        **VARIANTS.get(name, {}),
    )
    run_case(case, *pair)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("rotary_dim", [2, 16, 30, 64, 128])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("seqlen_q", [1, 2, 7, 64])
@pytest.mark.parametrize("mode", list(ROTARY_MODES))
def test_exhaustive_rotary(mode, seqlen_q, interleaved, rotary_dim, pair):
    case = Case(
        batch=3,
        seqlen_q=seqlen_q,
        seqlen_new=min(seqlen_q, 5),
        cache_seqlens=(40, 3, 100),
        leftpad=(17, 0, 64) if rotary_dim % 4 else None,
        capacity=128,
        page_size=16 if seqlen_q % 2 else None,
        nheads=6,
        nheads_k=2,
        head_dim=128,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        **ROTARY_MODES[mode],
    )
    run_case(case, *pair)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("edge", PAGE_EDGES)
@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 80, 112, 128, 144, 256, 512])
def test_exhaustive_page_edges(page_size, edge, heads, pair):
    h, hk = HEADS[heads]
    case = dataclasses.replace(page_edge_case(page_size, edge), nheads=h, nheads_k=hk, head_dim=64)
    run_case(case, *pair)


@pytest.mark.exhaustive
@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("shape", list(SPLIT_SHAPES))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 7, 8, 16, 64])
@pytest.mark.parametrize("name", ["plain", *VARIANTS])
def test_exhaustive_num_splits(name, num_splits, shape, kernel):
    case = dataclasses.replace(SPLIT_SHAPES[shape], **VARIANTS.get(name, {}))
    run_case(case, torch.bfloat16, kernel, num_splits=num_splits)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("name", ["plain", *VARIANTS])
def test_exhaustive_varlen_paged(name, page_size, head_dim, pair):
    variant = {key: value for key, value in VARIANTS.get(name, {}).items() if key != "gain"}
    run_varlen_paged(VARLEN_LENS_Q, VARLEN_LENS_K, 6, 2, head_dim, pair[0], page_size, pair[1], **variant)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", [8, 20, 60, 100, 200, 250])
@pytest.mark.parametrize("layout", ["dense", "paged16"])
def test_exhaustive_head_dim_padding(layout, head_dim, pair):
    case = Case(
        batch=2,
        seqlen_q=3,
        seqlen_new=2,
        cache_seqlens=(31, 5),
        capacity=64,
        page_size=16 if layout == "paged16" else None,
        nheads=4,
        nheads_k=2,
        head_dim=head_dim,
        rotary_dim=2 * (head_dim // 4),
        causal=True,
    )
    run_case(case, *pair)
