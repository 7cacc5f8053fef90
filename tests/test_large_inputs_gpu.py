"""Large-magnitude inputs at short and block-edge lengths, and batches beyond the grid's y limit, on a CUDA device.

Large-magnitude q and k with only a few keys give rows whose LSE is far below zero. Anything a kernel computes
as exp(score - lse) at a key or query that lies outside the sequence then overflows, and an overflowed value
times a zero-filled operand is NaN. Each call here packs every short length into one varlen batch, or loops
over them densely, and checks out, lse, dq, dk and dv with the correctness rule, which rejects any NaN (with
the atol of conftest.check_results).

The same inputs also go through the paths that mask or scale on their own: sliding windows (few keys per row,
window edges inside key blocks, rows that see no key), dropout (kept probabilities scaled by 1 / (1 - p); the
reference takes the keep mask that flash_attn_cuda.dropout rebuilds from the call's rng_state), the
deterministic backward (its own dQ accumulation, which must also give the same bits twice) and paged varlen
(keys read page by page from a cache whose other rows hold large values too; forward only).
"""

import itertools

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    MIN_ROWS_ON_TWO_KEYS,
    check_close,
    check_forced_plans,
    check_results,
    cu_seqlens,
    device_plan,
    gradient_floors,
    poison_allocator,
    require_fwd_bwd_kernels,
    requires_gpu,
    rows_on_two_keys,
    variants_kernel,
    varlen_attention_ref,
)

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from flash_attn_cuda.dropout import keep_mask, varlen_keep_mask
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]


# Every length up to 17, then both sides of the 64- and 128-row/key block edges.
SHORT_LENS = list(range(1, 18)) + [63, 64, 65, 127, 128, 129]
# The gains of the reported NaN case: q * 5, k and v * 3, in fp16. bfloat16 has float32's range, so the case is
# only about large scores there, and q * 4 keeps their standard deviation (12) where a bfloat16 reference still
# judges the results (at 15, dk of a varlen dropout call at head dim 224 had a bound of 0.51 of max|ref| on the
# CPU: the rule could not discriminate).
GAINS = (5.0, 3.0, 3.0)
BF16_GAINS = (4.0, 3.0, 3.0)


def gains_of(dtype):
    return BF16_GAINS if dtype == torch.bfloat16 else GAINS


# The kernels, as force_plan keywords: the default ones (on Hopper the wgmma kernels) and the mma.sync ones.
BACKWARDS = {"default": {}, "mma_sync": {"kernel": "mma_sync"}}
# For the large-magnitude checks of short lengths, also the warp-specialized Hopper backward (head dims 64 and 128),
# which the default plans leave to the other Hopper kernel at these lengths: forced, the short-query tile turned off.
SHORT_BACKWARDS = {**BACKWARDS, "warp_specialized": {"ws": True, "short_queries": False}}
# Paths that handle rows or keys past a sequence's end on their own (README "Use"), as force_plan keywords: key
# splits in the forward, the 16-row query tile and several key blocks per CTA in the Hopper backward, and GQA
# groups walked per CTA.
PATHS = {
    "split_kv": {"num_splits": 3},
    "short_query_tile": {"short_queries": True},
    "key_blocks": {"key_blocks": 2},
    "gqa_walk": {"gqa_walk": True},
    "gqa_per_head": {"gqa_walk": False},
}
# (seqlen_q, seqlen_k) of the dense window, dropout and deterministic checks: odd and unequal lengths both ways,
# within one block and across the 64- and 128-row/key block edges. Every pair has some row that sees two keys or
# more, so that no checked tensor has an all-zero reference (one visible key gives exact zeros in dq and dk).
LENGTHS = [(3, 2), (5, 17), (17, 5), (65, 129), (129, 63)]
EXHAUSTIVE_LENGTHS = LENGTHS + [(2, 2), (15, 16), (63, 64), (64, 65), (127, 129), (203, 113), (113, 203)]
# Windows (left, right) on their own (not causal): a few keys on both sides, a left and a right edge alone. With
# seqlen_q > seqlen_k, the right-bounded ones leave the first rows with no key at all.
WINDOWS = {"both": (3, 2), "left": (21, -1), "right": (-1, 9)}
# Also two keys per row, one side of width zero, edges half a block apart, and a window wider than every
# sequence (full attention through the masked kernel).
EXHAUSTIVE_WINDOWS = {**WINDOWS, "0-1": (0, 1), "1-0": (1, 0), "64-64": (64, 64), "wide": (1000, 1000)}
# Dropout rates of the default run: a light one, and a heavy one whose 1 / (1 - p) = 2.5 scales the kept
# probabilities up.
DROPOUT_PS = (0.17, 0.6)
EXHAUSTIVE_DROPOUT_PS = (0.01, 0.5, 0.9)
# (lens_q, lens_k) of one varlen batch: every short length with seqlen_q == seqlen_k, then the same lengths
# against other key lengths (seqlen_q > seqlen_k and the reverse), so that every block edge is crossed in one call.
PACKED_LENS = (SHORT_LENS * 2, SHORT_LENS + SHORT_LENS[5:] + SHORT_LENS[:5])


def scaled(shape, gain, dtype):
    return (torch.randn(shape, device="cuda") * gain).to(dtype)


NAMES = ("out", "lse", "dq", "dk", "dv")


def require_variant_kernels(head_dim, dtype):
    """Skips unless every mask is compiled: calls with a window or dropout run the variants kernels, and the plain
    masked or unmasked kernels where the window amounts to no mask or a causal one."""
    require_fwd_bwd_kernels(head_dim, dtype, False)
    require_fwd_bwd_kernels(head_dim, dtype, True)
    if not flash_attn_cuda.kernel_available(head_dim, dtype, True, backward=True, variants=True):
        pytest.skip(f"variants kernels for head_dim={head_dim} {dtype} not compiled")


def next_rng_state(device):
    """The dropout rng_state that the next public call on ``device`` draws, left undrawn: the public functions
    draw torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64) from torch's generator of the device, so the
    same draw on a forked generator gives the same words."""
    with torch.random.fork_rng(devices=[device]):
        return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=device)


def check_plans(q, k, causal, force, *, window=(-1, -1), dropout_p=0.0, deterministic=False, lens=None):
    """conftest.check_forced_plans on the call's sizes; with a window or dropout, also the plans of the call
    itself, whose passes must keep the kernel family of the plain call (forced or the default)."""
    plain = check_forced_plans(q, k, causal, force, deterministic=deterministic, lens=lens)
    if not plain or (tuple(window) == (-1, -1) and not dropout_p):
        return
    choices = dict(force)
    num_splits = choices.pop("num_splits", 0)
    for pass_, plain_plan in plain.items():
        p = device_plan(
            pass_,
            q,
            k,
            causal,
            deterministic=deterministic and pass_ == "bwd",
            lens=lens,
            num_splits=num_splits,
            variants=dict(window_size=tuple(window), dropout=dropout_p > 0),
            **choices,
        )
        assert p.kernel == variants_kernel(plain_plan, deterministic), (p, plain_plan)


def gradients(out, inputs, dout, deterministic):
    """dq, dk and dv by autograd. The deterministic backward runs a second time, on freshly poisoned memory, and
    must give the same bits (compared as 16-bit patterns, so that a NaN is left to the rule to report)."""
    grads = torch.autograd.grad(out, inputs, dout, retain_graph=deterministic)
    if deterministic:
        poison_allocator(out.device)
        again = torch.autograd.grad(out, inputs, dout)
        for name, first, second in zip(NAMES[2:], grads, again):
            same = torch.equal(first.contiguous().view(torch.int16), second.contiguous().view(torch.int16))
            assert same, f"{name}: the deterministic backward gave other bits on a second run"
    return grads


def reference(q, k, v, dout, causal, upcast, **variant):
    """(out, lse, dq, dk, dv) of attention_ref on dense (batch, seqlen, heads, head_dim) inputs; ``variant``:
    attention_ref's window_size, dropout_p and dropout_mask."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, None, causal, upcast=upcast, **variant)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse, *grads)


def judges_dq_dk(sq, sk, causal, window=(-1, -1), dropout_p=0.0):
    """Whether the rule can judge dq and dk of a dense call with large-magnitude inputs: at least
    MIN_ROWS_ON_TWO_KEYS rows that see two keys or more, in expectation after dropout. With fewer, the scores
    (standard deviation about 15) leave each row's softmax nearly one-hot and dq, dk near the rounding of the
    low-precision reference."""
    return rows_on_two_keys(sq, sk, causal, window) * (1 - dropout_p) >= MIN_ROWS_ON_TWO_KEYS


def check_dense_results(q, k, v, dout, ours, causal, label="", **variant):
    """The rule on ours = (out, lse, dq, dk, dv) of dense inputs; ``variant`` as in reference. An entry of ours
    that is None is left unjudged."""
    ref = reference(q, k, v, dout, causal, upcast=True, **variant)
    lowp = reference(q, k, v, dout, causal, upcast=False, **variant)

    def attend(q, k, v, upcast, dropped=True):
        kwargs = variant if dropped else {n: x for n, x in variant.items() if n not in ("dropout_p", "dropout_mask")}
        return attention_ref(q, k, v, None, causal, upcast=upcast, **kwargs)

    rows = q.shape[1] * (q.shape[2] // k.shape[2])
    dropout_p = variant.get("dropout_p", 0.0)
    floors = gradient_floors(attend, q, k, v, dout, q.shape[-1] ** -0.5, rows, dropout_p)
    judged = [i for i, o in enumerate(ours) if o is not None]
    check_results(
        [f"{NAMES[i]}{label}" for i in judged],
        [ours[i] for i in judged],
        [ref[i] for i in judged],
        [lowp[i] for i in judged],
        q.dtype,
        {f"{name}{label}": value for name, value in floors.items()},
    )


def check_dense(
    b,
    sq,
    sk,
    h,
    hk,
    head_dim,
    dtype,
    causal,
    gains=None,
    force=None,
    *,
    window=(-1, -1),
    dropout_p=0.0,
    deterministic=False,
):
    """The rule on a dense call run under force_plan(**force), whose choices its plans must take. window,
    dropout_p and deterministic go to the call; with dropout, the reference takes the keep mask of the
    rng_state that the call draws. gains: of q, k and v (default gains_of(dtype))."""
    gains = gains or gains_of(dtype)
    q = scaled((b, sq, h, head_dim), gains[0], dtype).requires_grad_()
    k = scaled((b, sk, hk, head_dim), gains[1], dtype).requires_grad_()
    v = scaled((b, sk, hk, head_dim), gains[2], dtype).requires_grad_()
    force = dict(force or {})
    check_plans(q, k, causal, force, window=window, dropout_p=dropout_p, deterministic=deterministic)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    rng_state = next_rng_state(q.device) if dropout_p else None
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, _ = flash_attn_func(
            q,
            k,
            v,
            dropout_p=dropout_p,
            causal=causal,
            window_size=window,
            deterministic=deterministic,
            return_attn_probs=True,
        )
        dq, dk, dv = gradients(out, (q, k, v), dout, deterministic)
    if not judges_dq_dk(sq, sk, causal, window, dropout_p):
        # Too few rows that see two keys or more: dq and dk are then sums of a few products of near-one-hot
        # probabilities, which the low-precision reference cannot resolve at these gains (the rule cannot judge
        # them, so zeros would pass). They must still be free of NaN, the failure these inputs are after.
        for name, grad in (("dq", dq), ("dk", dk)):
            assert not grad.isnan().any(), f"{name} (sq={sq}, sk={sk}): NaN"
        dq, dk = None, None
    details, variant = [f"sq={sq}", f"sk={sk}"], {}
    if tuple(window) != (-1, -1):
        details.append(f"window={tuple(window)}")
        variant["window_size"] = tuple(window)
    if dropout_p:
        details.append(f"dropout_p={dropout_p}")
        variant.update(dropout_p=dropout_p, dropout_mask=keep_mask(rng_state, dropout_p, b, h, sq, sk))
    label = f" ({', '.join(details)})"
    check_dense_results(q, k, v, dout, (out, lse, dq, dk, dv), causal, label, **variant)


def check_varlen(lens_q, lens_k, h, hk, head_dim, dtype, causal, force=None, *, dropout_p=0.0, deterministic=False):
    """The rule on a varlen call run under force_plan(**force), whose choices its plans must take; dropout_p and
    deterministic as in check_dense (each sequence's keep mask from dropout.varlen_keep_mask)."""
    gains = gains_of(dtype)
    q = scaled((sum(lens_q), h, head_dim), gains[0], dtype).requires_grad_()
    k = scaled((sum(lens_k), hk, head_dim), gains[1], dtype).requires_grad_()
    v = scaled((sum(lens_k), hk, head_dim), gains[2], dtype).requires_grad_()
    force = dict(force or {})
    check_plans(q, k, causal, force, dropout_p=dropout_p, deterministic=deterministic, lens=(lens_q, lens_k))
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    rng_state = next_rng_state(q.device) if dropout_p else None
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens(lens_q),
            cu_seqlens(lens_k),
            max(lens_q),
            max(lens_k),
            dropout_p=dropout_p,
            causal=causal,
            deterministic=deterministic,
            return_attn_probs=True,
        )
        dq, dk, dv = gradients(out, (q, k, v), dout, deterministic)
    masks = varlen_keep_mask(rng_state, dropout_p, h, lens_q, lens_k) if dropout_p else None

    def attend(q, k, v, upcast, dropped=True):
        return varlen_attention_ref(
            q,
            k,
            v,
            lens_q,
            lens_k,
            None,
            causal,
            upcast,
            dropout_p=dropout_p if dropped else 0.0,
            dropout_masks=masks if dropped else None,
        )

    def packed_reference(upcast):
        leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
        o, lse_ref = attend(*leaves, upcast)
        return (o.detach(), lse_ref, *torch.autograd.grad(o, leaves, dout.float() if upcast else dout))

    floors = gradient_floors(attend, q, k, v, dout, head_dim**-0.5, max(lens_q) * (h // hk), dropout_p)
    check_results(NAMES, (out, lse, dq, dk, dv), packed_reference(True), packed_reference(False), dtype, floors)


def check_varlen_paged(lens_q, lens_k, h, hk, head_dim, dtype, causal, page_size, force=None):
    """The rule on out and lse of a paged varlen call (forward only) run under force_plan(**force), against the
    reference on each sequence's keys gathered from its pages; the caches must come out untouched. Every cache
    row holds large values, the rows past each sequence's end and the pages no sequence uses included."""
    batch = len(lens_q)
    max_pages = -(-max(lens_k) // page_size) + 1  # one table column that no key reaches
    num_pages = batch * max_pages + 3  # and pages that no sequence names
    block_table = torch.randperm(num_pages, device="cuda")[: batch * max_pages].view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    gains = gains_of(dtype)
    q = scaled((sum(lens_q), h, head_dim), gains[0], dtype)
    k_cache = scaled((num_pages, page_size, hk, head_dim), gains[1], dtype)
    v_cache = scaled((num_pages, page_size, hk, head_dim), gains[2], dtype)
    force = dict(force or {})
    p = plan(
        "fwd",
        batch=batch,
        seqlen_q=max(lens_q),
        seqlen_k=max(lens_k),
        nheads=h,
        nheads_k=hk,
        head_dim=-(-head_dim // 8) * 8,
        causal=causal,
        varlen=True,
        override=override_string(**force),
        dtype=dtype,
        kvcache=True,
        paged=True,
    )
    # A paged call runs the variants kernel, neither packs query heads nor splits the keys, and keeps a forced
    # kernel family.
    assert p.variants and p.gqa_pack == 1 and p.num_splits == 1, p
    if "kernel" in force:
        assert p.kernel == force["kernel"], p
    k_before, v_before = k_cache.clone(), v_cache.clone()
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, s_dmask = flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens(lens_q),
            cu_seqlens(lens_k),
            max(lens_q),
            max(lens_k),
            causal=causal,
            return_attn_probs=True,
            block_table=block_table,
        )
    assert s_dmask is None
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32
    pages = [block_table[i].long() for i in range(batch)]
    k_dense = torch.cat([k_cache[pages[i]].flatten(0, 1)[: lens_k[i]] for i in range(batch)])
    v_dense = torch.cat([v_cache[pages[i]].flatten(0, 1)[: lens_k[i]] for i in range(batch)])

    def attend(upcast):
        return varlen_attention_ref(q, k_dense, v_dense, lens_q, lens_k, None, causal, upcast)

    check_results(("out", "lse"), (out, lse), attend(True), attend(False), dtype)
    for name, after, before in (("k_cache", k_cache, k_before), ("v_cache", v_cache, v_before)):
        assert torch.equal(after.view(torch.int16), before.view(torch.int16)), f"{name} changed"


# ---------------------------------------------------------------- large magnitudes


@pytest.mark.parametrize("backward", list(SHORT_BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_short_lengths_varlen(head_dim, causal, dtype, backward):
    # One varlen batch holds every short length with seqlen_q == seqlen_k, then the same lengths against other
    # key lengths (seqlen_q > seqlen_k and the reverse), so every block edge is crossed in one call.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_varlen(*PACKED_LENS, 5, 5, head_dim, dtype, causal, SHORT_BACKWARDS[backward])


@pytest.mark.parametrize("backward", list(SHORT_BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_large_magnitude_issue_reproduction(head_dim, causal, dtype, backward):
    # The reported case: dense (2, s, 5, d) with q * 5, k and v * 3 gave NaN in dq for s in {1, 2, 5} and
    # d in {16, 32, 64} on the Hopper backward.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    for s in (1, 2, 5, 17, 128):
        check_dense(2, s, s, 5, 5, head_dim, dtype, causal, force=SHORT_BACKWARDS[backward])


@pytest.mark.exhaustive
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_short_lengths_dense(head_dim, causal, dtype, backward):
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    force = BACKWARDS[backward]
    for s in SHORT_LENS:
        check_dense(2, s, s, 5, 5, head_dim, dtype, causal, force=force)
        check_dense(2, s, s + 7, 5, 5, head_dim, dtype, causal, force=force)
        check_dense(2, s + 7, s, 5, 5, head_dim, dtype, causal, force=force)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_magnitude_other_paths(path, causal, dtype):
    # Head dim 128 has the 16-row query tile and walks several key blocks per CTA on Hopper; 6 query heads on 2
    # key/value heads give the GQA paths something to walk. Elsewhere the plan has none of these.
    require_fwd_bwd_kernels(128, dtype, causal)
    for sq, sk in [(1, 1), (2, 2), (5, 5), (5, 17), (17, 5), (16, 129), (65, 300)]:
        check_dense(2, sq, sk, 6, 2, 128, dtype, causal, force=PATHS[path])


# Gains of q, k and v at the edges of what the correctness rule can judge (tests/test_checker_cpu.py holds the
# same ones): large values (v * 30) with scores as large as the low-precision reference still resolves (q and k
# * 3; at * 6 a bfloat16 reference is off by more than half of dq); tiny tensors everywhere (* 3e-3; at 1e-3 the
# dk of fp16 is subnormal, a few ulps of the smallest spacing, and the fp16 reference cannot resolve it); and
# tiny keys between large queries and values, where dq scales with |K| alone and dk with |Q|.
EXTREME_GAINS = {"large": (3.0, 3.0, 30.0), "tiny": (3e-3, 3e-3, 3e-3), "mixed": (30.0, 1e-3, 30.0)}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gains", list(EXTREME_GAINS.values()), ids=list(EXTREME_GAINS))
def test_extreme_gains(gains, dtype):
    require_fwd_bwd_kernels(64, dtype, True)
    for sq, sk in [(1, 1), (3, 70), (70, 3), (129, 129)]:
        check_dense(2, sq, sk, 4, 2, 64, dtype, True, gains=gains)


# ---------------------------------------------------------------- large magnitudes: windows, dropout, deterministic
# backward, paged varlen
#
# fp16 in the default run (the narrower range of the two dtypes), both dtypes and every kernel head dim in the
# exhaustive one.


def require_paged_kernels(head_dim, dtype):
    """Skips unless the forward variants kernel, which paged calls run, is compiled."""
    if not flash_attn_cuda.kernel_available(head_dim, dtype, True, variants=True):
        pytest.skip(f"variants forward kernel for head_dim={head_dim} {dtype} not compiled")


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_large_magnitude_window(window, head_dim, backward):
    # A window leaves each row only a few keys (rows whose LSE is far below zero) and puts its edges inside key
    # blocks, whose keys the masked kernel masks or skips on its own. 6 query heads on 2 key/value heads, so that
    # dK and dV sum over a group.
    require_variant_kernels(head_dim, torch.float16)
    for sq, sk in LENGTHS:
        check_dense(2, sq, sk, 6, 2, head_dim, torch.float16, False, force=BACKWARDS[backward], window=WINDOWS[window])


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_magnitude_dropout(head_dim, causal, backward):
    # Dropout scales the kept probabilities by 1 / (1 - p) in the forward, and dP by as much in the backward, which
    # draws the mask again from the saved rng_state.
    require_variant_kernels(head_dim, torch.float16)
    for dropout_p, (sq, sk) in itertools.product(DROPOUT_PS, LENGTHS):
        check_dense(2, sq, sk, 6, 2, head_dim, torch.float16, causal, force=BACKWARDS[backward], dropout_p=dropout_p)


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_magnitude_dropout_varlen(causal, backward):
    # Every short length in one varlen batch: each sequence draws its own mask, counted from its own first row and
    # key, and its last query and key blocks end inside the packed tensors.
    require_variant_kernels(64, torch.float16)
    check_varlen(*PACKED_LENS, 5, 5, 64, torch.float16, causal, BACKWARDS[backward], dropout_p=0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_magnitude_deterministic(head_dim, causal):
    # The deterministic backward's CTAs add into dQ in a fixed order (the mma.sync kernels' semaphores per sequence,
    # head and query block, or on Hopper the warp-specialized kernel's turns): dense calls with GQA, then every
    # short length packed into one varlen batch.
    require_fwd_bwd_kernels(head_dim, torch.float16, causal)
    for sq, sk in LENGTHS:
        check_dense(2, sq, sk, 6, 2, head_dim, torch.float16, causal, deterministic=True)
    check_varlen(*PACKED_LENS, 5, 5, head_dim, torch.float16, causal, deterministic=True)


@pytest.mark.parametrize("kernel", list(BACKWARDS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 48])
def test_large_magnitude_paged_varlen(page_size, causal, kernel):
    # Keys and values read page by page (forward only; BACKWARDS names the kernel families): every short length
    # packed into one batch, plus queries that see no key and a sequence with no query. The rows past each
    # sequence's end hold large values too, which a key read past the end would bring into the softmax.
    require_paged_kernels(128, torch.float16)
    lens_q, lens_k = PACKED_LENS
    check_varlen_paged(lens_q + [3, 0], lens_k + [0, 5], 6, 2, 128, torch.float16, causal, page_size, BACKWARDS[kernel])


@pytest.mark.exhaustive
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("window", list(EXHAUSTIVE_WINDOWS))
def test_large_magnitude_window_exhaustive(window, head_dim, dtype, backward):
    require_variant_kernels(head_dim, dtype)
    for sq, sk in EXHAUSTIVE_LENGTHS:
        check_dense(
            2, sq, sk, 6, 2, head_dim, dtype, False, force=BACKWARDS[backward], window=EXHAUSTIVE_WINDOWS[window]
        )


@pytest.mark.exhaustive
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_dropout_exhaustive(head_dim, causal, dtype, backward):
    require_variant_kernels(head_dim, dtype)
    for dropout_p, (sq, sk) in itertools.product(EXHAUSTIVE_DROPOUT_PS, EXHAUSTIVE_LENGTHS):
        check_dense(2, sq, sk, 6, 2, head_dim, dtype, causal, force=BACKWARDS[backward], dropout_p=dropout_p)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_deterministic_exhaustive(head_dim, causal, dtype):
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    for sq, sk in EXHAUSTIVE_LENGTHS:
        check_dense(2, sq, sk, 6, 2, head_dim, dtype, causal, deterministic=True)
    check_varlen(*PACKED_LENS, 6, 2, head_dim, dtype, causal, deterministic=True)


@pytest.mark.exhaustive
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_dropout_varlen_exhaustive(head_dim, causal, dtype, backward):
    require_variant_kernels(head_dim, dtype)
    for dropout_p in EXHAUSTIVE_DROPOUT_PS:
        check_varlen(*PACKED_LENS, 6, 2, head_dim, dtype, causal, BACKWARDS[backward], dropout_p=dropout_p)


@pytest.mark.exhaustive
@pytest.mark.parametrize("kernel", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_paged_varlen_exhaustive(head_dim, page_size, causal, dtype, kernel):
    require_paged_kernels(head_dim, dtype)
    lens_q, lens_k = PACKED_LENS
    check_varlen_paged(lens_q + [3, 0], lens_k + [0, 5], 6, 2, head_dim, dtype, causal, page_size, BACKWARDS[kernel])


# ---------------------------------------------------------------- batches beyond 65535


def sampled_sequences(batch):
    return sorted({0, 1, batch // 2, 65535, 65536, batch - 1} & set(range(batch)))


def check_sampled(q, k, v, dout, out, lse, grads, causal, idx):
    """The rule on a few sequences of a big batch: sequences are independent, so each is its own problem."""
    ours = (out[idx], lse[idx], *(g[idx] for g in grads))
    check_dense_results(q[idx], k[idx], v[idx], dout[idx], ours, causal)


def run_big_batch(b, sq, sk, h, hk, head_dim, causal, deterministic=False, force=None):
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for shape in ((b, sq, h, head_dim), (b, sk, hk, head_dim), (b, sk, hk, head_dim))
    )
    force = dict(force or {})
    check_forced_plans(q, k, causal, force, deterministic=deterministic)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    # The poisoned block must cover every output larger than 1 MiB: out, dq, dk, dv and the fp32 dQ accumulator
    # (whole 128-row blocks of a 32-column kernel head dim at least).
    outputs = 2 * (2 * q.numel() + 2 * k.numel()) + 4 * b * h * (sq + 127) // 128 * 128 * max(head_dim, 32)
    poison_allocator(q.device, nbytes=outputs + (64 << 20))
    with force_plan(**force):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # Every sequence is written: the poisoned memory would leave NaN anywhere a CTA was missing.
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert not t.isnan().any(), f"{name}: NaN, so some sequence was not computed"
    check_sampled(q, k, v, dout, out, lse, grads, causal, sampled_sequences(b))


@pytest.mark.parametrize(
    "force", [{}, {"kernel": "mma_sync"}, {"num_splits": 2}], ids=["default", "mma_sync", "split_kv"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_above_65535(causal, force):
    # The reported shape, (70000, 16, 1, 32): batch indexes the grid's y, which stops at 65535, so such a batch
    # runs as two launches of each kernel.
    require_fwd_bwd_kernels(32, torch.bfloat16, causal)
    run_big_batch(70000, 16, 16, 1, 1, 32, causal, force=force)


def test_batch_above_65535_warp_specialized():
    # The warp-specialized Hopper forward is persistent: its grid holds one CTA per SM whatever the batch, and each
    # CTA finds its sequences from its schedule.
    require_fwd_bwd_kernels(128, torch.bfloat16, True)
    run_big_batch(70000, 65, 70, 1, 1, 128, True, force={"ws": True, "short_keys": False})


def test_batch_above_65535_deterministic_and_decode():
    # Deterministic mode's semaphores are indexed per (sequence, head, query block); seqlen_q == 1 with GQA packs
    # the query heads as rows.
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    run_big_batch(70000, 33, 40, 2, 2, 64, True, deterministic=True)
    run_big_batch(70000, 1, 20, 4, 1, 64, False)


def test_varlen_batch_above_65535():
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    b = 70000
    lens_q = torch.randint(0, 9, (b,)).tolist()
    lens_k = torch.randint(0, 9, (b,)).tolist()
    q = torch.randn(sum(lens_q), 2, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn_like(q)
    poison_allocator(q.device)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k), causal=True, return_attn_probs=True
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    starts_q = [0, *itertools.accumulate(lens_q)]
    starts_k = [0, *itertools.accumulate(lens_k)]
    for i in sampled_sequences(b):
        q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        if q1 == q0:
            continue
        dense = [t[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1])]
        ours = (out[q0:q1][None], lse[:, q0:q1][None], dq[q0:q1][None], dk[k0:k1][None], dv[k0:k1][None])
        check_dense_results(*dense, ours, True, f" of sequence {i}")
    # Rows of empty key sequences get out 0 and lse +inf; nothing may stay poisoned.
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name}: NaN, so some sequence was not computed"


def require_free_gib(gib):
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")


def test_more_than_2pow21_ctas_forward():
    # 65535 sequences x 32 heads x 2 query blocks of at most 128 rows in the first launch: 4.2M CTAs, past
    # 2^31 / 1024, so no CTA index times 1024 threads may be formed in 32 bits. Head dim 8 keeps the tensors at
    # 4.6 GB each.
    require_fwd_bwd_kernels(32, torch.bfloat16, False)
    require_free_gib(32)
    b, s, h = 70000, 129, 32
    q, k, v = (torch.randn(b, s, h, 8, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poison_allocator(q.device, nbytes=6 << 30)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert not out.isnan().any() and not lse.isnan().any()
    idx = sampled_sequences(b)
    ref_out, ref_lse = attention_ref(q[idx], k[idx], v[idx])
    lowp_out, lowp_lse = attention_ref(q[idx], k[idx], v[idx], upcast=False)
    check_close("out", out[idx], ref_out, lowp_out)
    check_close("lse", lse[idx], ref_lse, lowp_lse)


def test_more_than_2pow21_ctas_backward():
    # 65535 sequences x 33 key blocks of at most 128 keys in the first launch: 2.16M backward CTAs (one key
    # block per CTA).
    require_fwd_bwd_kernels(32, torch.bfloat16, False)
    require_free_gib(48)
    run_big_batch(70000, 2, 33 * 128, 1, 1, 8, False, force={"key_blocks": 1})
