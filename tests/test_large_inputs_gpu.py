"""Large-magnitude inputs at short and block-edge lengths, and batches beyond the grid's y limit, on a CUDA device.

Large-magnitude q and k with only a few keys give rows whose LSE is far below zero. Anything a kernel computes
as exp(score - lse) at a key or query that lies outside the sequence then overflows, and an overflowed value
times a zero-filled operand is NaN. Each call here packs every short length into one varlen batch, or loops
over them densely, and checks out, lse, dq, dk and dv with the correctness rule, which rejects any NaN (with
the atol of conftest.check_results).
"""

import itertools

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    check_close,
    check_forced_plans,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    require_fwd_bwd_kernels,
    requires_gpu,
    varlen_attention,
)

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from flash_attn_cuda.plan import force_plan
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu]

# Every length up to 17, then both sides of the 64- and 128-row/key block edges.
SHORT_LENS = list(range(1, 18)) + [63, 64, 65, 127, 128, 129]
# The gains of the reported NaN case: q * 5, k and v * 3.
GAINS = (5.0, 3.0, 3.0)
# The kernels, as force_plan keywords: the default ones (on Hopper the wgmma kernels) and the mma.sync ones.
BACKWARDS = {"default": {}, "mma_sync": {"kernel": "mma_sync"}}
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


def scaled(shape, gain, dtype):
    return (torch.randn(shape, device="cuda") * gain).to(dtype)


NAMES = ("out", "lse", "dq", "dk", "dv")


def reference(q, k, v, dout, causal, upcast):
    """(out, lse, dq, dk, dv) of attention_ref on dense (batch, seqlen, heads, head_dim) inputs."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, None, causal, upcast=upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse, *grads)


def check_dense_results(q, k, v, dout, ours, causal, label=""):
    """The rule on ours = (out, lse, dq, dk, dv) of dense inputs."""
    ref = reference(q, k, v, dout, causal, upcast=True)
    lowp = reference(q, k, v, dout, causal, upcast=False)

    def attend(q, k, v, upcast):
        return attention_ref(q, k, v, None, causal, upcast=upcast)

    rows = q.shape[1] * (q.shape[2] // k.shape[2])
    floors = gradient_floors(attend, q, k, v, dout, ours[0], q.shape[-1] ** -0.5, rows)
    check_results(
        [f"{name}{label}" for name in NAMES],
        ours,
        ref,
        lowp,
        q.dtype,
        {f"{name}{label}": value for name, value in floors.items()},
    )


def check_dense(b, sq, sk, h, hk, head_dim, dtype, causal, gains=GAINS, force=None):
    """The rule on a dense call run under force_plan(**force), whose choices its plans must take."""
    q = scaled((b, sq, h, head_dim), gains[0], dtype).requires_grad_()
    k = scaled((b, sk, hk, head_dim), gains[1], dtype).requires_grad_()
    v = scaled((b, sk, hk, head_dim), gains[2], dtype).requires_grad_()
    force = dict(force or {})
    check_forced_plans(q, k, causal, force)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    check_dense_results(q, k, v, dout, (out, lse, dq, dk, dv), causal, f" (sq={sq}, sk={sk})")


def check_varlen(lens_q, lens_k, h, hk, head_dim, dtype, causal, force=None):
    """The rule on a varlen call run under force_plan(**force), whose choices its plans must take."""
    q = scaled((sum(lens_q), h, head_dim), GAINS[0], dtype).requires_grad_()
    k = scaled((sum(lens_k), hk, head_dim), GAINS[1], dtype).requires_grad_()
    v = scaled((sum(lens_k), hk, head_dim), GAINS[2], dtype).requires_grad_()
    force = dict(force or {})
    check_forced_plans(q, k, causal, force, lens=(lens_q, lens_k))
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
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
            causal=causal,
            return_attn_probs=True,
        )
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    def attend(q, k, v, upcast):
        return varlen_attention(q, k, v, lens_q, lens_k, causal, None, upcast)

    def packed_reference(upcast):
        leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
        o, lse_ref = attend(*leaves, upcast)
        return (o.detach(), lse_ref, *torch.autograd.grad(o, leaves, dout.float() if upcast else dout))

    floors = gradient_floors(attend, q, k, v, dout, out, head_dim**-0.5, max(lens_q) * (h // hk))
    check_results(NAMES, (out, lse, dq, dk, dv), packed_reference(True), packed_reference(False), dtype, floors)


# ---------------------------------------------------------------- large magnitudes


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_large_magnitude_short_lengths_varlen(head_dim, causal, dtype, backward):
    # One varlen batch holds every short length with seqlen_q == seqlen_k, then the same lengths against other
    # key lengths (seqlen_q > seqlen_k and the reverse), so every block edge is crossed in one call.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    lens_k_other = SHORT_LENS[5:] + SHORT_LENS[:5]
    check_varlen(SHORT_LENS * 2, SHORT_LENS + lens_k_other, 5, 5, head_dim, dtype, causal, BACKWARDS[backward])


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_large_magnitude_issue_reproduction(head_dim, causal, dtype, backward):
    # The reported case: dense (2, s, 5, d) with q * 5, k and v * 3 gave NaN in dq for s in {1, 2, 5} and
    # d in {16, 32, 64} on the Hopper backward.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    for s in (1, 2, 5, 17, 128):
        check_dense(2, s, s, 5, 5, head_dim, dtype, causal, force=BACKWARDS[backward])


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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "gains", [(30.0, 30.0, 30.0), (1e-3, 1e-3, 1e-3), (30.0, 1e-3, 30.0)], ids=["x30", "x1e-3", "mixed"]
)
def test_extreme_gains(gains, dtype):
    require_fwd_bwd_kernels(64, dtype, True)
    for sq, sk in [(1, 1), (3, 70), (70, 3), (129, 129)]:
        check_dense(2, sq, sk, 4, 2, 64, dtype, True, gains=gains)


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
