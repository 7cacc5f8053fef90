"""Forward kernel against the float32 reference (the correctness rule of conftest.check_close), on a CUDA device.

The default matrix is a representative slice meant to finish in a few minutes on an H200;
``--exhaustive`` adds the full cross product. Configurations whose kernel was not compiled
(see ``flash_attn_cuda.kernel_available``) are skipped.
"""

import itertools
import math
import os

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    LOGIT_STD,
    MAX_SMEM,
    PARTIAL_HEAD_DIMS,
    SMEM_227KIB,
    check_close,
    check_forced_plans,
    device_plan,
    poison_allocator,
    requires_gpu,
)

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

fwd = torch.ops.flash_attn2.fwd
SEQLENS = [1, 17, 113, 1023, 2049]
LAYOUTS = ["contiguous", "packed", "seq_major", "heads_major", "guard_bands"]


def require_kernel(head_dim, dtype, causal):
    if not flash_attn_cuda.kernel_available(head_dim, dtype, causal):
        pytest.skip(f"kernel for head_dim={head_dim} {dtype} causal={causal} not compiled")


def batch_for(seqlen_q, seqlen_k):
    # Many short sequences or a few long ones: covers batch 1..8 at a bounded cost.
    longest = max(seqlen_q, seqlen_k)
    return 8 if longest <= 17 else 5 if longest <= 113 else 3 if longest <= 1023 else 1


def make_qkv(b, sq, sk, h, hk, d, dtype, layout="contiguous", device="cuda"):
    """Random q, k, v of shapes (b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d) in a given layout.

    Every layout keeps the last dim contiguous and all strides multiples of 8 elements when d is.
    """

    def rand(*shape):
        return torch.randn(shape, dtype=dtype, device=device)

    if layout == "contiguous":
        return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    if layout == "packed":
        # Slices of one buffer, as produced by a fused qkv (or kv) projection.
        if sq == sk and h == hk:
            return rand(b, sq, 3, h, d).unbind(2)
        k, v = rand(b, sk, 2, hk, d).unbind(2)
        return rand(b, sq, h, d), k, v
    if layout == "seq_major":
        # (seqlen, batch, heads, dim) storage seen as (batch, seqlen, heads, dim).
        return (
            rand(sq, b, h, d).transpose(0, 1),
            rand(sk, b, hk, d).transpose(0, 1),
            rand(sk, b, hk, d).transpose(0, 1),
        )
    if layout == "heads_major":
        # (batch, heads, seqlen, dim) storage, the layout of scaled_dot_product_attention.
        return (
            rand(b, h, sq, d).transpose(1, 2),
            rand(b, hk, sk, d).transpose(1, 2),
            rand(b, hk, sk, d).transpose(1, 2),
        )
    if layout == "guard_bands":
        # Views into NaN-filled buffers with room before and after the sequence, an extra head
        # and 24 extra elements past head_dim. A kernel that touches memory outside the view,
        # even masked out afterwards, turns the result into NaN (0 * NaN is NaN).
        def view(s, n):
            buf = torch.full((b, s + 8, n + 1, d + 24), float("nan"), dtype=dtype, device=device)
            t = buf[:, 3 : 3 + s, :n, :d]
            t.copy_(torch.randn(t.shape, dtype=dtype, device=device))
            return t

        return view(sq, h), view(sk, hk), view(sk, hk)
    raise ValueError(layout)


def run_and_check(q, k, v, causal, softmax_scale=None, via="op", force=None):
    """Run the kernel on poisoned output memory and apply the correctness rule to out and lse.

    ``force``: force_plan keywords; the op gets them as its num_splits and plan_override arguments, and
    flash_attn_func runs under force_plan. The plan of a call with these sizes must take what they force
    (conftest.check_forced_plans); returns that plan.
    """
    b, sq, h, d = q.shape
    force = dict(force or {})
    forward_plan = check_forced_plans(q, k, causal, force, passes=("fwd",))["fwd"]
    poison_allocator(q.device)
    if via == "op":
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
        choices = {name: value for name, value in force.items() if name != "num_splits"}
        out, lse = fwd(
            q, k, v, scale, causal, num_splits=force.get("num_splits", 0), plan_override=override_string(**choices)
        )
        assert out.is_contiguous()
    else:
        with force_plan(**force):
            result = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
        assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
        out, lse, _ = result
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device

    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, causal)
    lowp_out, lowp_lse = attention_ref(q, k, v, softmax_scale, causal, upcast=False)
    check_close("out", out, ref_out, lowp_out)
    check_close("lse", lse, ref_lse, lowp_lse)
    return forward_plan


def seqlen_id(pair):
    return f"sq{pair[0]}-sk{pair[1]}"


# ---------------------------------------------------------------- helper sanity


def test_poison_allocator_reaches_new_allocations():
    # Live tensors of assorted sizes leave free remainders in both allocator pools.
    live = [torch.randn(n, device="cuda") for n in (100, 5_000, 300_000, 3_000_000)]
    poison_allocator("cuda")
    sizes = (1, 100, 4_097, 250_000, 2_000_000, 20_000_000)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        fresh = [torch.empty(n, dtype=dtype, device="cuda") for n in sizes]
        assert all(torch.isnan(t).all() for t in fresh), dtype
        del fresh
        poison_allocator("cuda")
    del live


# ---------------------------------------------------------------- default matrix


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize(
    "b, sq, sk, h, hk",
    [(2, 113, 1023, 4, 4), (3, 1023, 113, 6, 2)],
    ids=["mha-sq<sk", "gqa-sq>sk"],
)
def test_head_dims(b, sq, sk, h, hk, head_dim, causal, dtype):
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(b, sq, sk, h, hk, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("seqlens", [(113, 1023), (1023, 113), (17, 17), (2, 5), (5, 2)], ids=seqlen_id)
def test_mma_sync_kernels_forced(seqlens, head_dim, causal, dtype):
    # Hopper GPUs run the warpgroup-MMA kernels; the mma.sync ones (what Ampere runs) must stay correct there too.
    require_kernel(head_dim, dtype, causal)
    sq, sk = seqlens
    run_and_check(*make_qkv(2, sq, sk, 6, 2, head_dim, dtype, layout="seq_major"), causal, force={"kernel": "mma_sync"})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", list(itertools.product(SEQLENS, SEQLENS)), ids=seqlen_id)
def test_seqlens(seqlens, head_dim, causal, dtype):
    sq, sk = seqlens
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(batch_for(sq, sk), sq, sk, 4, 4, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 4), (8, 2), (8, 1), (12, 3), (5, 1)])
@pytest.mark.parametrize("seqlens", [(1023, 1023), (2049, 113)], ids=seqlen_id)
def test_gqa(seqlens, h, hk, causal, dtype):
    sq, sk = seqlens
    require_kernel(64, dtype, causal)
    run_and_check(*make_qkv(2, sq, sk, h, hk, 64, dtype), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b", [1, 2, 3, 8])
def test_batch(b, causal):
    require_kernel(96, torch.bfloat16, causal)
    run_and_check(*make_qkv(b, 257, 300, 4, 2, 96, torch.bfloat16), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 333, 333, 4, 4), (3, 129, 400, 6, 2)], ids=["mha", "gqa"])
def test_strided_layouts(shape, layout, head_dim, causal, dtype):
    require_kernel(head_dim, dtype, causal)
    q, k, v = make_qkv(*shape, head_dim, dtype, layout)
    if layout != "contiguous":
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    run_and_check(q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", PARTIAL_HEAD_DIMS)
def test_head_dim_below_kernel_dim(head_dim, causal, dtype):
    # Multiples of 8 that the op takes directly but that fill only part of the kernel's head dim.
    # NaN right after head_dim catches loads of the unused part that are not zero-filled.
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, 200, 317, 4, 2, head_dim, dtype, "guard_bands"), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [1, 20, 40, 72, 100, 129, 250, 255])
def test_flash_attn_func_any_head_dim(head_dim, causal, dtype):
    # Non-multiples of 8 are padded by the wrapper; the default scale must use the real head_dim.
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, 150, 97, 4, 1, head_dim, dtype), causal, via="func")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_noncontiguous_last_dim(causal):
    # The raw op rejects these; the wrapper copies them.
    require_kernel(64, torch.float16, causal)
    q, k, v = (t[..., ::2] for t in make_qkv(2, 100, 120, 4, 4, 128, torch.float16))
    assert q.stride(-1) == 2
    run_and_check(q, k, v, causal, via="func")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_misaligned_views(causal):
    # A data pointer or strides that are not multiples of 8 elements: the wrapper must cope
    # (by copying) even though the kernel's 16-byte loads cannot use such views directly.
    require_kernel(64, torch.bfloat16, causal)
    b, s, h, d = 2, 200, 4, 64

    def view():
        buf = torch.randn(b * s * h * (d + 4) + 1, dtype=torch.bfloat16, device="cuda")
        return buf[1:].view(b, s, h, d + 4)[..., :d]  # offset 1 element, head stride d + 4

    run_and_check(view(), view(), view(), causal, via="func")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_returns_tensor(causal):
    require_kernel(64, torch.bfloat16, causal)
    q, k, v = make_qkv(2, 64, 64, 4, 4, 64, torch.bfloat16)
    out = flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    torch.testing.assert_close(out, fwd(q, k, v, 1 / 8, causal)[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.02, 1.0])
@pytest.mark.parametrize("q_gain", [1.0, 8.0], ids=["q1", "q8"])
@pytest.mark.parametrize("force", [{}, {"ws": True, "short_keys": False}], ids=["default", "ws"])
def test_softmax_scale_and_peaky_scores(force, q_gain, scale, causal, dtype):
    # Large logits make the running max move a lot between key blocks, stressing the rescaling. A bfloat16
    # reference cannot resolve logits of standard deviation much above 12 (the rule would pass zeros; conftest),
    # so in bfloat16 the gain stops there: q * 8 at scale 1 would give 90. On Hopper the default plans run the
    # causal case on the short-key tile; "ws" runs both on the warp-specialized kernel.
    require_kernel(128, dtype, causal)
    if dtype == torch.bfloat16:
        q_gain = min(q_gain, LOGIT_STD[dtype] / (scale * math.sqrt(128)))
    q, k, v = make_qkv(2, 511, 1023, 4, 4, 128, dtype)
    run_and_check(q * q_gain, k, v, causal, softmax_scale=scale, force=force)
    run_and_check(q * q_gain, k, v, causal, softmax_scale=scale, via="func", force=force)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [-0.3, -0.02, 0.0])
def test_flash_attn_func_negative_and_zero_scale(scale, causal):
    # A negative scale runs as (-q) with |scale|; zero gives uniform weights over the visible keys.
    require_kernel(64, torch.bfloat16, causal)
    q, k, v = make_qkv(2, 300, 257, 4, 2, 64, torch.bfloat16)
    run_and_check(q * 4, k, v, causal, softmax_scale=scale, via="func")


# ---------------------------------------------------------------- behaviour


def first_available(head_dims=(128, 64, 256, 32, 96, 160, 192, 224), causal=False):
    for d, dtype in itertools.product(head_dims, DTYPES):
        if flash_attn_cuda.kernel_available(d, dtype, causal):
            return d, dtype
    pytest.skip("no compiled kernel")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic(causal):
    d, dtype = first_available(causal=causal)
    q, k, v = make_qkv(2, 2049, 2049, 8, 2, d, dtype)
    scale = 1 / math.sqrt(d)
    poison_allocator("cuda")
    out1, lse1 = fwd(q, k, v, scale, causal)
    poison_allocator("cuda")
    out2, lse2 = fwd(q, k, v, scale, causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_default_stream(causal):
    d, dtype = first_available(causal=causal)
    src = make_qkv(2, 1023, 777, 4, 2, d, dtype)
    expected = fwd(*src, 0.1, causal)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # The inputs hold NaN until the side stream, after a long spin, copies the data in. A
        # kernel launched on another stream would run before the copy and return NaN.
        q, k, v = (torch.full_like(t, float("nan")) for t in src)
        poison_allocator("cuda")
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time on this stream only
        for dst, t in zip((q, k, v), src):
            dst.copy_(t)
        out, lse = fwd(q, k, v, 0.1, causal)
    side.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_capture(causal):
    # No host synchronisation, no allocation outside the allocator, launched on the current
    # stream: otherwise capture fails or the replay computes on stale data.
    d, dtype = first_available(causal=causal)
    q, k, v = make_qkv(2, 300, 500, 4, 4, d, dtype)
    scale = 1 / math.sqrt(d)
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        fwd(q, k, v, scale, causal)
    torch.cuda.current_stream().wait_stream(warmup)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fwd(q, k, v, scale, causal)
    fresh = make_qkv(2, 300, 500, 4, 4, d, dtype)
    for dst, src in zip((q, k, v), fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_ref(*fresh, scale, causal)
    lowp_out, lowp_lse = attention_ref(*fresh, scale, causal, upcast=False)
    check_close("out", out, ref_out, lowp_out)
    check_close("lse", lse, ref_lse, lowp_lse)


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_second_device():
    # The op must run on the inputs' device, not the current one.
    d, dtype = first_available()
    q, k, v = make_qkv(2, 200, 300, 4, 2, d, dtype, device="cuda:1")
    assert torch.cuda.current_device() == 0
    run_and_check(q, k, v, causal=True)


@pytest.mark.skipif(
    os.environ.get("FLASH_ATTN2_DISABLE_WGMMA") == "1", reason="the process-wide switch to the mma.sync kernels is set"
)
def test_plan_matches_the_gpu():
    # The path-forcing tests tell from a plan's kernel family which choices apply on this GPU: the Hopper kernels
    # run exactly on sm_90 with a build that holds sm_90a code (the default FLASH_ATTN2_CUDA_ARCHS; not a PTX-only
    # build), and the plan for the current GPU is then the one for its arch and SM count.
    try:
        from flash_attn_cuda._build_info import ARCHS
    except ImportError:  # a build from before _build_info.py: the default archs
        ARCHS = ("80", "90a")
    d, dtype = first_available()
    q, k, _ = make_qkv(2, 300, 1000, 8, 2, d, dtype)
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hopper = (major, minor) == (9, 0)
    # FLASH_ATTN2_MAX_SMEM below the Hopper kernels' tiles plans the whole run as on a smaller GPU: mma.sync.
    hopper_fits = MAX_SMEM is None or MAX_SMEM >= SMEM_227KIB
    for pass_ in ("fwd", "bwd"):
        p = device_plan(pass_, q, k, False)
        assert p.kernel == ("wgmma" if hopper and "90a" in ARCHS and hopper_fits else "mma_sync"), p
        if hopper and "90a" not in ARCHS:
            continue  # plan(arch=90) describes a build with the Hopper kernels
        assert p == plan(
            pass_,
            batch=2,
            seqlen_q=300,
            seqlen_k=1000,
            nheads=8,
            nheads_k=2,
            head_dim=d,
            arch=10 * major + minor,
            num_sms=sms,
            max_smem=MAX_SMEM,
            dtype=dtype,
        )


def test_mixed_devices_rejected():
    d, dtype = first_available()
    q, k, v = make_qkv(1, 16, 16, 2, 2, d, dtype)
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)cuda|device"):
        fwd(q, k.cpu(), v, 0.1, False)


_MISSING_KERNEL_SCRIPT = """
import sys, torch, flash_attn_cuda
from flash_attn_cuda._kernel_list import kernel_name
d, dtype, causal = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "causal"
hidden_fwd = not flash_attn_cuda.kernel_available(d, dtype, causal)
assert hidden_fwd == (sys.argv[4] == "fwd"), "kernel_available disagrees with the hidden list"
assert not flash_attn_cuda.kernel_available(d, dtype, causal, backward=True)
q, k, v = (torch.randn(1, 16, 2, d, dtype=dtype, device="cuda", requires_grad=True) for _ in range(3))
try:
    out = flash_attn_cuda.flash_attn_func(q, k, v, causal=causal)
    out.sum().backward()
except RuntimeError as error:
    print(str(error).splitlines()[0])
else:
    print("no error")
"""


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_missing_kernel_error(pass_):
    # A call whose kernel the build lacks raises an error that names it. The kernel is hidden from the registry
    # (FLASH_ATTN2_HIDE_KERNELS, read once per process) in a fresh process, so that a full build tests this too.
    import subprocess
    import sys

    from flash_attn_cuda._kernel_list import kernel_name
    from flash_attn_cuda._ops import _DTYPE_NAMES

    d, dtype = first_available(causal=True)
    name = kernel_name(pass_, d, _DTYPE_NAMES[dtype], True, False)
    env = {**os.environ, "FLASH_ATTN2_HIDE_KERNELS": f"unrelated_name,{name}"}
    args = [str(d), str(dtype).removeprefix("torch."), "causal", pass_]
    result = subprocess.run(
        [sys.executable, "-c", _MISSING_KERNEL_SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"was built without the kernel {name};" in result.stdout, result.stdout


_SMALLER_GPU_SCRIPT = """
import sys

import torch

import flash_attn_cuda
from flash_attn_cuda.plan import plan

path, head_dims = sys.argv[1], [int(d) for d in sys.argv[2].split(",")]
sys.path.insert(0, sys.argv[3])  # the tests' folder
from conftest import poison_allocator

torch.manual_seed(0)
sizes = {"batch": 2, "seqlen_q": 333, "seqlen_k": 333, "nheads": 4, "nheads_k": 4}
results = []
for d in head_dims:
    for causal in (False, True):
        dtype = next(t for t in (torch.bfloat16, torch.float16) if flash_attn_cuda.kernel_available(d, t, causal))
        q, k, v = (torch.randn(2, 333, 4, d, dtype=dtype, device="cuda") for _ in range(3))
        poison_allocator("cuda")
        out, lse, _ = flash_attn_cuda.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        p = plan("fwd", **sizes, head_dim=d, causal=causal, dtype=dtype)
        results.append((q, k, v, causal, out, lse, p.kernel))
torch.save([tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in r) for r in results], path)
"""


@pytest.mark.parametrize("max_smem", [166912, 101376], ids=["a100", "99kib"])
def test_smaller_gpu_emulation(max_smem, tmp_path):
    # FLASH_ATTN2_MAX_SMEM (read once per process, hence the fresh process) plans every call as on a GPU with that
    # much shared memory per block, and sets every kernel's shared-memory carveout to that GPU's share per SM, so
    # that as many CTAs share an SM as there. Every built head dim's forward, causal and not, runs the mma.sync
    # tiles of that GPU and meets the correctness rule.
    import subprocess
    import sys

    head_dims = [
        d
        for d in KERNEL_HEAD_DIMS
        if all(any(flash_attn_cuda.kernel_available(d, t, c) for t in DTYPES) for c in (False, True))
    ]
    if not head_dims:
        pytest.skip("no head dim with both its causal and non-causal kernels compiled")
    env = {**os.environ, "FLASH_ATTN2_MAX_SMEM": str(max_smem)}
    path = tmp_path / "results.pt"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _SMALLER_GPU_SCRIPT,
            str(path),
            ",".join(map(str, head_dims)),
            os.path.dirname(__file__),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_cuda.__file__))),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = torch.load(path)
    assert len(results) == 2 * len(head_dims)
    for q, k, v, causal, out, lse, kernel in results:
        assert kernel == "mma_sync", (q.shape, causal, kernel)
        q, k, v = (t.cuda() for t in (q, k, v))
        ref_out, ref_lse = attention_ref(q, k, v, None, causal)
        lowp_out, lowp_lse = attention_ref(q, k, v, None, causal, upcast=False)
        check_close("out", out.cuda(), ref_out, lowp_out)
        check_close("lse", lse.cuda(), ref_lse, lowp_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck(causal):
    # Schema and fake-tensor checks with inputs that need no grad, other head dims than test_bwd_gpu.py's
    # test_opcheck, which runs every check (autograd registration included) on inputs that require grad.
    d, dtype = first_available(causal=causal)
    q, k, v = make_qkv(2, 65, 33, 4, 2, d, dtype)
    torch.library.opcheck(fwd.default, (q, k, v, 0.125, causal), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- short-key Hopper tile
#
# On Hopper, head dim 128 with seqlen_k <= 1024 (causal) or <= 512 runs one-warpgroup 64x64 tiles, two CTAs per SM
# (the wgmma tile set's short-key tile). short_keys=True forces that tile at every length, False never, so both
# tiles are checked on both sides of the threshold (elsewhere only one of them runs; on other GPUs the plan has
# neither).


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("short_keys", [True, False], ids=["short-tile", "regular-tile"])
@pytest.mark.parametrize(
    "b, sq, sk, h, hk, layout",
    [
        (3, 113, 1023, 4, 4, "contiguous"),
        (2, 1023, 113, 6, 2, "heads_major"),
        (1, 2049, 2049, 2, 1, "guard_bands"),
        (2, 1, 4097, 8, 2, "seq_major"),
        (5, 17, 17, 3, 3, "packed"),
    ],
    ids=["sq113-sk1023", "sq1023-sk113-gqa", "sq2049", "decode-split", "sq17"],
)
def test_short_key_tile_forced(b, sq, sk, h, hk, layout, short_keys, dtype, causal):
    require_kernel(128, dtype, causal)
    run_and_check(*make_qkv(b, sq, sk, h, hk, 128, dtype, layout), causal, force={"short_keys": short_keys})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", [3, "auto"])
def test_short_key_tile_split_kv(splits, causal):
    # One query block of 4 heads: the heuristic splits 4097 keys too.
    require_kernel(128, torch.bfloat16, causal)
    force = {"short_keys": True, **num_splits_force(splits)}
    p = run_and_check(*make_qkv(1, 17, 4097, 4, 1, 128, torch.bfloat16), causal, via="func", force=force)
    assert p.num_splits > 1, p


# ---------------------------------------------------------------- warp-specialized Hopper forward
#
# On Hopper, dense calls of the plain kernels run the warp-specialized TMA kernel (ws=True, the plans' default
# there); ws=False forces the kernel whose warps all load and compute, which varlen, split-KV, packed GQA, the
# short-key tile, the variants and query sequences too short for every consumer warpgroup keep. Both, on sequences
# that end inside a tile, with seqlen_q above and below seqlen_k, GQA and MQA, and single sequences and heads, whose
# strides TMA does not take from the tensor. The warp-specialized kernel is persistent, one CTA per SM: the last
# two shapes have more units of its schedule than an H200 has SMs (132), so CTAs run several tiles, causal ones
# pairs of query blocks of an odd count, and, in the last, tiles whose rows see no key between others.


# (b, sq, sk, h, hk, layout), by id.
WS_FORWARD_SHAPES = {
    "sq257-sk1000": (2, 257, 1000, 4, 4, "contiguous"),
    "sq1000-sk257-gqa": (1, 1000, 257, 6, 2, "heads_major"),
    "sq191-mqa": (3, 191, 191, 3, 1, "guard_bands"),
    "one-head": (1, 2049, 2049, 1, 1, "packed"),
    "sq63-sk4097": (2, 63, 4097, 2, 2, "seq_major"),
    "sq200-sk5": (2, 200, 5, 4, 4, "contiguous"),
    "sq130-sk1-mqa": (1, 130, 1, 2, 1, "guard_bands"),
    "many-tiles-gqa": (4, 1300, 1500, 16, 4, "contiguous"),
    "many-tiles-sq1500-sk300": (3, 1500, 300, 12, 12, "seq_major"),
}


def ws_forward_shapes(*ids):
    return [pytest.param(*WS_FORWARD_SHAPES[i], id=i) for i in ids]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ws", [True, False], ids=["ws", "no-ws"])
@pytest.mark.parametrize("d", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("b, sq, sk, h, hk, layout", ws_forward_shapes(*WS_FORWARD_SHAPES))
def test_warp_specialized_forward(b, sq, sk, h, hk, layout, d, ws, dtype, causal):
    require_kernel(d, dtype, causal)
    # With ws, the short-key tiles are forced off too: head dim 128 would take the other kernel's at these key
    # lengths, and head dims 64 and 256 under a causal mask the warp-specialized kernel's own (the test below).
    force = {"ws": True, "short_keys": False} if ws else {"ws": False}
    run_and_check(*make_qkv(b, sq, sk, h, hk, d, dtype, layout), causal, force=force)


# The warp-specialized kernel's short-key tile under a causal mask (head dim 64: 128 rows on two consumer warpgroups,
# where the kernel's tile has 192 on three; head dim 256: 64-key blocks, where it has 80), forced at every length on
# most of the shapes above, and on 65 queries, one row in its second warpgroup.
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "b, sq, sk, h, hk, layout",
    [
        *ws_forward_shapes(*(i for i in WS_FORWARD_SHAPES if i not in ("sq63-sk4097", "sq130-sk1-mqa"))),
        pytest.param(2, 65, 3000, 2, 2, "seq_major", id="sq65-sk3000"),
    ],
)
def test_warp_specialized_forward_short_key_tile(b, sq, sk, h, hk, layout, dtype, d):
    require_kernel(d, dtype, True)
    run_and_check(*make_qkv(b, sq, sk, h, hk, d, dtype, layout), True, force={"ws": True, "short_keys": True})


# ---------------------------------------------------------------- split-KV and seqlen_q == 1 GQA packing
#
# num_splits=n (the op argument, or force_plan(num_splits=n)) forces n key splits on the dense forward (0: the
# heuristic decides). A split may get no key at all (n above the number of key blocks, causal rows before the
# diagonal): its partial must still combine exactly.

SPLITS = [2, 3, 7]
# (head dim, dtype): 128 B shared-memory rows at 64, 128 and 256; 64 B rows on the Hopper kernel at 96.
SPLIT_HEAD_DIMS = [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16), (96, torch.float16)]
SPLIT_HEAD_DIM_IDS = ["d64-fp16", "d128-bf16", "d256-bf16", "d96-fp16"]
SPLIT_SQ = [1, 17, 113]
SPLIT_SK = [1, 17, 1023, 4097]


def num_splits_force(splits):
    """force_plan keywords for a number of splits, or for the heuristic's ("auto")."""
    return {} if splits == "auto" else {"num_splits": splits}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, dtype", SPLIT_HEAD_DIMS, ids=SPLIT_HEAD_DIM_IDS)
@pytest.mark.parametrize("splits", SPLITS)
def test_split_kv_forced(splits, head_dim, dtype, causal):
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, 113, 1023, 6, 2, head_dim, dtype), causal, force={"num_splits": splits})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", [1, 3, "auto"])
@pytest.mark.parametrize("seqlens", [(1, 4097), (17, 1), (113, 17), (17, 1023)], ids=seqlen_id)
def test_split_kv_seqlens(seqlens, splits, causal):
    sq, sk = seqlens
    require_kernel(128, torch.bfloat16, causal)
    run_and_check(
        *make_qkv(2, sq, sk, 4, 1, 128, torch.bfloat16, "guard_bands"),
        causal,
        via="func",
        force=num_splits_force(splits),
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, dtype", SPLIT_HEAD_DIMS[1::2], ids=SPLIT_HEAD_DIM_IDS[1::2])
@pytest.mark.parametrize(
    "b, sq, sk, h, hk",
    [(2, 1, 4097, 32, 4), (1, 1, 16384, 8, 1), (1, 17, 4097, 4, 4), (1, 1023, 1024, 1, 1)],
    ids=["decode-gqa", "decode-mqa", "short-q", "one-head"],
)
def test_split_kv_auto_shapes(b, sq, sk, h, hk, head_dim, dtype, causal):
    # Shapes whose grid is small next to the SM count (at least 1024 keys, below which the heuristic never
    # splits), so the heuristic splits them on GPUs of 100 SMs or more.
    require_kernel(head_dim, dtype, causal)
    p = run_and_check(*make_qkv(b, sq, sk, h, hk, head_dim, dtype), causal)
    if torch.cuda.get_device_properties(0).multi_processor_count >= 100:
        assert p.num_splits > 1, p


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_kv_mma_sync_forced(head_dim, causal):
    require_kernel(head_dim, torch.bfloat16, causal)
    run_and_check(
        *make_qkv(2, 113, 1023, 6, 2, head_dim, torch.bfloat16, "seq_major"),
        causal,
        force={"kernel": "mma_sync", "num_splits": 3},
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_kv_deterministic_and_close_to_unsplit(causal):
    d, dtype = first_available(causal=causal)
    q, k, v = make_qkv(1, 17, 4097, 8, 2, d, dtype)
    scale = 1 / math.sqrt(d)
    check_forced_plans(q, k, causal, {"num_splits": 7}, passes=("fwd",))
    check_forced_plans(q, k, causal, {"num_splits": 1}, passes=("fwd",))
    out1, lse1 = fwd(q, k, v, scale, causal, num_splits=7)
    poison_allocator("cuda")
    out2, lse2 = fwd(q, k, v, scale, causal, num_splits=7)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    out_ref, lse_ref = fwd(q, k, v, scale, causal, num_splits=1)
    torch.testing.assert_close(lse1, lse_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(out1.float(), out_ref.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("num_splits, plan_override", [(129, ""), (-1, ""), (0, "key_blocks=two"), (0, "splits=2")])
def test_op_rejects_bad_plan_arguments(num_splits, plan_override):
    # The message names the argument (test_plan_cpu.py checks the plan op alike).
    d, dtype = first_available()
    name = "plan_override" if plan_override else "num_splits"
    with pytest.raises((RuntimeError, ValueError), match=name):
        fwd(*make_qkv(1, 1, 64, 2, 2, d, dtype), 0.1, False, num_splits=num_splits, plan_override=plan_override)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_kv_cuda_graph_capture(causal):
    # The split workspace comes from the caching allocator, so capture and replay work as unsplit.
    d, dtype = first_available(causal=causal)
    q, k, v = make_qkv(2, 5, 1500, 8, 2, d, dtype)
    check_forced_plans(q, k, causal, {"num_splits": 3}, passes=("fwd",))
    scale = 1 / math.sqrt(d)
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        fwd(q, k, v, scale, causal, num_splits=3)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fwd(q, k, v, scale, causal, num_splits=3)
    fresh = make_qkv(2, 5, 1500, 8, 2, d, dtype)
    for dst, src in zip((q, k, v), fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_ref(*fresh, scale, causal)
    lowp_out, lowp_lse = attention_ref(*fresh, scale, causal, upcast=False)
    check_close("out", out, ref_out, lowp_out)
    check_close("lse", lse, ref_lse, lowp_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["heads_major", "guard_bands"])
@pytest.mark.parametrize("h, hk", [(12, 3), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (128, torch.float16)], ids=["d64-bf16", "d128-fp16"])
def test_decode_gqa_packing(head_dim, dtype, h, hk, layout, causal):
    # seqlen_q == 1: the query heads of a group run as rows of one head (strided views of q, out and lse),
    # and causal is a no-op. Outputs must keep the user-facing shapes and be contiguous. Unsplit, then split
    # as the heuristic likes (3 batches x hk heads of one query block over 1025 keys leave most SMs idle).
    require_kernel(head_dim, dtype, causal)
    q, k, v = make_qkv(3, 1, 1025, h, hk, head_dim, dtype, layout)
    for force in ({"num_splits": 1}, {}):
        p = run_and_check(q, k, v, causal, force=force)
        assert p.gqa_pack == h // hk and not p.causal, p
    assert p.num_splits > 1, p


# ---------------------------------------------------------------- 64-bit offsets


def check_large(q, k, v, causal, out, lse, picks):
    """Compare the chosen (batch index, row slice) pieces with references on those pieces."""
    for bi, rows in picks:
        qs = q[bi : bi + 1, rows]
        ks, vs = k[bi : bi + 1], v[bi : bi + 1]
        # Taking the last rows of q keeps the bottom-right causal alignment.
        assert not causal or rows.stop is None
        ref_out, ref_lse = attention_ref(qs, ks, vs, None, causal)
        lowp_out, lowp_lse = attention_ref(qs, ks, vs, None, causal, upcast=False)
        check_close(f"out[{bi}, {rows}]", out[bi : bi + 1, rows], ref_out, lowp_out)
        check_close(f"lse[{bi}, :, {rows}]", lse[bi : bi + 1, :, rows], ref_lse, lowp_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_batch_offsets(causal):
    # Over 2**31 elements in q, k, v and out (about 5.4 GB each in 16 bit): element offsets of
    # the last batches overflow int32.
    d, dtype = first_available(causal=causal)
    h, s = 2048 // d, 1024
    b = 2**31 // (s * h * d) + 256
    q, k, v = make_qkv(b, s, s, h, h, d, dtype)
    assert q.numel() > 2**31
    poison_allocator("cuda", nbytes=q.nbytes + 4 * b * h * s + (64 << 20))
    out, lse = fwd(q, k, v, 1 / math.sqrt(d), causal)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_large(q, k, v, causal, out, lse, [(bi, slice(None)) for bi in (0, b // 2, b - 1)])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_row_offsets(causal):
    # One sequence whose q rows alone pass 2**31 elements: row offsets overflow int32.
    d, dtype = first_available(causal=causal)
    h, sk = 2048 // d, 256
    sq = 2**31 // (h * d) * 5 // 4
    q, k, v = make_qkv(1, sq, sk, h, h, d, dtype)
    assert q.numel() > 2**31
    poison_allocator("cuda", nbytes=q.nbytes + 4 * h * sq + (64 << 20))
    out, lse = fwd(q, k, v, 1 / math.sqrt(d), causal)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if causal:
        # Only the last sk rows see a key; all others must be written as out 0, lse +inf.
        assert (out[:, : sq - sk] == 0).all() and torch.isposinf(lse[:, :, : sq - sk]).all()
        picks = [(0, slice(-4096, None))]
    else:
        picks = [(0, slice(0, 1024)), (0, slice(sq // 2, sq // 2 + 1024)), (0, slice(-4096, None))]
    check_large(q, k, v, causal, out, lse, picks)


# ---------------------------------------------------------------- exhaustive


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS + PARTIAL_HEAD_DIMS)
@pytest.mark.parametrize("h, hk", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("seqlens", list(itertools.product(SEQLENS, SEQLENS)), ids=seqlen_id)
def test_exhaustive_op(seqlens, h, hk, head_dim, causal, dtype):
    sq, sk = seqlens
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(batch_for(sq, sk), sq, sk, h, hk, head_dim, dtype), causal)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seqlens", [(17, 1023), (1023, 17), (2049, 2049)], ids=seqlen_id)
def test_exhaustive_layouts(seqlens, layout, head_dim, causal, dtype):
    sq, sk = seqlens
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, sq, sk, 4, 2, head_dim, dtype, layout), causal)


@pytest.mark.exhaustive
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, dtype", SPLIT_HEAD_DIMS, ids=SPLIT_HEAD_DIM_IDS)
@pytest.mark.parametrize("splits", [1, 2, 3, 7, "auto"])
@pytest.mark.parametrize("h, hk", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("seqlens", list(itertools.product(SPLIT_SQ, SPLIT_SK)), ids=seqlen_id)
def test_exhaustive_split_kv(seqlens, h, hk, splits, head_dim, dtype, causal):
    sq, sk = seqlens
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, sq, sk, h, hk, head_dim, dtype), causal, force=num_splits_force(splits))


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", range(1, 257))
def test_exhaustive_flash_attn_func_head_dims(head_dim, causal, dtype):
    require_kernel(head_dim, dtype, causal)
    run_and_check(*make_qkv(2, 113, 77, 4, 2, head_dim, dtype), causal, via="func")
