"""Variable-length batches and packed layouts on a CUDA device.

Varlen outputs, LSE and gradients are compared with the dense reference run on each sequence separately
(conftest.varlen_attention; the correctness rule of conftest.check_close, over all sequences at once).
Configurations whose kernels were not compiled are skipped.
"""

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    check_forced_plans,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    rand,
    require_fwd_bwd_kernels,
    requires_gpu,
    varlen_attention,
)

from flash_attn_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn_cuda.plan import force_plan

pytestmark = [pytest.mark.gpu, requires_gpu]

# Lengths with empty, single-token and odd sequences, and both seqlen_q > seqlen_k and the reverse.
LENS_Q = [0, 1, 17, 113, 64, 300, 5]
LENS_K = [7, 0, 17, 200, 64, 129, 1]


def varlen_reference(q, k, v, lens_q, lens_k, dout, causal, softmax_scale, upcast):
    """(out, lse (nheads, total_q), dq, dk, dv) of varlen_attention."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attention(*leaves, lens_q, lens_k, causal, softmax_scale, upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse, *grads)


def check_varlen(lens_q, lens_k, h, hk, head_dim, dtype, causal, deterministic=False, force=None):
    """The rule on out, lse, dq, dk and dv of flash_attn_varlen_func run under force_plan(**force), whose choices
    the plans of both passes must take (conftest.check_forced_plans). Returns (dq, dk, dv)."""
    q = rand(sum(lens_q), h, head_dim, dtype=dtype).requires_grad_()
    k = rand(sum(lens_k), hk, head_dim, dtype=dtype).requires_grad_()
    v = rand(sum(lens_k), hk, head_dim, dtype=dtype).requires_grad_()
    force = dict(force or {})
    check_forced_plans(q, k, causal, force, deterministic=deterministic, lens=(lens_q, lens_k))
    dout = torch.randn_like(q)
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
            deterministic=deterministic,
            return_attn_probs=True,
        )
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    scale = head_dim**-0.5
    ref = varlen_reference(q, k, v, lens_q, lens_k, dout, causal, scale, upcast=True)
    lowp = varlen_reference(q, k, v, lens_q, lens_k, dout, causal, scale, upcast=False)

    def attend(q, k, v, upcast):
        return varlen_attention(q, k, v, lens_q, lens_k, causal, scale, upcast)

    floors = gradient_floors(attend, q, k, v, dout, scale, max(lens_q) * (h // hk))
    check_results(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, lowp, dtype, floors)
    return dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_varlen_head_dims(head_dim, causal, dtype):
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_varlen(LENS_Q, LENS_K, 6, 2, head_dim, dtype, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_varlen_gqa_group_walk(head_dim, causal):
    # Hopper backward CTAs walking every query head of their key/value head (forced; see test_bwd_gpu.py).
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    check_varlen(LENS_Q, LENS_K, 6, 2, head_dim, torch.bfloat16, causal, force={"gqa_walk": True})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("walk", [False, True], ids=["gqa-slices", "gqa-walk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_varlen_warp_specialized_backward(head_dim, causal, walk, dtype):
    # The warp-specialized Hopper backward (forced; see test_bwd_gpu.py) over sequences that end inside query and key
    # blocks, whose tiles then hold the next sequence's rows, and sequences without queries or keys; the short-query
    # tile turned off, which would take the short ones.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    force = {"ws": True, "gqa_walk": walk, "short_queries": False}
    check_varlen(LENS_Q, LENS_K, 6, 2, head_dim, dtype, causal, force=force)
    check_varlen([700, 1, 513, 0], [300, 900, 513, 5], 4, 4, head_dim, dtype, causal, force=force)


@pytest.mark.parametrize("walk", [False, True], ids=["gqa-slices", "gqa-walk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_deterministic_is_bitwise_reproducible(head_dim, causal, walk):
    # Deterministic mode (on Hopper the warp-specialized kernel at head dims 64 and 128, the wide one at 256): the
    # same inputs twice give the same bits, and pass the rule.
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    force = {"gqa_walk": walk}
    runs = []
    for _ in range(2):
        torch.manual_seed(20261205)
        runs.append(check_varlen(LENS_Q, LENS_K, 6, 2, head_dim, torch.bfloat16, causal, True, force))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_key_blocks_per_cta(head_dim, causal):
    # Hopper backward CTAs walking 3 key blocks each (forced; see test_bwd_gpu.py), across sequences whose key
    # blocks end at different places.
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    check_varlen(LENS_Q, LENS_K, 6, 2, head_dim, torch.bfloat16, causal, force={"key_blocks": 3})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", [(LENS_Q, LENS_K), ([1, 16, 0, 5], [700, 3, 129, 0])], ids=["mixed", "short-q"])
def test_varlen_short_query_tile(lens, causal):
    # Hopper backward with 16-row query blocks at head dim 128 (forced; see test_bwd_gpu.py), walking 3 key
    # blocks per CTA.
    require_fwd_bwd_kernels(128, torch.bfloat16, causal)
    check_varlen(*lens, 6, 2, 128, torch.bfloat16, causal, force={"short_queries": True, "key_blocks": 3})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_mma_sync_forced(causal):
    # The mma.sync kernels (what Ampere runs) on varlen batches, also on Hopper.
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    check_varlen(LENS_Q, LENS_K, 6, 2, 64, torch.bfloat16, causal, force={"kernel": "mma_sync"})


def test_varlen_forward_is_never_split():
    # num_splits is for dense forwards: a varlen batch of one query row per sequence against long keys (which a
    # dense call would split) runs unsplit under it.
    require_fwd_bwd_kernels(128, torch.bfloat16, False)
    check_varlen([1, 1], [4097, 3000], 8, 8, 128, torch.bfloat16, False, force={"num_splits": 3})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(4, 4), (8, 1)])
@pytest.mark.parametrize(
    "lens",
    [([1], [1]), ([1023, 1, 0], [0, 1, 1023]), ([129, 257], [257, 129])],
    ids=["one-token", "long-short-empty", "swap"],
)
def test_varlen_lengths(lens, h, hk, causal):
    require_fwd_bwd_kernels(128, torch.bfloat16, causal)
    check_varlen(*lens, h, hk, 128, torch.bfloat16, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic(causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # the same inputs both times
        runs.append(check_varlen(LENS_Q, LENS_K, 4, 2, 64, torch.bfloat16, causal, deterministic=True))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_varlen_rows_outside_sequences():
    # A static-shape buffer longer than its sequences: the rows past cu_seqlens[-1] get zero gradients.
    require_fwd_bwd_kernels(64, torch.bfloat16, False)
    lens, spare = [40, 9], 23
    total = sum(lens) + spare
    q, k, v = (rand(total, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    cu = cu_seqlens(lens)
    poison_allocator(q.device)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.equal(grad[sum(lens) :], torch.zeros_like(grad[sum(lens) :])), name
    ref = flash_attn_varlen_func(*(t.detach()[: sum(lens)] for t in (q, k, v)), cu, cu, max(lens), max(lens))
    assert torch.equal(out[: sum(lens)], ref)


def test_varlen_matches_dense():
    # Equal lengths: the varlen call must give exactly what the dense call gives on the same rows, on the same
    # kernel. On Hopper that is the one whose warps all load and compute: the warp-specialized forward, which the
    # dense call would run, takes no variable lengths.
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    b, s, h, d = 3, 77, 4, 64
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    with force_plan(ws=False):
        dense = flash_attn_func(q, k, v, causal=True)
    cu = cu_seqlens([s] * b)
    packed = flash_attn_varlen_func(*(t.reshape(b * s, h, d) for t in (q, k, v)), cu, cu, s, s, causal=True)
    assert torch.equal(packed.view(b, s, h, d), dense)


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


# The packed/unpacked comparisons are bitwise, so they run the backward in deterministic mode (default-mode dq
# sums in whatever order the atomics land).
DET = {"deterministic": True}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_equals_unpacked(causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    qkv = rand(2, 97, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    out_packed = flash_attn_qkvpacked_func(qkv, causal=causal, **DET)
    out = flash_attn_func(q, k, v, causal=causal, **DET)
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    (dqkv,) = _grads(out_packed, (qkv,), dout)
    assert dqkv.shape == qkv.shape
    assert torch.equal(dqkv, torch.stack(_grads(out, (q, k, v), dout), dim=2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked_equals_unpacked(causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    q = rand(2, 61, 4, 64, dtype=torch.bfloat16).requires_grad_()
    kv = rand(2, 97, 2, 2, 64, dtype=torch.bfloat16).requires_grad_()
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    out_packed = flash_attn_kvpacked_func(q, kv, causal=causal, **DET)
    out = flash_attn_func(q, k, v, causal=causal, **DET)
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    dq_packed, dkv = _grads(out_packed, (q, kv), dout)
    dq, dk, dv = _grads(out, (q, k, v), dout)
    assert torch.equal(dq_packed, dq) and torch.equal(dkv, torch.stack((dk, dv), dim=2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_packed_equal_unpacked(causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    lens = [5, 0, 130, 64, 1]
    cu, total, max_len = cu_seqlens(lens), sum(lens), max(lens)
    qkv = rand(total, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    dout = rand(total, 4, 64, dtype=torch.bfloat16)

    out_packed = flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, causal=causal, **DET)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal, **DET)
    assert torch.equal(out_packed, out)
    (dqkv,) = _grads(out_packed, (qkv,), dout)
    dq, dk, dv = _grads(out, (q, k, v), dout)
    assert torch.equal(dqkv, torch.stack((dq, dk, dv), dim=1))

    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out_kv = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max_len, max_len, causal=causal, **DET)
    assert torch.equal(out_kv, out)
    _, dkv = _grads(out_kv, (q, kv), dout)
    assert torch.equal(dkv, torch.stack((dk, dv), dim=1))


def test_varlen_cuda_graph_replay():
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    lens_q, lens_k = [33, 0, 100], [40, 7, 100]
    h, d = 4, 64
    q = rand(sum(lens_q), h, d, dtype=torch.bfloat16)
    k, v = (rand(sum(lens_k), h, d, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cu_q, cu_k, max(lens_q), max(lens_k), d**-0.5, True)

    def step():
        out, lse = torch.ops.flash_attn2.varlen_fwd(q, k, v, *args)
        grads = torch.ops.flash_attn2.varlen_bwd(dout, q, k, v, out, lse, *args, True)  # deterministic: bitwise
        return out, lse, *grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    # New contents, including other lengths with the same maxima: the graph reads them on replay.
    for t in (q, k, v, dout):
        t.copy_(torch.randn_like(t))
    cu_q.copy_(cu_seqlens([100, 33, 0]))
    cu_k.copy_(cu_seqlens([100, 7, 40]))
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, step()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_opcheck(causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    lens = [5, 0, 70]
    q, k, v = (rand(sum(lens), 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    cu = cu_seqlens(lens)
    torch.library.opcheck(torch.ops.flash_attn2.varlen_fwd.default, (q, k, v, cu, cu, 70, 70, 0.125, causal))
    out, lse = torch.ops.flash_attn2.varlen_fwd(q.detach(), k.detach(), v.detach(), cu, cu, 70, 70, 0.125, causal)
    torch.library.opcheck(
        torch.ops.flash_attn2.varlen_bwd.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 70, 70, 0.125, causal, False),
    )


def test_varlen_rejects_cu_seqlens_on_another_device():
    q = rand(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the device of q"):
        flash_attn_varlen_func(q, q, q, cu, cu.cuda(), 10, 10)
