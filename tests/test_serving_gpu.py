"""The serving-engine arguments on a CUDA device, with the real kernels: seqused_q / seqused_k on
flash_attn_varlen_func (forward and backward), paged keys whose lengths seqused_k gives, out= and lse_out=,
flash_attn_with_kvcache decoding under scheduler_metadata (get_scheduler_metadata), pack_gqa and num_splits, a
decoding step with both captured in a CUDA graph, torch.compile of a seqused call, torch.library.opcheck of the ops
with the arguments that these calls give them (recorded from the public calls), and flash_attn_combine on partial
results of our own kernels.

Every correctness check runs its call with the outputs carved from NaN-poisoned memory (conftest.poison_allocator)
and applies the correctness rule of conftest.check_results against flash_attn_cuda.reference in float32 on upcast
inputs (ref) and in the input dtype (ref_lowp); dq and dk get conftest's gradient floors. The seqused reference
attends over each sequence's used rows alone (its first seqused_q queries against its first seqused_k keys, the mask
aligned to the bottom-right corner of that matrix); the rows it leaves out must come out exactly so: out and dq
rows of unused queries 0 and their LSE +inf, dk and dv rows of unused keys 0. Calls that must run the same kernels
(a call given scheduler_metadata and the same call planning for itself, a CUDA graph replay and an eager call,
torch.compile and eager mode, a call given out= and lse_out= and one that allocates its outputs) are compared
bitwise.

``--exhaustive`` adds the cross product of the seqused matrix. Configurations whose kernels were not compiled are
skipped.
"""

import dataclasses
import itertools

import pytest
import torch
from conftest import (
    DTYPE_NAMES,
    DTYPES,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    rand,
    requires_gpu,
    varlen_attention_ref,
)
from test_kvcache_gpu import Case, appended_mask, bits, build, call_kwargs, check_call, check_plan
from test_kvcache_gpu import require_kernels as require_cache_kernels
from test_variants_gpu import Variant, check_variant_plans, kernel_force, reference_with_grads
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attn_cuda
from flash_attn_cuda import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
    serving,
)
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

DEVICE = "cuda"
NAN = float("nan")
INF = float("inf")


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def require(head_dim, dtype, causal, window=(-1, -1), backward=True):
    """Skips unless the kernels of the call are compiled (forward, and backward unless ``backward`` is False): with a
    window bounded on a side, the variants kernels, else those of the call's mask."""
    variants = window != (-1, -1)
    if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=backward, variants=variants):
        pytest.skip(f"kernels for head_dim={head_dim} {dtype} causal={causal} window={window} not compiled")


# ---------------------------------------------------------------- seqused_q, seqused_k


def clamped(used, lens):
    """The rows of each sequence that take part: seqused clamped to [0, the sequence's length], or every row when
    the call gives no seqused."""
    if used is None:
        return list(lens)
    return [min(max(u, 0), n) for u, n in zip(used, lens)]


def unused_rows(lens, used):
    """bool (total,): True at the rows past each sequence's used part."""
    return torch.cat([torch.arange(n, device=DEVICE) >= u for n, u in zip(lens, used)])


def used_attention(q, k, v, lens_q, lens_k, used_q, used_k, scale, causal, window, upcast):
    """The seqused reference, packed as flash_attn_varlen_func returns it: sequence b's first used_q[b] queries
    attend to its first used_k[b] keys alone (attention_ref on those rows, so the mask is aligned to the
    bottom-right corner of the used matrix); its other query rows get out 0 and LSE +inf, and its other keys take no
    part, so autograd gives them no gradient. out (total_q, nheads, head_dim), lse (nheads, total_q)."""
    outs, lses = [], []
    starts_q, starts_k = [0, *itertools.accumulate(lens_q)], [0, *itertools.accumulate(lens_k)]
    for b in range(len(lens_q)):
        q0, k0, uq, uk = starts_q[b], starts_k[b], used_q[b], used_k[b]
        out, lse = attention_ref(
            q[None, q0 : q0 + uq],
            k[None, k0 : k0 + uk],
            v[None, k0 : k0 + uk],
            scale,
            causal,
            upcast=upcast,
            window_size=window,
        )
        rest = lens_q[b] - uq
        outs += [out[0], out.new_zeros(rest, *out.shape[2:])]
        lses += [lse[0], lse.new_full((lse.shape[1], rest), INF)]
    return torch.cat(outs), torch.cat(lses, dim=1)


# Per sequence: lengths 1, 2 and 5 (all used, one key of three, and five queries on two keys, whose first three
# rows see no key under causal); used keys that no query sees (seqused_q 0); used queries that see no key
# (seqused_k 0); seqused past the sequence's end, which is clamped (9 of 7 queries, 513 of 200 keys); and longer
# sequences with unused rows at their ends.
LENS_Q = [1, 2, 5, 40, 130, 7, 64]
LENS_K = [1, 3, 5, 50, 100, 9, 200]
USED_Q = [1, 2, 5, 0, 97, 9, 60]
USED_K = [1, 1, 2, 20, 100, 0, 513]


@dataclasses.dataclass(frozen=True)
class Used:
    """One seqused configuration. used: which of seqused_q and seqused_k the call gives ("both", "q" or "k").
    kernel: "default" (the warpgroup-MMA kernels on Hopper) or "mma_sync" (forced)."""

    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 64
    causal: bool = False
    window: tuple = (-1, -1)
    nheads: int = 6
    nheads_k: int = 2
    used: str = "both"
    kernel: str = "default"


def used_inputs(case, lens_q, lens_k):
    """q, k, v and dout of a seqused call (standard normal)."""
    q = rand(sum(lens_q), case.nheads, case.head_dim, dtype=case.dtype, device=DEVICE)
    k = rand(sum(lens_k), case.nheads_k, case.head_dim, dtype=case.dtype, device=DEVICE)
    v = rand(sum(lens_k), case.nheads_k, case.head_dim, dtype=case.dtype, device=DEVICE)
    return q, k, v, torch.randn_like(q)


def run_used(case, lens_q=LENS_Q, lens_k=LENS_K, used_q=USED_Q, used_k=USED_K, nan_unused=False):
    """flash_attn_varlen_func with seqused_q and/or seqused_k (case.used), forward and backward, against
    used_attention; the rows left out checked exactly. nan_unused: the unused rows of q, k and v hold NaN, which
    no result may show (a kernel must not read them)."""
    require(case.head_dim, case.dtype, case.causal, case.window)
    given_q = used_q if case.used in ("both", "q") else None
    given_k = used_k if case.used in ("both", "k") else None
    eff_q, eff_k = clamped(given_q, lens_q), clamped(given_k, lens_k)
    unused_q, unused_k = unused_rows(lens_q, eff_q), unused_rows(lens_k, eff_k)
    q, k, v, dout = used_inputs(case, lens_q, lens_k)
    finite = (q, k, v)
    if nan_unused:
        q, k, v = q.clone(), k.clone(), v.clone()
        q[unused_q], k[unused_k], v[unused_k] = NAN, NAN, NAN
    force = kernel_force(case.kernel)
    check_variant_plans(q, k, Variant(causal=case.causal, window=case.window), None, force, lens=(lens_q, lens_k))
    scale = case.head_dim**-0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, _ = flash_attn_varlen_func(
            *leaves,
            cu_seqlens(lens_q, DEVICE),
            cu_seqlens(lens_k, DEVICE),
            max(lens_q),
            max(lens_k),
            causal=case.causal,
            window_size=case.window,
            return_attn_probs=True,
            seqused_q=None if given_q is None else int32(given_q),
            seqused_k=None if given_k is None else int32(given_k),
        )
        poison_allocator(q.device)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert out.shape == q.shape and out.dtype == case.dtype
    assert lse.shape == (case.nheads, sum(lens_q)) and lse.dtype == torch.float32

    def attend(q, k, v, upcast):
        return used_attention(q, k, v, lens_q, lens_k, eff_q, eff_k, scale, case.causal, case.window, upcast)

    ref = reference_with_grads(attend, q, k, v, dout, upcast=True)
    lowp = reference_with_grads(attend, q, k, v, dout, upcast=False)
    # The floors take maxima over whole tensors: from the finite inputs, equal to q, k, v on every used row.
    rows = max(eff_q) * (case.nheads // case.nheads_k)
    floors = gradient_floors(attend, *finite, dout, scale, rows)
    check_results(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, lowp, case.dtype, floors)
    # The rule bounds every entry by the largest errors; the rows left out must be exact.
    assert bool((out[unused_q] == 0).all()), "out rows of unused queries are not 0"
    assert bool(torch.isposinf(lse[:, unused_q]).all()), "LSE of unused queries is not +inf"
    assert bool((dq[unused_q] == 0).all()), "dq rows of unused queries are not 0"
    assert bool((dk[unused_k] == 0).all()), "dk rows of unused keys are not 0"
    assert bool((dv[unused_k] == 0).all()), "dv rows of unused keys are not 0"
    return out, lse, (dq, dk, dv)


USED_CASES = {
    "bf16-d64": Used(),
    "bf16-d64-causal": Used(causal=True),
    "fp16-d128": Used(torch.float16, 128),
    "fp16-d128-causal-mqa": Used(torch.float16, 128, causal=True, nheads=8, nheads_k=1),
    "bf16-d72-causal": Used(head_dim=72, causal=True),
    "fp16-d72-mha": Used(torch.float16, 72, nheads=4, nheads_k=4),
    "bf16-d128-window": Used(head_dim=128, window=(32, 8)),
    "fp16-d64-causal-window": Used(torch.float16, causal=True, window=(24, -1)),
    "bf16-d64-causal-mma_sync": Used(causal=True, kernel="mma_sync"),
    "fp16-d128-window-mma_sync": Used(torch.float16, 128, window=(40, 16), kernel="mma_sync"),
    "bf16-d128-causal-q-only": Used(head_dim=128, causal=True, used="q"),
    "fp16-d64-k-only": Used(torch.float16, used="k"),
    "bf16-d72-causal-k-only": Used(head_dim=72, causal=True, used="k"),
}


@pytest.mark.parametrize("name", list(USED_CASES))
def test_seqused(name):
    used = USED_CASES[name].used
    if used != "both":
        # The unused rows checked exactly must exist on the side the call cuts.
        lens, given = (LENS_Q, USED_Q) if used == "q" else (LENS_K, USED_K)
        assert bool(unused_rows(lens, clamped(given, lens)).any())
    run_used(USED_CASES[name])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused_unused_rows_are_never_read(causal):
    """The unused rows of q, k and v hold NaN: a read of any of them would show in out, the LSE or a gradient."""
    run_used(Used(head_dim=128, causal=causal), nan_unused=True)


def test_seqused_all_or_nothing():
    """seqused equal to every length (the call as without it, bitwise, backward deterministic) and seqused 0
    everywhere (no query sees a key: out 0, LSE +inf, zero gradients)."""
    case = Used(causal=True)
    require(case.head_dim, case.dtype, case.causal)
    q, k, v, dout = used_inputs(case, LENS_Q, LENS_K)
    args = (cu_seqlens(LENS_Q, DEVICE), cu_seqlens(LENS_K, DEVICE), max(LENS_Q), max(LENS_K))

    def step(**used):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse, _ = flash_attn_varlen_func(
            *leaves, *args, causal=True, deterministic=True, return_attn_probs=True, **used
        )
        return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))

    # The call with seqused runs three sequences per sequence: the bitwise comparison holds while both batches
    # plan the same kernels and tiles.
    for pass_ in ("fwd", "bwd"):
        plans = [
            plan(
                pass_,
                batch=batch,
                seqlen_q=max(LENS_Q),
                seqlen_k=max(LENS_K),
                nheads=case.nheads,
                nheads_k=case.nheads_k,
                head_dim=case.head_dim,
                causal=True,
                deterministic=pass_ == "bwd",
                varlen=True,
                dtype=case.dtype,
            )
            for batch in (len(LENS_Q), 3 * len(LENS_Q))
        ]
        assert plans[0] == plans[1], plans
    plain = step()
    whole = step(seqused_q=int32(LENS_Q), seqused_k=int32(LENS_K))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, whole):
        assert torch.equal(a, b), name
    zeros = [0] * len(LENS_Q)
    out, lse, dq, dk, dv = step(seqused_q=int32(zeros), seqused_k=int32(zeros))
    assert bool(torch.isposinf(lse).all())
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert bool((t == 0).all()), name


# ---------------------------------------------------------------- paged keys cut by seqused_k

PAGED_LENS_Q = [3, 1, 17, 0, 40, 5, 2]
# The keys each sequence uses (seqused_k): none for the second (its query sees no key), one for a sequence with no
# query, and page edges (16, 33, 40 at page size 16).
PAGED_USED_K = [40, 0, 300, 1, 16, 77, 33]
# cu_seqlens_k's lengths, where the call gives it: seqused_k past them is clamped to them (300 to 250, 77 to 64).
PAGED_LENS_K = [40, 9, 250, 1, 20, 64, 33]


def run_paged(lens_q, used_k, lens_k, page_size, dtype, kernel, causal, *, nan_outside=False):
    """flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k or None, ..., block_table=...,
    seqused_k=...) under torch.no_grad(), against varlen_attention_ref over each sequence's first seqused_k cache
    rows (clamped to cu_seqlens_k's lengths, where given) gathered from its pages; the caches must come out
    untouched. Without cu_seqlens_k, max_seqlen_k is the capacity, a bound rather than the longest sequence.
    nan_outside: every cache entry outside the sequences' used keys is NaN, pages of no sequence included."""
    h, hk, d = 6, 2, (64 if kernel == "default" else 128)
    require_cache_kernels(d, dtype)
    batch = len(lens_q)
    eff_k = list(used_k) if lens_k is None else [min(u, n) for u, n in zip(used_k, lens_k)]
    max_pages = -(-max(used_k) // page_size) + 1  # one table column that no key reaches
    capacity = max_pages * page_size
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages, device=DEVICE)[: batch * max_pages].view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    k_cache = rand(num_pages, page_size, hk, d, dtype=dtype, device=DEVICE)
    v_cache = rand(num_pages, page_size, hk, d, dtype=dtype, device=DEVICE)
    q = rand(sum(lens_q), h, d, dtype=dtype, device=DEVICE)

    def used_rows(cache):
        return torch.cat([cache[block_table[b].long()].flatten(0, 1)[: eff_k[b]] for b in range(batch)])

    k_dense, v_dense = used_rows(k_cache), used_rows(v_cache)  # copies, taken before any NaN goes in
    if nan_outside:
        inside = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
        for b in range(batch):
            rows = torch.arange(eff_k[b], device=DEVICE)
            inside[block_table[b].long()[rows // page_size], rows % page_size] = True
        k_cache[~inside], v_cache[~inside] = NAN, NAN
    max_k = capacity if lens_k is None else max(eff_k)
    p = plan(
        "fwd",
        batch=batch,
        seqlen_q=max(lens_q),
        seqlen_k=max_k,
        nheads=h,
        nheads_k=hk,
        head_dim=d,
        causal=causal,
        varlen=True,
        override=override_string(**kernel_force(kernel)),
        dtype=dtype,
        kvcache=True,
        paged=True,
    )
    assert p.variants and p.num_splits == 1 and (kernel == "default" or p.kernel == kernel), p
    k_before, v_before = k_cache.clone(), v_cache.clone()
    poison_allocator(q.device)
    with torch.no_grad(), force_plan(**kernel_force(kernel)):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens(lens_q, DEVICE),
            None if lens_k is None else cu_seqlens(lens_k, DEVICE),
            max(lens_q),
            max_k,
            causal=causal,
            return_attn_probs=True,
            block_table=block_table,
            seqused_k=int32(used_k),
        )
    assert out.shape == q.shape and lse.shape == (h, sum(lens_q))

    def attend(upcast):
        return varlen_attention_ref(q, k_dense, v_dense, lens_q, eff_k, None, causal, upcast)

    check_results(("out", "lse"), (out, lse), attend(True), attend(False), dtype)
    assert torch.equal(bits(k_cache), bits(k_before)) and torch.equal(bits(v_cache), bits(v_before))


# (dtype, kernel) pairs that meet both dtypes and both kernel families over the paged tests.
PAIRS = [(torch.float16, "default"), (torch.bfloat16, "mma_sync")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cu_seqlens_k", ["none", "given"])
def test_paged_seqused_k(cu_seqlens_k, causal):
    index = ["none", "given"].index(cu_seqlens_k)
    dtype, kernel = PAIRS[(index + causal) % 2]
    lens_k = None if cu_seqlens_k == "none" else PAGED_LENS_K
    run_paged(PAGED_LENS_Q, PAGED_USED_K, lens_k, [16, 48][index], dtype, kernel, causal)


@pytest.mark.parametrize("cu_seqlens_k", ["none", "given"])
def test_paged_seqused_k_rows_past_it_are_never_read(cu_seqlens_k):
    lens_k = None if cu_seqlens_k == "none" else PAGED_LENS_K
    run_paged(PAGED_LENS_Q, PAGED_USED_K, lens_k, 16, torch.bfloat16, "default", True, nan_outside=True)


# ---------------------------------------------------------------- out=, lse_out=


def decode_case(nheads_k, layout, new):
    """Three decoding sequences of one query row against 8 query heads and head dim 128, with cache lengths 700, 0
    or 3 (0 with an appended row: the new token alone) and 1000 in a capacity of 1024, long enough that the
    heuristic splits the keys."""
    return Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=new,
        cache_seqlens=(700, 0 if new else 3, 1000),
        capacity=1024,
        page_size=64 if layout == "paged" else None,
        nheads=8,
        nheads_k=nheads_k,
        head_dim=128,
        causal=True,
    )


def same_call_with_outputs(name):
    """(call, out shape, lse shape, dtype): a call taking **outputs (out=, lse_out=) that returns (out, lse), its
    outputs' shapes, and q's dtype."""
    dtype = torch.bfloat16
    if name == "varlen-seqused":
        case = Used(causal=True)
        require(case.head_dim, dtype, True)
        q, k, v, _ = used_inputs(case, LENS_Q, LENS_K)
        args = (cu_seqlens(LENS_Q, DEVICE), cu_seqlens(LENS_K, DEVICE), max(LENS_Q), max(LENS_K))
        used = dict(seqused_q=int32(USED_Q), seqused_k=int32(USED_K))

        def call(**outputs):
            return flash_attn_varlen_func(q, k, v, *args, causal=True, return_attn_probs=True, **used, **outputs)[:2]

        return call, q.shape, (q.shape[1], q.shape[0]), dtype
    if name == "paged":
        require_cache_kernels(64, dtype)
        q = rand(sum(PAGED_LENS_Q), 6, 64, dtype=dtype, device=DEVICE)
        k_cache, v_cache = (rand(24, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
        block_table = torch.randperm(24, device=DEVICE)[:21].view(7, 3).to(torch.int32)
        used_k = [min(n, 48) for n in PAGED_USED_K]

        def call(**outputs):
            return flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens(PAGED_LENS_Q, DEVICE),
                None,
                max(PAGED_LENS_Q),
                48,
                return_attn_probs=True,
                block_table=block_table,
                seqused_k=int32(used_k),
                **outputs,
            )[:2]

        return call, q.shape, (q.shape[1], q.shape[0]), dtype
    assert name == "kvcache", name
    require_cache_kernels(128, dtype)
    case = Case(seqlen_new=0, cache_seqlens=(100, 3, 200), capacity=256, page_size=64, head_dim=128, causal=True)
    kv = build(case, dtype)
    metadata = get_scheduler_metadata(
        3, 1, kv.capacity, 8, 2, 128, qkv_dtype=dtype, page_size=kv.case.page_size, causal=True
    )

    def call(**outputs):
        return flash_attn_with_kvcache(
            kv.q, kv.k_cache, kv.v_cache, **call_kwargs(kv), scheduler_metadata=metadata, **outputs
        )

    return call, kv.q.shape, (3, 8, 1), dtype


@pytest.mark.parametrize("name", ["varlen-seqused", "paged", "kvcache"])
def test_out_and_lse_out(name):
    """The results are written into the given tensors (NaN beforehand), which the call returns in their place, and
    are bitwise those of the same call that allocates its own."""
    call, out_shape, lse_shape, dtype = same_call_with_outputs(name)
    out = torch.full(out_shape, NAN, dtype=dtype, device=DEVICE)
    lse_out = torch.full(lse_shape, NAN, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        fresh = call()
        given = call(out=out, lse_out=lse_out)
        only_out = call(out=torch.full_like(out, NAN))
    assert given[0] is out and given[1] is lse_out
    assert torch.equal(out, fresh[0]) and torch.equal(lse_out, fresh[1])
    assert torch.equal(only_out[0], fresh[0]) and torch.equal(only_out[1], fresh[1])


# ---------------------------------------------------------------- decoding: scheduler_metadata, pack_gqa, num_splits

HEADS = {"gqa8": (8, 1), "gqa4": (8, 2)}


def decode_metadata(call, **kwargs):
    """get_scheduler_metadata for the sizes of the flash_attn_with_kvcache call ``call``."""
    case = call.case
    return get_scheduler_metadata(
        case.batch,
        case.seqlen_q,
        call.capacity,
        case.nheads,
        case.nheads_k,
        case.head_dim,
        cache_seqlens=call.seqlens,
        qkv_dtype=call.dtype,
        page_size=case.page_size,
        max_seqlen_k_new=case.seqlen_new,
        causal=case.causal,
        **kwargs,
    )


def decode_plan(call, num_splits=0, override=""):
    """The forward plan of flash_attn_with_kvcache with the sizes of ``call``, under num_splits and plan_override
    ``override``."""
    case = call.case
    return plan(
        "fwd",
        batch=case.batch,
        seqlen_q=case.seqlen_q,
        seqlen_k=call.capacity,
        nheads=case.nheads,
        nheads_k=case.nheads_k,
        head_dim=case.head_dim,
        causal=case.causal,
        num_splits=num_splits,
        override=override,
        dtype=call.dtype,
        kvcache=True,
        paged=case.page_size is not None,
    )


def run_decode(call, k0, v0, **extra):
    """flash_attn_with_kvcache on ``call`` with the caches reset to (k0, v0) and its outputs on poisoned memory,
    checked against the reference (check_call). Returns (out, lse, k_cache, v_cache) after the call."""
    call.k_cache.copy_(k0)
    call.v_cache.copy_(v0)
    poison_allocator(call.q.device)
    out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **{**call_kwargs(call), **extra})
    check_call(call, out, lse, k0, v0)
    return out, lse, call.k_cache.clone(), call.v_cache.clone()


def assert_same(a, b, what):
    """Bitwise equal (out, lse, k_cache, v_cache) of two runs."""
    for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), a, b):
        same = torch.equal(bits(x), bits(y)) if x.dtype != torch.float32 else torch.equal(x, y)
        assert same, f"{what}: {name} differs"


@pytest.mark.parametrize("append", [False, True], ids=["read-only", "append"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode_scheduler_metadata(heads, layout, append):
    """A call given get_scheduler_metadata(...) for its sizes pins the plan it would pick itself: the same kernels,
    so bitwise the same out, LSE and caches, and both right."""
    dtype = torch.bfloat16
    require_cache_kernels(128, dtype)
    call = build(decode_case(HEADS[heads][1], layout, int(append)), dtype)
    own = check_plan(call)
    metadata = decode_metadata(call)
    assert metadata.plan == own, (metadata.plan, own)
    # What the call given it runs: its key splits and its pinned choices.
    assert decode_plan(call, metadata.num_splits, metadata.plan_override) == own
    k0, v0 = call.k_cache.clone(), call.v_cache.clone()
    plain = run_decode(call, k0, v0)
    pinned = run_decode(call, k0, v0, scheduler_metadata=metadata)
    assert_same(plain, pinned, "scheduler_metadata")


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode_pack_gqa_and_num_splits(heads, layout):
    """pack_gqa=False runs each query head on its own (the plan says so, where the default packs the group), and
    gives right results, bitwise those of scheduler_metadata computed with pack_gqa=False; num_splits=1 (no split),
    the heuristic's choice and scheduler_metadata with num_splits=3 all give right results."""
    dtype = torch.bfloat16
    require_cache_kernels(128, dtype)
    h, hk = HEADS[heads]
    call = build(decode_case(hk, layout, 1), dtype)
    auto = check_plan(call)
    # The lengths are long enough that the heuristic splits the keys (in 4, planned for sm_80 to sm_120), so that
    # num_splits=1 takes another path.
    assert auto.gqa_pack == h // hk and auto.num_splits > 1, auto
    assert decode_plan(call, override=override_string(gqa_pack=False)).gqa_pack == 1
    assert check_plan(call, num_splits=1).num_splits == 1
    unpacked = decode_metadata(call, pack_gqa=False)
    assert unpacked.plan.gqa_pack == 1 and "gqa_pack=0" in unpacked.plan_override
    three = decode_metadata(call, num_splits=3)
    assert three.num_splits == three.plan.num_splits == 3 and three.plan.gqa_pack == h // hk
    k0, v0 = call.k_cache.clone(), call.v_cache.clone()
    run_decode(call, k0, v0)
    by_argument = run_decode(call, k0, v0, pack_gqa=False)
    by_metadata = run_decode(call, k0, v0, scheduler_metadata=unpacked)
    assert_same(by_argument, by_metadata, "pack_gqa=False")
    run_decode(call, k0, v0, num_splits=1)
    run_decode(call, k0, v0, scheduler_metadata=three)


# ---------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("layout, num_splits", [("dense", 0), ("paged", 3)], ids=["dense-auto", "paged-3-splits"])
def test_decode_step_in_a_cuda_graph(layout, num_splits):
    """A decoding step (append one token, attend) with scheduler_metadata, out= and lse_out= captured once, then
    replayed after new q, k, v and cache_seqlens were written into the captured tensors: each replay writes out and
    lse_out bitwise as an eager call with the same arguments does (on copies of the caches as they were), appends
    the same rows, and is right."""
    dtype = torch.bfloat16
    require_cache_kernels(128, dtype)
    case = Case(
        batch=3,
        seqlen_q=1,
        seqlen_new=1,
        cache_seqlens=(13, 0, 29),
        capacity=256,
        page_size=16 if layout == "paged" else None,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        causal=True,
    )
    call = build(case, dtype, poison_rows=False)
    metadata = decode_metadata(call, num_splits=num_splits)
    assert num_splits == 0 or metadata.num_splits == num_splits
    kwargs = {**call_kwargs(call), "scheduler_metadata": metadata}
    out = torch.empty_like(call.q)
    lse_out = torch.empty(case.batch, case.nheads, case.seqlen_q, dtype=torch.float32, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Warm-up: the kernels load and the allocator sees the step's sizes outside the capture.
        flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs, out=out, lse_out=lse_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **kwargs, out=out, lse_out=lse_out)
    assert captured[0] is out and captured[1] is lse_out
    # Lengths across page edges and back down, with an empty cache and one full but for the new row.
    for lens in [(20, 0, 29), (100, 7, 3), (254, 128, 64)]:
        call.seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        call.lens = list(lens)
        for t in (call.q, call.k, call.v):
            t.copy_(torch.randn_like(t))
        call.appended = appended_mask(call)
        call.k_cache[call.appended] = NAN  # a missed append shows
        call.v_cache[call.appended] = NAN
        k_before, v_before = call.k_cache.clone(), call.v_cache.clone()
        out.fill_(NAN)
        lse_out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        k_eager, v_eager = k_before.clone(), v_before.clone()
        eager = flash_attn_with_kvcache(call.q, k_eager, v_eager, **kwargs)
        assert_same((out, lse_out, call.k_cache, call.v_cache), (*eager, k_eager, v_eager), f"replay at {lens}")
        check_call(call, out, lse_out, k_before, v_before)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("variant", ["causal", "window"])
def test_compiled_seqused_matches_eager(variant):
    """torch.compile(fullgraph=True) of flash_attn_varlen_func with seqused_q and seqused_k (graph inputs): out,
    LSE and the gradients bitwise equal to eager mode (deterministic backward), for two sets of used lengths written
    into the same tensors; the unused rows exact in both."""
    causal, window = (True, (-1, -1)) if variant == "causal" else (False, (16, 4))
    require(64, torch.bfloat16, causal, window)
    lens_q, lens_k = [5, 0, 70, 33], [9, 4, 70, 40]
    q, k, v = (
        rand(sum(n), 4, 64, dtype=torch.bfloat16, device=DEVICE).requires_grad_() for n in (lens_q, lens_k, lens_k)
    )
    dout = torch.randn_like(q)
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    used_q, used_k = int32([3, 0, 64, 40]), int32([9, 2, 0, 17])

    def attend(q, k, v, cu_q, cu_k, used_q, used_k):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            70,
            70,
            causal=causal,
            window_size=window,
            deterministic=True,
            return_attn_probs=True,
            seqused_q=used_q,
            seqused_k=used_k,
        )
        return out, lse

    compiled = torch.compile(attend, fullgraph=True)

    def step(fn):
        out, lse = fn(q, k, v, cu_q, cu_k, used_q, used_k)
        return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    for lengths in ([3, 0, 64, 40], [5, 1, 0, 33]), ([9, 2, 0, 17], [0, 4, 70, 1]):
        used_q.copy_(int32(lengths[0]))
        used_k.copy_(int32(lengths[1]))
        eager, comp = step(attend), step(compiled)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, comp):
            assert torch.equal(a, b), f"{name} at {lengths}"
        unused_q = unused_rows(lens_q, clamped(lengths[0], lens_q))
        unused_k = unused_rows(lens_k, clamped(lengths[1], lens_k))
        out, lse, dq, dk, dv = comp
        assert bool((out[unused_q] == 0).all() and torch.isposinf(lse[:, unused_q]).all())
        assert bool((dq[unused_q] == 0).all() and (dk[unused_k] == 0).all() and (dv[unused_k] == 0).all())


# ---------------------------------------------------------------- opcheck


class OpCalls(TorchDispatchMode):
    """Records the calls of this library's ops (torch.ops.flash_attn2.*) made inside it, backward passes included,
    as (op, args, kwargs): the arguments exactly as the public functions and the autograd of the ops build them,
    seen below autograd. The ops run as they would without it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "flash_attn2":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def named(func, args, kwargs):
    """A recorded op call's arguments by name. The dispatcher leaves out the arguments that equal their defaults,
    so those are filled in from the schema."""
    schema = func._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}
    values.update(zip((a.name for a in schema), args))
    values.update(kwargs)
    return values


def recorded(calls, ops, out, lse_out):
    """The recorded calls, checked to be of ``ops`` (overloads, in order), none of them given the out= or lse_out=
    tensors of the public call: those are copies made after the ops, so there is no op argument to check for
    them."""
    assert [func for func, _, _ in calls] == ops, calls
    for func, args, kwargs in calls:
        assert not any(value is out or value is lse_out for value in named(func, args, kwargs).values()), func
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused_opcheck(causal):
    """torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch with dynamic shapes) of
    varlen_fwd and varlen_bwd with the arguments that a forward and backward pass of flash_attn_varlen_func gives
    them under seqused_q and seqused_k: cu_seqlens of PARTS_PER_SEQUENCE * batch + 1 entries, those of
    serving.used_sequences, in both. The forward is checked with q, k and v requiring grad, so that opcheck also
    runs its autograd."""
    require(64, torch.bfloat16, causal)
    # Sequences cut inside; one without queries, whose used keys no query sees; one whose used queries see no key;
    # seqused_q past a sequence's end (clamped). Rows of LSE +inf and keys without gradient thus reach opcheck's
    # comparisons.
    lens_q, lens_k = [5, 0, 70, 33], [9, 4, 70, 40]
    used_q, used_k = int32([3, 0, 64, 40]), int32([9, 2, 0, 17])
    q, k, v = (
        rand(sum(n), 4, 64, dtype=torch.bfloat16, device=DEVICE).requires_grad_() for n in (lens_q, lens_k, lens_k)
    )
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    out = torch.empty_like(q)
    lse_out = torch.empty(4, sum(lens_q), dtype=torch.float32, device=DEVICE)
    with OpCalls() as seen:
        result, _, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            70,
            70,
            causal=causal,
            return_attn_probs=True,
            seqused_q=used_q,
            seqused_k=used_k,
            out=out,
            lse_out=lse_out,
        )
        torch.autograd.grad(result, (q, k, v), torch.randn_like(q))
    assert result is out
    fwd_op, bwd_op = torch.ops.flash_attn2.varlen_fwd.default, torch.ops.flash_attn2.varlen_bwd.default
    (fwd, fwd_args, fwd_kwargs), (bwd, bwd_args, bwd_kwargs) = recorded(seen.calls, [fwd_op, bwd_op], out, lse_out)
    parts = serving.PARTS_PER_SEQUENCE * len(lens_q) + 1
    expected = serving.used_sequences(q, cu_q, cu_k, used_q, used_k)
    for func, args, kwargs in seen.calls:
        given = named(func, args, kwargs)
        for name, cu in zip(("cu_seqlens_q", "cu_seqlens_k"), expected):
            assert given[name].shape == (parts,) and torch.equal(given[name], cu), (func, name)
    # q, k and v as leaves that require grad; the others as the call gave them.
    names = [a.name for a in fwd._schema.arguments]
    fwd_args = tuple(a.detach().requires_grad_() if names[i] in ("q", "k", "v") else a for i, a in enumerate(fwd_args))
    torch.library.opcheck(fwd, fwd_args, fwd_kwargs)
    # The backward op has no autograd of its own: its tensors (saved ones among them) are given detached.
    bwd_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in bwd_args)
    torch.library.opcheck(bwd, bwd_args, bwd_kwargs)


@pytest.mark.parametrize("cu_seqlens_k", ["none", "given"])
def test_paged_seqused_k_opcheck(cu_seqlens_k):
    """opcheck of varlen_fwd_paged with the arguments that flash_attn_varlen_func gives it for paged keys cut by
    seqused_k: cu_seqlens_k is serving.paged_lengths's cumulative sum of seqused_k (clamped to cu_seqlens_k's
    lengths where the call gives it). The inputs do not require grad: the op has no backward (the node its autograd
    records raises once a backward reaches it, which opcheck's gradient comparison would do)."""
    dtype = torch.bfloat16
    require_cache_kernels(64, dtype)
    lens_k = None if cu_seqlens_k == "none" else PAGED_LENS_K
    batch, page_size = len(PAGED_LENS_Q), 16
    max_pages = -(-max(PAGED_USED_K) // page_size)
    num_pages = batch * max_pages + 3
    block_table = torch.randperm(num_pages, device=DEVICE)[: batch * max_pages].view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    k_cache, v_cache = (rand(num_pages, page_size, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
    q = rand(sum(PAGED_LENS_Q), 6, 64, dtype=dtype, device=DEVICE)
    cu_q = cu_seqlens(PAGED_LENS_Q, DEVICE)
    cu_k = None if lens_k is None else cu_seqlens(lens_k, DEVICE)
    used_k = int32(PAGED_USED_K)
    # Without cu_seqlens_k, max_seqlen_k bounds the lengths by the capacity (as run_paged passes it).
    max_k = max_pages * page_size if lens_k is None else max(min(u, n) for u, n in zip(PAGED_USED_K, lens_k))
    out = torch.empty_like(q)
    lse_out = torch.empty(6, sum(PAGED_LENS_Q), dtype=torch.float32, device=DEVICE)
    with OpCalls() as seen:
        flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k,
            max(PAGED_LENS_Q),
            max_k,
            causal=True,
            block_table=block_table,
            seqused_k=used_k,
            out=out,
            lse_out=lse_out,
        )
    ((func, args, kwargs),) = recorded(seen.calls, [torch.ops.flash_attn2.varlen_fwd_paged.default], out, lse_out)
    given = named(func, args, kwargs)
    assert torch.equal(given["cu_seqlens_k"], serving.paged_lengths(q, cu_q, cu_k, used_k))
    assert torch.equal(given["cu_seqlens_q"], cu_q) and torch.equal(given["block_table"], block_table)
    torch.library.opcheck(func, args, kwargs)


@pytest.mark.parametrize(
    "layout, pack_gqa, num_splits",
    [("dense", None, 0), ("paged", False, 3)],
    ids=["dense-packed-auto-splits", "paged-unpacked-3-splits"],
)
def test_decode_scheduler_metadata_opcheck(layout, pack_gqa, num_splits):
    """opcheck of fwd_kvcache with the arguments that flash_attn_with_kvcache gives it under scheduler_metadata:
    the metadata's key splits as num_splits and its plan_override, which pins the kernel, the tiles and whether
    the query heads of a key/value head run as one (gqa_pack=1, or gqa_pack=0 from pack_gqa=False). One row is
    appended per sequence: opcheck runs the op several times, each appending the same rows at the same
    positions, since cache_seqlens does not move."""
    dtype = torch.bfloat16
    require_cache_kernels(128, dtype)
    call = build(decode_case(2, layout, 1), dtype, poison_rows=False)
    metadata = decode_metadata(call, pack_gqa=pack_gqa, num_splits=num_splits)
    packed = pack_gqa is None
    assert metadata.plan.gqa_pack == (call.case.nheads // call.case.nheads_k if packed else 1), metadata.plan
    assert f"gqa_pack={int(packed)}" in metadata.plan_override.split(";"), metadata.plan_override
    assert num_splits == 0 or metadata.num_splits == num_splits, metadata
    out = torch.empty_like(call.q)
    case = call.case
    lse_out = torch.empty(case.batch, case.nheads, case.seqlen_q, dtype=torch.float32, device=DEVICE)
    with OpCalls() as seen:
        flash_attn_with_kvcache(
            call.q,
            call.k_cache,
            call.v_cache,
            **call_kwargs(call),
            scheduler_metadata=metadata,
            out=out,
            lse_out=lse_out,
        )
    ((func, args, kwargs),) = recorded(seen.calls, [torch.ops.flash_attn2.fwd_kvcache.default], out, lse_out)
    given = named(func, args, kwargs)
    assert given["num_splits"] == metadata.num_splits, given["num_splits"]
    assert given["plan_override"] == metadata.plan_override, given["plan_override"]
    torch.library.opcheck(func, args, kwargs)


# ---------------------------------------------------------------- flash_attn_combine

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, key chunks [lo, hi)).
COMBINE_SHAPES = {
    "full-2": (2, 77, 300, 4, 2, 64, False, [(0, 128), (128, 300)]),
    # One query row (decoding), a chunk of a single key.
    "decode-3": (3, 1, 257, 8, 1, 128, False, [(0, 100), (100, 101), (101, 257)]),
    # The rows before a chunk's first key see none of it: their LSE there is +inf.
    "causal-3": (2, 200, 200, 4, 4, 64, True, [(0, 64), (64, 150), (150, 200)]),
    # More queries than keys: the first 50 rows see no key in any chunk (out 0, LSE +inf once combined).
    "causal-q-longer": (1, 150, 100, 6, 2, 128, True, [(0, 30), (30, 100)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_NAMES[d] for d in DTYPES])
@pytest.mark.parametrize("shape", list(COMBINE_SHAPES))
def test_combine_chunks_of_keys(shape, dtype):
    """flash_attn_func over each chunk of the keys (return_attn_probs=True; causal over all keys is, for the chunk
    [lo, hi), the window (-1, seqlen_k - hi) of the chunk's own bottom-right alignment), outputs cast to float32 and
    LSE moved to (batch, seqlen, nheads), merged by flash_attn_combine: the rule against attention over all keys,
    as the single flash_attn_func call over all keys meets it."""
    b, sq, sk, h, hk, d, causal, chunks = COMBINE_SHAPES[shape]
    # The chunks of a causal call run windows (the variants kernel), the call over all keys the causal one.
    require(d, dtype, causal, backward=False)
    if causal:
        require(d, dtype, False, window=(-1, 1), backward=False)
    q, k, v = (rand(b, n, heads, d, dtype=dtype, device=DEVICE) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    outs, lses = [], []
    for lo, hi in chunks:
        window = (-1, sk - hi) if causal else (-1, -1)
        poison_allocator(q.device)
        out, lse, _ = flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], window_size=window, return_attn_probs=True)
        outs.append(out.float())
        lses.append(lse.transpose(1, 2))
    lse_partial = torch.stack(lses)
    assert bool(torch.isposinf(lse_partial).any()) == causal
    poison_allocator(q.device)
    combined, combined_lse = flash_attn_combine(torch.stack(outs), lse_partial)
    assert combined.dtype == torch.float32 and combined_lse.shape == (b, sq, h)
    full, full_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref = attention_ref(q, k, v, causal=causal)
    lowp = attention_ref(q, k, v, causal=causal, upcast=False)
    check_results(("out", "lse"), (combined, combined_lse.transpose(1, 2)), ref, lowp, dtype)
    check_results(("full out", "full lse"), (full, full_lse), ref, lowp, dtype)
    in_dtype, _ = flash_attn_combine(torch.stack(outs), lse_partial, out_dtype=dtype)
    assert in_dtype.dtype == dtype and torch.equal(in_dtype, combined.to(dtype))


def test_combine_varlen_chunks():
    """The (num_splits, total, nheads, head_dim) layout: flash_attn_varlen_func over two chunks of each sequence's
    keys (some empty, so their rows' LSE is +inf; one sequence with no key at all), LSE (nheads, total) moved to
    (total, nheads), merged; the rule against the varlen reference over all keys."""
    dtype = torch.bfloat16
    require(64, dtype, False)
    lens_q, lens_k = [3, 0, 40, 1, 2, 64], [50, 7, 130, 1, 0, 64]
    split = [20, 7, 0, 1, 0, 63]  # the first chunk of each sequence: its keys [0, split)
    h, hk, d = 4, 2, 64
    q = rand(sum(lens_q), h, d, dtype=dtype, device=DEVICE)
    k, v = (rand(sum(lens_k), hk, d, dtype=dtype, device=DEVICE) for _ in range(2))
    starts = [0, *itertools.accumulate(lens_k)]
    outs, lses = [], []
    for chunk in ([(0, s) for s in split], [(s, n) for s, n in zip(split, lens_k)]):
        rows = torch.cat([torch.arange(starts[b] + lo, starts[b] + hi) for b, (lo, hi) in enumerate(chunk)])
        rows = rows.to(DEVICE)
        lens = [hi - lo for lo, hi in chunk]
        poison_allocator(q.device)
        cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens, DEVICE)
        out, lse, _ = flash_attn_varlen_func(
            q, k[rows], v[rows], cu_q, cu_k, max(lens_q), max(lens), return_attn_probs=True
        )
        outs.append(out.float())
        lses.append(lse.transpose(0, 1))
    combined, combined_lse = flash_attn_combine(torch.stack(outs), torch.stack(lses))
    assert combined.shape == q.shape and combined_lse.shape == (sum(lens_q), h)
    ref = varlen_attention_ref(q, k, v, lens_q, lens_k)
    lowp = varlen_attention_ref(q, k, v, lens_q, lens_k, upcast=False)
    check_results(("out", "lse"), (combined, combined_lse.transpose(0, 1)), ref, lowp, dtype)


# ---------------------------------------------------------------- exhaustive

EXHAUSTIVE_MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window": (False, (32, 8)),
    "causal-window": (True, (24, -1)),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("used", ["both", "q", "k"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("mask", list(EXHAUSTIVE_MASKS))
@pytest.mark.parametrize("head_dim", [32, 64, 72, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_NAMES[d] for d in DTYPES])
def test_exhaustive_seqused(dtype, head_dim, mask, heads, used, kernel):
    causal, window = EXHAUSTIVE_MASKS[mask]
    case = Used(dtype, head_dim, causal, window, *heads, used=used, kernel=kernel)
    run_used(case)
