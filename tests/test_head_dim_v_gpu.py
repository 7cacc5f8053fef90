"""GPU tests of V with a head dim of its own (d_v != d_qk, DeepSeek's multi-head latent attention: 192 and 128).

Such calls run at one head dim, the wider of the two, with the narrower side zero-padded (interface._common_head_dim,
and the ops for a narrower V), except plain calls of Q/K head dim 161-192 with a V of at most 128, which run kernels of
their own (test_narrow_v_kernel). Either way out and dv have V's head dim, dq and dk Q's. Checked against the float32
reference with the correctness rule (tests/conftest.py), forward and backward, on both kernel families: dense and
varlen, GQA, causal both ways, dropout, deterministic mode, and flash_attn_with_kvcache appending k and v of their own
head dims to dense and paged caches.
"""

import pytest
import torch
from conftest import (
    MIN_ROWS_ON_TWO_KEYS,
    SMEM_99KIB,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    rand,
    requires_gpu,
    rows_on_two_keys,
)
from test_variants_gpu import draw_rng_state, forced_family, require_kernels

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn_cuda.dropout import keep_mask
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import attention_ref, kvcache_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

DEVICE = "cuda"

# (d_qk, d_v): DeepSeek's pair and its mirror, and pairs whose wider side is not a kernel head dim or a multiple of 8.
HEAD_DIM_PAIRS = [(192, 128), (128, 192), (64, 40), (72, 96)]
# Each pair meets both kernel families, the dtypes swapping between them.
CASES = [
    pytest.param(
        d_qk, d_v, kernel, dtype, id=f"qk{d_qk}-v{d_v}-{kernel}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}"
    )
    for i, (d_qk, d_v) in enumerate(HEAD_DIM_PAIRS)
    for kernel, dtype in (
        ("wgmma", (torch.bfloat16, torch.float16)[i % 2]),
        ("mma_sync", (torch.float16, torch.bfloat16)[i % 2]),
    )
]


def family(kernel, d_qk, d_v, dtype):
    """force_plan keywords for ``kernel`` at the width the call runs, skipping where its kernels are missing."""
    width = max(d_qk, d_v)
    require_kernels(width, dtype)
    return forced_family(kernel, width, dtype)


def reference(attend, q, k, v, dout, upcast):
    """(out, lse, dq, dk, dv) of ``attend(q, k, v, upcast)`` and autograd through it."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse.detach(), *grads)


def check(attend, q, k, v, dout, ours, rows, dropout_p=0.0):
    """The correctness rule on ours = (out, lse, dq, dk, dv), with the backward's floors (conftest)."""
    ref = reference(attend, q, k, v, dout, True)
    lowp = reference(attend, q, k, v, dout, False)
    floors = gradient_floors(attend, q, k, v, dout, q.shape[-1] ** -0.5, rows, dropout_p)
    check_results(("out", "lse", "dq", "dk", "dv"), ours, ref, lowp, q.dtype, floors)
    assert ours[0].shape[-1] == v.shape[-1] and ours[2].shape == q.shape and ours[4].shape == v.shape


def run_dense(q, k, v, causal, force, dropout_p=0.0, deterministic=False, dout=None):
    """flash_attn_func forward and backward on poisoned memory: (out, lse, dq, dk, dv), dout (fresh unless given)
    and the dropout mask."""
    if dout is None:
        dout = rand(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    poison_allocator(q.device)
    torch.manual_seed(7)
    with force_plan(**force):
        out, lse, _ = flash_attn_func(
            *leaves, dropout_p=dropout_p, causal=causal, deterministic=deterministic, return_attn_probs=True
        )
        grads = torch.autograd.grad(out, leaves, dout)
    mask = None
    if dropout_p:
        # The call drew its rng_state from the generator seeded just before it: draw the same one again.
        torch.manual_seed(7)
        rng_state = draw_rng_state(q.device)
        b, sq, h, _ = q.shape
        mask = keep_mask(rng_state, dropout_p, b, h, sq, k.shape[1]).to(q.device)
    return (out, lse, *grads), dout, mask


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_qk, d_v, kernel, dtype", CASES)
def test_dense(d_qk, d_v, kernel, dtype, causal):
    force = family(kernel, d_qk, d_v, dtype)
    b, h, hk = 2, 6, 2
    for sq, sk in ((113, 203), (203, 113)):
        q = rand(b, sq, h, d_qk, dtype=dtype)
        k = rand(b, sk, hk, d_qk, dtype=dtype)
        v = rand(b, sk, hk, d_v, dtype=dtype)
        ours, dout, _ = run_dense(q, k, v, causal, force)

        def attend(q, k, v, upcast, dropped=True):
            return attention_ref(q, k, v, None, causal, upcast=upcast)

        check(attend, q, k, v, dout, ours, sq * (h // hk))


@pytest.mark.parametrize("sink", [False, True], ids=["plain", "sink"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (176, 96)])
@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync", "mma_sync_99kib"])
def test_narrow_v_kernel(kernel, d_qk, d_v, dtype, causal, sink):
    # The narrow-V kernels (Q/K kernel head dim 192, V's 128; a V of 96 columns loads zero-filled to 128), forward
    # and backward: several key and query blocks with ragged ends both ways, GQA, with and without a learnable sink;
    # the mma.sync ones also on the tiles of a GPU with 99 KiB of shared memory per block. One key range per query
    # block: the forward's narrow-V kernels compute whole key ranges.
    require_kernels(192, dtype)
    if kernel == "mma_sync_99kib":
        force = {**forced_family("mma_sync", 192, dtype), "max_smem": SMEM_99KIB}
    else:
        force = forced_family(kernel, 192, dtype)
    b, h, hk = 2, 6, 2
    for sq, sk in ((1000, 1000), (257, 777), (777, 257)):
        sizes = dict(batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, head_dim=192, causal=causal)
        override = override_string(**force)
        plans = [
            plan(pass_, **sizes, head_dim_v=d_v, dtype=dtype, override=override, num_splits=1)
            for pass_ in ("fwd", "bwd")
        ]
        if not all(p.narrow_v for p in plans):
            pytest.skip("no narrow-V kernel runs on this GPU or build")
        q = rand(b, sq, h, d_qk, dtype=dtype)
        k = rand(b, sk, hk, d_qk, dtype=dtype)
        v = rand(b, sk, hk, d_v, dtype=dtype)
        learnable_sink = rand(h, dtype=torch.float32) if sink else None
        dout = rand(b, sq, h, d_v, dtype=dtype)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        poison_allocator(q.device)
        with force_plan(num_splits=1, **force):
            out, lse, _ = flash_attn_func(*leaves, causal=causal, return_attn_probs=True, learnable_sink=learnable_sink)
            ours = (out, lse, *torch.autograd.grad(out, leaves, dout))

        def attend(q, k, v, upcast, dropped=True, learnable_sink=learnable_sink):
            return attention_ref(q, k, v, None, causal, upcast=upcast, learnable_sink=learnable_sink)

        check(attend, q, k, v, dout, ours, sq * (h // hk))


@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_dropout_and_deterministic(kernel):
    """Dropout's mask is the same whatever V's head dim, and deterministic mode repeats bit for bit."""
    dtype = torch.bfloat16
    force = family(kernel, 192, 128, dtype)
    q, k = rand(2, 97, 4, 192, dtype=dtype), rand(2, 161, 2, 192, dtype=dtype)
    v = rand(2, 161, 2, 128, dtype=dtype)
    ours, dout, mask = run_dense(q, k, v, True, force, dropout_p=0.17, deterministic=True)

    def attend(q, k, v, upcast, dropped=True):
        return attention_ref(
            q,
            k,
            v,
            None,
            True,
            upcast=upcast,
            dropout_p=0.17 if dropped else 0.0,
            dropout_mask=mask if dropped else None,
        )

    check(attend, q, k, v, dout, ours, 97 * 2, dropout_p=0.17)
    again, _, _ = run_dense(q, k, v, True, force, dropout_p=0.17, deterministic=True, dout=dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, again):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_varlen(kernel, causal):
    """Sequences of different lengths, an empty one among them, packed without padding."""
    dtype = torch.float16
    force = family(kernel, 192, 128, dtype)
    lens_q, lens_k = [17, 0, 130, 64], [45, 33, 129, 64]
    h, hk = 4, 2
    q = rand(sum(lens_q), h, 192, dtype=dtype)
    k = rand(sum(lens_k), hk, 192, dtype=dtype)
    v = rand(sum(lens_k), hk, 128, dtype=dtype)
    dout = rand(sum(lens_q), h, 128, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse, _ = flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_attn_probs=True
        )
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert out.shape == (sum(lens_q), h, 128) and dv.shape == v.shape and dq.shape == q.shape
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        rows = slice(starts_q[i], starts_q[i + 1])
        keys = slice(starts_k[i], starts_k[i + 1])
        if rows_on_two_keys(lens_q[i], lens_k[i], causal) < MIN_ROWS_ON_TWO_KEYS:
            continue  # the empty sequence: nothing to judge
        qs, ks, vs = (t[None, sl] for t, sl in ((q, rows), (k, keys), (v, keys)))

        def attend(q, k, v, upcast, dropped=True):
            return attention_ref(q, k, v, None, causal, upcast=upcast)

        ours = (out[None, rows], lse[None, :, rows], dq[None, rows], dk[None, keys], dv[None, keys])
        # dk and dv of a sequence come from its own rows only: the other sequences' rows add nothing to them.
        check(attend, qs, ks, vs, dout[None, rows], ours, lens_q[i] * (h // hk))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_kvcache_appends_k_and_v_of_their_own_head_dims(kernel, paged):
    """flash_attn_with_kvcache with 192-wide keys and 128-wide values: the appended rows land in each cache at
    its own head dim, the rest of the caches is untouched, and out (128 wide) and the LSE meet the rule."""
    dtype = torch.bfloat16
    force = family(kernel, 192, 128, dtype)
    batch, h, hk, capacity, new = 3, 6, 2, 64, 2
    q = rand(batch, new, h, 192, dtype=dtype)
    k, v = rand(batch, new, hk, 192, dtype=dtype), rand(batch, new, hk, 128, dtype=dtype)
    seqlens = torch.tensor([13, 0, 40], dtype=torch.int32, device=DEVICE)
    if paged:
        page_size = 16
        pages = batch * capacity // page_size
        k_cache, v_cache = rand(pages, page_size, hk, 192, dtype=dtype), rand(pages, page_size, hk, 128, dtype=dtype)
        block_table = torch.randperm(pages, dtype=torch.int32, device=DEVICE).view(batch, capacity // page_size)
    else:
        k_cache, v_cache = rand(batch, capacity, hk, 192, dtype=dtype), rand(batch, capacity, hk, 128, dtype=dtype)
        block_table = None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    kwargs = dict(k=k, v=v, cache_seqlens=seqlens, block_table=block_table, causal=True)
    poison_allocator(q.device)
    with force_plan(**force):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)
    assert out.shape == (batch, new, h, 128)
    ref = kvcache_ref(q, k_before, v_before, upcast=True, **kwargs)
    lowp = kvcache_ref(q, k_before, v_before, upcast=False, **kwargs)
    check_results(("out", "lse"), (out, lse), ref[:2], lowp[:2], dtype)
    for name, ours, expected in (("k_cache", k_cache, ref[2]), ("v_cache", v_cache, ref[3])):
        assert torch.equal(ours, expected.to(dtype)), name


def test_mismatched_head_dims_are_refused():
    """k must have q's head dim; with a cache, k and v appended must have their caches' head dims."""
    q, k = rand(1, 8, 2, 64, dtype=torch.bfloat16), rand(1, 8, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k must have the head_dim of q"):
        flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="head_dim of v must be in"):
        flash_attn_func(q, rand(1, 8, 2, 64, dtype=torch.bfloat16), rand(1, 8, 2, 264, dtype=torch.bfloat16))
    k_cache, v_cache = rand(1, 32, 2, 64, dtype=torch.bfloat16), rand(1, 32, 2, 32, dtype=torch.bfloat16)
    seqlens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head dims of k_cache and v_cache"):
        flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k=q[:, :1, :2], v=q[:, :1, :2], cache_seqlens=seqlens)


@pytest.mark.parametrize("kernel", ["wgmma", "mma_sync"])
def test_opcheck_narrower_v(kernel):
    # The ops take a V narrower than Q and K: the forward's output has V's head dim whether a kernel of its own runs
    # it (Hopper, 192 and 128) or the op pads V, and the backward's dv too (the fake implementations say as much).
    # The ops take the plan's choices as an argument (force_plan reaches them through the public functions only).
    override = override_string(**family(kernel, 192, 128, torch.bfloat16))
    q, k = (rand(2, 130, 4, 192, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    v = rand(2, 130, 4, 128, dtype=torch.bfloat16).requires_grad_()
    torch.library.opcheck(torch.ops.flash_attn2.fwd.default, (q, k, v, 0.125, True, False, 0, override))
    out, lse = torch.ops.flash_attn2.fwd(q.detach(), k.detach(), v.detach(), 0.125, True, False, 0, override)
    assert out.shape == (2, 130, 4, 128) and out.is_contiguous()
    dout = torch.randn_like(out)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.125, True, False, override)
    torch.library.opcheck(torch.ops.flash_attn2.bwd.default, bwd_args)
