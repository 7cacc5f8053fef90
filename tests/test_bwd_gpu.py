"""Backward pass against the float32 reference (the correctness rule of conftest.check_close), on a CUDA device.

dq, dk and dv of flash_attn_func are compared with autograd through attention_ref, in float32 on upcast
inputs (ref) and in the input dtype (ref_lowp), with the terms of conftest.check_results (one ulp for small
tensors, and for dq and dk gradient_floors: D is computed from the rounded output), and so is the forward output
of the same call. Configurations whose kernels were not compiled are skipped.
"""

import itertools

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    SMEM_99KIB,
    check_forced_plans,
    check_results,
    gradient_floors,
    poison_allocator,
    rand,
    require_fwd_bwd_kernels,
    requires_gpu,
)

from flash_attn_cuda import flash_attn_func
from flash_attn_cuda.plan import force_plan
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu]

SEQLENS = [1, 17, 113, 1023]


def reference_grads(q, k, v, dout, causal, softmax_scale, upcast):
    """(out, dq, dk, dv) of attention_ref and autograd through it."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, softmax_scale, causal, upcast=upcast)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout.float() if upcast else dout))


def check_grads(q, k, v, causal, softmax_scale=None, deterministic=False, force=None, dout=None):
    """The rule on out, dq, dk and dv of flash_attn_func, forward and backward run under force_plan(**force), whose
    choices the plans of both passes must take (conftest.check_forced_plans). ``dout``: the output gradient, any
    strides (default: fresh random). Returns {pass: plan}."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    force = dict(force or {})
    plans = check_forced_plans(q, k, causal, force, deterministic=deterministic)
    if dout is None:
        dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    poison_allocator(q.device)
    with force_plan(**force):
        out = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    ref = reference_grads(q, k, v, dout, causal, softmax_scale, upcast=True)
    lowp = reference_grads(q, k, v, dout, causal, softmax_scale, upcast=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else abs(softmax_scale)
    rows = q.shape[1] * (q.shape[2] // k.shape[2])

    def attend(q, k, v, upcast):
        return attention_ref(q, k, v, softmax_scale, causal, upcast=upcast)

    floors = gradient_floors(attend, q, k, v, dout, scale, rows)
    check_results(("out", "dq", "dk", "dv"), (out.detach(), dq, dk, dv), ref, lowp, q.dtype, floors)
    return plans


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("b, sq, sk, h, hk", [(2, 113, 257, 4, 4), (2, 257, 113, 6, 2)], ids=["mha-sq<sk", "gqa-sq>sk"])
def test_head_dims(b, sq, sk, h, hk, head_dim, causal, dtype):
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(b, sq, h, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        causal,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 72, 104, 136, 200])
@pytest.mark.parametrize("h, hk, walk", [(4, 4, False), (6, 2, False), (6, 2, True)], ids=["mha", "gqa", "gqa-walk"])
def test_head_dim_below_kernel_dim(h, hk, walk, head_dim, causal, dtype):
    # Multiples of 8 that fill only part of the kernel's head dim. On Hopper, element-typed dK and dV (MHA, or a
    # GQA group walked per CTA) leave the kernel in 16 B chunks of a (keys, kernel head dim) tile, and a chunk
    # past head_dim would land on the next key's row; GQA without a walk writes fp32 slices instead.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(2, 113, h, head_dim, dtype=dtype),
        rand(2, 301, hk, head_dim, dtype=dtype),
        rand(2, 301, hk, head_dim, dtype=dtype),
        causal,
        force={"gqa_walk": walk},
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 256])
@pytest.mark.parametrize("seqlens", list(itertools.product(SEQLENS, SEQLENS)), ids=lambda p: f"sq{p[0]}-sk{p[1]}")
def test_seqlens(seqlens, head_dim, causal, dtype):
    sq, sk = seqlens
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(2, sq, 4, head_dim, dtype=dtype),
        rand(2, sk, 4, head_dim, dtype=dtype),
        rand(2, sk, 4, head_dim, dtype=dtype),
        causal,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("h, hk", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("sq, sk", [(17, 1023), (1023, 113), (257, 257), (2, 5), (5, 2)], ids=lambda v: str(v))
def test_mma_sync_backward_forced(sq, sk, h, hk, head_dim, causal, dtype):
    # Hopper runs the warpgroup-MMA backward for these head dims; the mma.sync one (what Ampere runs) must
    # stay correct there too. GQA sums dK and dV in fp32 slices; equal heads write them from the kernel.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(2, sq, h, head_dim, dtype=dtype),
        rand(2, sk, hk, head_dim, dtype=dtype),
        rand(2, sk, hk, head_dim, dtype=dtype),
        causal,
        force={"kernel": "mma_sync"},
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["", "deterministic"])
@pytest.mark.parametrize("head_dim", [*KERNEL_HEAD_DIMS, 200])
@pytest.mark.parametrize(
    "sq, sk, h, hk", [(17, 301, 6, 2), (301, 17, 3, 3), (257, 257, 4, 4)], ids=["gqa-sq<sk", "sq>sk", "sq=sk"]
)
def test_99kib_tile_set(sq, sk, h, hk, head_dim, deterministic, causal, dtype):
    # The mma.sync kernels' tiles for GPUs with 99 KiB of shared memory per block, run here through max_smem:
    # every kernel of the set fits, head dim 224's (and 200's) backward runs head dim 256's kernel. GQA sums dK and
    # dV in fp32 slices; equal heads write them from the kernel, through K's and V's shared memory.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    if head_dim > 192:
        require_fwd_bwd_kernels(256, dtype, causal)
    plans = check_grads(
        rand(2, sq, h, head_dim, dtype=dtype),
        rand(2, sk, hk, head_dim, dtype=dtype),
        rand(2, sk, hk, head_dim, dtype=dtype),
        causal,
        deterministic=deterministic,
        force={"max_smem": SMEM_99KIB},
    )
    for p in plans.values():
        assert p.kernel == "mma_sync" and p.tile_budget == SMEM_99KIB and 0 < p.smem <= SMEM_99KIB, p


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("b, sq, sk, h, hk", [(2, 113, 1023, 8, 2), (2, 257, 17, 6, 1)], ids=["gqa-sq<sk", "mqa-sq>sk"])
def test_gqa_group_walk(b, sq, sk, h, hk, head_dim, causal, dtype):
    # gqa_walk=True: on Hopper every backward CTA walks all query heads of its key/value head and sums dK and dV
    # in registers, whatever the grid size (elsewhere the plan has no walk).
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(b, sq, h, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        causal,
        force={"gqa_walk": True},
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("walk", ["0", "auto"])
def test_gqa_group_walk_by_grid_size(walk, causal):
    # 2 sequences x 2 key/value heads x 33 key blocks of 128 keys fill the 132 SMs of an H200, so the grid-size
    # rule walks groups there; "0" keeps one CTA per query head with fp32 dK/dV slices.
    require_fwd_bwd_kernels(128, torch.bfloat16, causal)
    force = {"gqa_walk": False} if walk == "0" else {}
    plans = check_grads(
        rand(2, 200, 8, 128, dtype=torch.bfloat16),
        rand(2, 4100, 2, 128, dtype=torch.bfloat16),
        rand(2, 4100, 2, 128, dtype=torch.bfloat16),
        causal,
        force=force,
    )
    p = plans["bwd"]
    fills = torch.cuda.get_device_properties(0).multi_processor_count <= 2 * 2 * 33
    walks = walk == "auto" and p.kernel == "wgmma" and fills
    assert p.heads_per_cta == (4 if walks else 1) and p.dkv_fp32_slices is not walks, p


@pytest.mark.parametrize("key_blocks", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize(
    "b, sq, sk, h, hk",
    [(2, 1, 1023, 4, 4), (2, 113, 777, 6, 2), (1, 300, 200, 3, 3)],
    ids=["decode", "gqa-sq<sk", "sq>sk"],
)
def test_key_blocks_per_cta(b, sq, sk, h, hk, head_dim, causal, key_blocks):
    # key_blocks=n: every Hopper backward CTA of head dims <= 128 walks n consecutive key blocks, loading the
    # next one's K and V during the current one (elsewhere the plan keeps one). The shapes give one and several
    # query blocks per key block, causal key blocks whose first query blocks see none of their keys, a CTA whose
    # key blocks run past the sequence end, and GQA groups walked per CTA.
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    check_grads(
        rand(b, sq, h, head_dim, dtype=torch.bfloat16),
        rand(b, sk, hk, head_dim, dtype=torch.bfloat16),
        rand(b, sk, hk, head_dim, dtype=torch.bfloat16),
        causal,
        force={"key_blocks": key_blocks, "gqa_walk": True},
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 64, 104, 128])
@pytest.mark.parametrize(
    "b, sq, sk, h, hk, walk",
    [
        (2, 113, 257, 4, 4, False),
        (2, 257, 113, 6, 2, True),
        (2, 300, 1000, 6, 2, False),
        (3, 1023, 1023, 2, 1, True),
        (1, 1, 700, 4, 4, False),
        (40, 129, 64, 8, 8, False),
        (2, 2000, 100, 4, 2, True),
    ],
    ids=[
        "mha-sq<sk",
        "gqa-walk-sq>sk",
        "gqa-slices",
        "mqa-walk-long",
        "one-query",
        "more-tiles-than-sms",
        "one-key-block-many-queries",
    ],
)
def test_warp_specialized_backward(b, sq, sk, h, hk, walk, head_dim, causal, dtype):
    # ws=1 runs the warp-specialized Hopper backward (head dims 64 and 128, dense plain calls): odd lengths both
    # ways, causal pairs of key blocks in its persistent schedule, GQA walked per tile or summed from fp32 slices,
    # one query row (the short-query tile turned off, which would take it), and more tiles than SMs. With a causal
    # mask and more queries than keys, whole query blocks see no key: no key block stores their dQ tile, and their
    # dq must come out zero from an unzeroed (poisoned) dq_accum. With one key block under many query blocks, every
    # step stores a query block's first (and only) dQ tile.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    check_grads(
        rand(b, sq, h, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        rand(b, sk, hk, head_dim, dtype=dtype),
        causal,
        force={"ws": True, "gqa_walk": walk, "short_queries": False},
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_warp_specialized_backward_strided(causal):
    # q, k, v and dout as views into packed buffers: the TMA descriptors take their strides.
    require_fwd_bwd_kernels(128, torch.bfloat16, causal)
    qkv = rand(2, 300, 3, 4, 128, dtype=torch.bfloat16)
    dout = rand(2, 300, 2, 4, 128, dtype=torch.bfloat16)[:, :, 1]
    check_grads(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        causal,
        force={"ws": True, "short_queries": False},
        dout=dout,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sq", [1, 100])
def test_short_queries_long_keys(sq, dtype):
    # Grids large enough that the heuristic walks several key blocks per backward CTA on Hopper (8 on an H200).
    require_fwd_bwd_kernels(128, dtype, False)
    p = check_grads(
        rand(8, sq, 16, 128, dtype=dtype),
        rand(8, 4096, 16, 128, dtype=dtype),
        rand(8, 4096, 16, 128, dtype=dtype),
        False,
    )["bwd"]
    assert p.key_blocks_per_cta > 1 if p.kernel == "wgmma" else p.key_blocks_per_cta == 1, p


@pytest.mark.parametrize("short_queries", [True, False], ids=["short-tile", "regular-tile"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "b, sq, sk, h, hk, key_blocks",
    [
        (3, 1, 1023, 4, 4, "auto"),
        (2, 5, 777, 6, 2, "auto"),
        (2, 16, 4097, 2, 2, "auto"),
        (2, 16, 300, 4, 4, 3),
        (1, 113, 300, 3, 1, "auto"),
        (1, 300, 113, 2, 2, 2),
    ],
    ids=["decode", "gqa-sq5", "sq16-long", "sq16-walk3", "sq113-mqa", "sq300-walk2"],
)
@pytest.mark.parametrize("walk_groups", [False, True], ids=["per-head", "group-walk"])
def test_short_query_tile_forced(b, sq, sk, h, hk, key_blocks, dtype, causal, short_queries, walk_groups):
    # On Hopper, head dim 128 with seqlen_q <= 16 runs 16-row query blocks in the backward (dQ^T = K^T dS^T).
    # short_queries=True forces them at every length (several query blocks per key block, causal diagonals),
    # False never, so both tiles are checked on both sides of the threshold.
    require_fwd_bwd_kernels(128, dtype, causal)
    force = {"short_queries": short_queries, "gqa_walk": walk_groups}
    if key_blocks != "auto":
        force["key_blocks"] = key_blocks
    check_grads(
        rand(b, sq, h, 128, dtype=dtype),
        rand(b, sk, hk, 128, dtype=dtype),
        rand(b, sk, hk, 128, dtype=dtype),
        causal,
        force=force,
    )


@pytest.mark.parametrize("plan_override", ["key_blocks=two", "gqa_walk=yes", "kernel"])
def test_bwd_op_rejects_malformed_plan_override(plan_override):
    # The message names the argument (test_plan_cpu.py checks the plan op alike).
    require_fwd_bwd_kernels(64, torch.bfloat16, False)
    q, k, v = (rand(1, 65, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, False)
    with pytest.raises((RuntimeError, ValueError), match="plan_override"):
        torch.ops.flash_attn2.bwd(torch.randn_like(out), q, k, v, out, lse, 0.125, False, plan_override=plan_override)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(8, 1), (8, 2), (12, 3)])
def test_gqa_mqa(h, hk, causal):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    check_grads(
        rand(2, 300, h, 64, dtype=torch.bfloat16),
        rand(2, 200, hk, 64, dtype=torch.bfloat16),
        rand(2, 200, hk, 64, dtype=torch.bfloat16),
        causal,
    )


@pytest.mark.parametrize("causal, deterministic", [(False, False), (True, True)], ids=["full", "causal-det"])
@pytest.mark.parametrize("sk", [1, 1023])
@pytest.mark.parametrize("h, hk", [(8, 2), (6, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (128, torch.float16)], ids=["d64-bf16", "d128-fp16"])
def test_decode_gqa_packing(head_dim, dtype, h, hk, sk, causal, deterministic):
    # seqlen_q == 1: the op runs the query heads of a group as rows of one head (strided views), so dk and
    # dv come out per key/value head without the fp32 group sum; causal is a no-op. q is a strided view
    # (heads-major storage) so the packed views are not plain reshapes of contiguous tensors.
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    q = rand(3, h, 1, head_dim, dtype=dtype).transpose(1, 2)
    k, v = (rand(3, sk, hk, head_dim, dtype=dtype) for _ in range(2))
    for pass_, p in check_grads(q, k, v, causal, deterministic=deterministic).items():
        if deterministic and pass_ == "bwd" and p.kernel == "wgmma":
            # A deterministic backward on Hopper runs the warp-specialized kernel, which does not pack.
            assert p.gqa_pack == 1 and p.warp_specialized and not p.causal, p
            continue
        assert p.gqa_pack == h // hk and not p.causal and not p.dkv_fp32_slices, (pass_, p)
    dout = rand(3, 1, h, head_dim, dtype=dtype)
    out, lse = torch.ops.flash_attn2.fwd(q, k, v, head_dim**-0.5, causal)
    assert out.is_contiguous() and lse.shape == (3, h, 1) and lse.is_contiguous()
    dq, dk, dv, _ = torch.ops.flash_attn2.bwd(dout, q, k, v, out, lse, head_dim**-0.5, causal, deterministic)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["seq_major", "heads_major", "sliced"])
@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
def test_noncontiguous_dout(kernel, layout, dtype):
    # The loss hands autograd whatever strides it has: a transposed view, or every other row of a wider buffer
    # whose other half is NaN, so that a read outside the view shows.
    require_fwd_bwd_kernels(128, dtype, True)
    b, sq, sk, h, hk, d = 2, 113, 257, 6, 2, 128
    if layout == "seq_major":
        dout = rand(sq, b, h, d, dtype=dtype).transpose(0, 1)
    elif layout == "heads_major":
        dout = rand(b, h, sq, d, dtype=dtype).transpose(1, 2)
    else:
        wide = torch.full((b, sq, 2 * h, d), float("nan"), dtype=dtype, device="cuda")
        wide[:, :, ::2] = rand(b, sq, h, d, dtype=dtype)
        dout = wide[:, :, ::2]
    assert not dout.is_contiguous()
    force = {} if kernel == "default" else {"kernel": kernel}
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)
    check_grads(q, k, v, True, force=force, dout=dout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_packed_qkv(causal):
    require_fwd_bwd_kernels(64, torch.float16, causal)
    q, k, v = rand(2, 333, 3, 4, 64, dtype=torch.float16).unbind(2)
    check_grads(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 100])
def test_padded_head_dim(head_dim, causal):
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    check_grads(
        rand(2, 150, 4, head_dim, dtype=torch.bfloat16),
        rand(2, 97, 2, head_dim, dtype=torch.bfloat16),
        rand(2, 97, 2, head_dim, dtype=torch.bfloat16),
        causal,
    )


def check_bitwise_reproducible(q, k, v, causal, force=None, runs=3):
    """Deterministic mode: ``runs`` backward passes of the same call give the same bits, and pass the rule."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    grads = []
    with force_plan(**(force or {})):
        for _ in range(runs):
            out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
            grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
    check_grads(q, k, v, causal, deterministic=True, force=force)


# The mma.sync kernel adds each query block's dQ within the dV GEMM at head dims 64 and 128, after the next block's
# load at 224, and one half each way at 256 (flash_bwd_kernel.h); on Hopper, by default, head dims 64 and 128 run
# the warp-specialized kernel (walking GQA groups or writing fp32 slices) and 224 and 256 the wide one. Each orders
# its turns in deterministic mode differently.
@pytest.mark.parametrize("head_dim", [64, 128, 224, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1023, 1023), (300, 1023), (1023, 700)])
@pytest.mark.parametrize("walk", [False, True], ids=["gqa-slices", "gqa-walk"])
@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
def test_deterministic_is_bitwise_reproducible(kernel, walk, sq, sk, causal, head_dim):
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    q = rand(2, sq, 8, head_dim, dtype=torch.bfloat16)
    k, v = (rand(2, sk, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    force = {"gqa_walk": walk} if kernel == "default" else {"gqa_walk": walk, "kernel": kernel}
    check_bitwise_reproducible(q, k, v, causal, force=force)


# The wide kernel's staggered walk, key block n from query block n (by default in deterministic mode without a mask,
# forced in the default mode): more query blocks than key blocks and fewer (where deterministic mode walks
# unstaggered), a single query block, GQA walked and in fp32 slices.
@pytest.mark.parametrize("head_dim", [224, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("sq, sk", [(1023, 1023), (1023, 700), (300, 1023), (61, 3000)])
def test_staggered_wide_backward(sq, sk, deterministic, head_dim):
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, False)
    q = rand(2, sq, 8, head_dim, dtype=torch.bfloat16)
    k, v = (rand(2, sk, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    for walk in (False, True):
        force = {"stagger": True, "gqa_walk": walk}
        if deterministic:
            check_bitwise_reproducible(q, k, v, False, force=force, runs=2)
        else:
            check_grads(q, k, v, False, force=force)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_warp_specialized_over_rounds(head_dim, causal):
    # The warp-specialized kernel's persistent grid in deterministic mode (Hopper): many rounds of (sequence,
    # head)s, each round holding whole ones, and a length that ends inside a key block.
    require_fwd_bwd_kernels(head_dim, torch.bfloat16, causal)
    q = rand(3, 2000, 24, head_dim, dtype=torch.bfloat16)
    k, v = (rand(3, 2000, 24, head_dim, dtype=torch.bfloat16) for _ in range(2))
    check_bitwise_reproducible(q, k, v, causal, runs=2)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "bhsd-transposed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck(causal, transposed):
    require_fwd_bwd_kernels(64, torch.bfloat16, causal)
    if transposed:  # dense but not contiguous, as when a model keeps (batch, heads, seqlen, head_dim) tensors
        q, k, v = (rand(2, 4, 65, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    else:
        q, k, v = (rand(2, 65, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    torch.library.opcheck(torch.ops.flash_attn2.fwd.default, (q, k, v, 0.125, causal))
    out, lse = torch.ops.flash_attn2.fwd(q.detach(), k.detach(), v.detach(), 0.125, causal)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.flash_attn2.bwd.default, (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.125, causal, False)
    )


def test_compiled_training_matches_eager():
    # Three SGD steps of a compiled and an eager model from the same weights must give the same bits: the
    # deterministic backward makes each call reproducible, and the model is the attention op alone (q, k and v are
    # its parameters), so that nothing but the op's own routing under torch.compile could make them differ. The
    # eager gradients of the first step meet the correctness rule, so that two equally wrong paths fail too.
    require_fwd_bwd_kernels(64, torch.bfloat16, True)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shapes = [(2, 200, 4, 64), (2, 200, 2, 64), (2, 200, 2, 64)]
            self.q, self.k, self.v = (torch.nn.Parameter(rand(*s, dtype=torch.bfloat16)) for s in shapes)

        def forward(self, weight):
            out = flash_attn_func(self.q, self.k, self.v, causal=True, deterministic=True)
            return (out.float() * weight).sum()

    torch.manual_seed(0)
    eager = Attention()
    compiled = Attention()
    compiled.load_state_dict(eager.state_dict())
    step = torch.compile(compiled, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.5)
    for i in range(3):
        weight = torch.randn(2, 200, 4, 64, device="cuda")
        if i == 0:
            check_grads(eager.q, eager.k, eager.v, True, deterministic=True, dout=weight.to(torch.bfloat16))
        grads = []
        for fn, model, opt in ((eager, eager, opt_e), (step, compiled, opt_c)):
            opt.zero_grad()
            fn(weight).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        for name, ge, gc in zip("qkv", *grads):
            assert torch.equal(ge, gc), f"step {i}: d{name} differs between eager and compiled"
            assert ge.abs().max() > 0, f"step {i}: d{name} is zero"
    for name, pe, pc in zip("qkv", eager.parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), f"{name} differs after three steps"


def test_compiled_autograd_and_lse_gradient():
    # Compiled autograd must run the backward node (C++ or Python, flash_attn_cuda._ops.AUTOGRAD says which), and
    # the LSE, which requires grad as in flash-attn 2.x, passes no gradient back (deterministic mode, so the
    # gradients compare bitwise).
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    q, k, v = (rand(2, 129, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)

    def backward(with_lse):
        for t in (q, k, v):
            t.grad = None
        out, lse, _ = flash_attn_func(q, k, v, causal=True, deterministic=True, return_attn_probs=True)
        assert lse.requires_grad
        loss = (out * dout).sum() + (lse.sum() if with_lse else 0)
        loss.backward()
        return [t.grad.clone() for t in (q, k, v)]

    expected = backward(False)
    assert all(torch.equal(a, b) for a, b in zip(expected, backward(True)))
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        compiled = backward(False)
    assert all(torch.equal(a, b) for a, b in zip(expected, compiled))


def test_memory_is_linear_at_16k():
    # At 16k tokens the fp32 score matrices of 4 heads would take 4 GiB; the backward must stay far below.
    require_fwd_bwd_kernels(128, torch.bfloat16, True)
    q, k, v = (rand(1, 16384, 4, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 2**29, f"backward used {extra / 2**20:.0f} MiB"
