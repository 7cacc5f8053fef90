"""Tests that need the built extension but no GPU: op registration, shape inference, TorchScript,
the pure-PyTorch reference, and argument validation (which runs before the device check). The launch plans
have their own CPU tests in test_plan_cpu.py."""

import itertools
import math
from pathlib import Path

import pytest
import torch
from conftest import DTYPES, KERNEL_HEAD_DIMS, rand
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn_cuda
from flash_attn_cuda import _kernel_list, flash_attn_func
from flash_attn_cuda.reference import attention_ref

fwd = torch.ops.flash_attn2.fwd
# Validation errors may be any of these; what matters is that the message names the argument.
BAD_INPUT = (RuntimeError, ValueError, TypeError)
INSTANTIATIONS = Path(__file__).resolve().parent.parent / "csrc" / "generated" / "instantiations"
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def qkv(b=2, sq=16, sk=16, h=4, hk=4, d=64, dtype=torch.float16, device="cpu", **dtypes):
    """Random q, k, v in the (batch, seqlen, heads, head_dim) layout; dtypes= overrides one."""
    shapes = {"q": (b, sq, h, d), "k": (b, sk, hk, d), "v": (b, sk, hk, d)}
    return [rand(*shapes[n], dtype=dtypes.get(n, dtype), device=device) for n in "qkv"]


def compiled_config(causal=False):
    """(head_dim, dtype) of some compiled kernel, so that a reduced build still reaches the
    device check (which may come after the kernel lookup)."""
    for name in sorted(torch.ops.flash_attn2.compiled_kernels()):
        _, hdim, dtype, mask = name.split("_")
        if mask == ("causal" if causal else "noncausal"):
            return int(hdim[len("hdim") :]), TORCH_DTYPES[dtype]
    pytest.skip("no compiled kernel")


# ---------------------------------------------------------------- registration


def test_fwd_schema():
    schema = str(fwd.default._schema)
    assert schema.startswith("flash_attn2::fwd(")
    for arg in ("Tensor q", "Tensor k", "Tensor v", "float softmax_scale", "bool causal", "bool deterministic=False"):
        assert arg in schema, schema
    assert "-> (Tensor out, Tensor softmax_lse)" in schema, schema


VARIANT_ARGS = (
    "int window_left=-1",
    "int window_right=-1",
    "float softcap=0.",
    "Tensor? alibi_slopes=None",
    "float dropout_p=0.",
    "Tensor? rng_state=None",
)


@pytest.mark.parametrize("op", ["fwd", "bwd", "varlen_fwd", "varlen_bwd"])
def test_schemas_take_the_variants(op):
    schema = str(getattr(torch.ops.flash_attn2, op).default._schema)
    for arg in VARIANT_ARGS:
        assert arg in schema, (arg, schema)
    # The backward gets the forward's variants, rng_state included: no argument of either is mutated.
    assert "!" not in schema, schema


def test_rng_state_op_draws_from_torch_generator():
    like = torch.empty(1)
    torch.manual_seed(1234)
    first = torch.ops.flash_attn2.rng_state(like)
    torch.manual_seed(1234)
    expected = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)
    assert first.dtype == torch.int64 and first.shape == (2,)
    assert torch.equal(first, expected)
    assert torch.Tag.nondeterministic_seeded in torch.ops.flash_attn2.rng_state.default.tags


def test_compiled_kernels_are_generated_files():
    # Every kernel the registry reports is one of the generated instantiations, reported once.
    names = torch.ops.flash_attn2.compiled_kernels()
    assert isinstance(names, list) and names and all(isinstance(n, str) for n in names)
    assert len(names) == len(set(names)), sorted(names)
    if not INSTANTIATIONS.is_dir():
        pytest.skip("no csrc/generated/instantiations next to the tests")
    # The mma.sync part of each kernel's translation units registers its launcher (csrc/generate.py, PARTS).
    files = {path.stem.removesuffix("_mma_sync") for path in INSTANTIATIONS.glob("*_mma_sync.cu")}
    assert set(names) <= files, sorted(set(names) - files)


def test_compiled_kernels_come_in_whole_groups():
    # setup.py compiles whole (head dim, dtype) groups (FLASH_ATTN2_HDIMS x FLASH_ATTN2_DTYPES): both passes and
    # every mask of each (non-causal, causal, and the variants kernel), so a kernel missing from the registry shows
    # as a hole in its group.
    masks = ("causal", "noncausal", "variants")
    names = set(torch.ops.flash_attn2.compiled_kernels())
    groups = set()
    for name in names:
        pass_, hdim, dtype, mask = name.split("_")
        assert pass_ in ("fwd", "bwd") and mask in masks and dtype in TORCH_DTYPES, name
        groups.add((int(hdim[len("hdim") :]), dtype))
    expected = {f"{p}_hdim{d}_{t}_{m}" for d, t in groups for p in ("fwd", "bwd") for m in masks}
    assert names == expected, sorted(expected ^ names)
    # The generated list names them the same way.
    assert {
        _kernel_list.kernel_name(p, d, t, c, variants)
        for d, t in groups
        for p in ("fwd", "bwd")
        for c, variants in ((False, False), (True, False), (True, True))
    } == expected


def test_kernel_available_on_a_known_build(monkeypatch):
    # A made-up build, so that the answers are known whatever this build holds: head dim 64 bf16 causal in both
    # passes, head dim 128 fp16 non-causal forward only. A head dim runs on the smallest kernel head dim that
    # holds it: 33..64 on 64, 97..128 on 128.
    names = frozenset({"fwd_hdim64_bf16_causal", "bwd_hdim64_bf16_causal", "fwd_hdim128_fp16_noncausal"})
    monkeypatch.setattr(flash_attn_cuda._ops, "compiled_kernels", lambda: names)
    bf16, fp16 = torch.bfloat16, torch.float16
    available = [
        (64, bf16, True, False),
        (33, bf16, True, False),
        (40, bf16, True, True),
        (64, bf16, True, True),
        (128, fp16, False, False),
        (97, fp16, False, False),
        (120, fp16, False, False),
    ]
    missing = [
        (32, bf16, True, False),
        (65, bf16, True, False),
        (64, fp16, True, False),
        (64, bf16, False, False),
        (128, fp16, False, True),
        (96, fp16, False, False),
        (129, fp16, False, False),
        (128, fp16, True, False),
        (64, torch.float32, True, False),
        (128, bf16, False, False),
    ]
    for head_dim, dtype, causal, backward in available:
        assert flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=backward), (head_dim, dtype, causal)
    for head_dim, dtype, causal, backward in missing:
        assert not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=backward), (
            head_dim,
            dtype,
            causal,
            backward,
        )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_available_on_this_build(dtype, causal):
    # Each compiled kernel head dim serves every head dim from just above the previous kernel head dim to its own;
    # a kernel head dim not compiled serves none.
    names = set(torch.ops.flash_attn2.compiled_kernels())
    suffix = f"{'bf16' if dtype == torch.bfloat16 else 'fp16'}_{'causal' if causal else 'noncausal'}"
    for lower, kernel_dim in zip([0, *KERNEL_HEAD_DIMS], KERNEL_HEAD_DIMS):
        built = f"fwd_hdim{kernel_dim}_{suffix}" in names and f"bwd_hdim{kernel_dim}_{suffix}" in names
        for head_dim in (lower + 1, (lower + kernel_dim) // 2, kernel_dim):
            assert flash_attn_cuda.kernel_available(head_dim, dtype, causal) is built, (head_dim, kernel_dim)
            assert flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True) is built, head_dim


# ---------------------------------------------------------------- shape inference

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (2, 128, 128, 8, 8, 64),  # MHA
    (3, 17, 113, 8, 2, 128),  # GQA, seqlen_q < seqlen_k
    (1, 1023, 5, 6, 1, 256),  # MQA, seqlen_q > seqlen_k
]


def check_fake_outputs(out, lse, q):
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_fake_tensor_mode(shape, dtype, causal):
    b, sq, sk, h, hk, d = shape
    with FakeTensorMode():
        q, k, v = qkv(b, sq, sk, h, hk, d, dtype, device="cuda")
        out, lse = fwd(q, k, v, 1.0 / math.sqrt(d), causal)
    check_fake_outputs(out, lse, q)


@pytest.mark.parametrize("shape", SHAPES)
def test_meta_tensors(shape):
    b, sq, sk, h, hk, d = shape
    q, k, v = qkv(b, sq, sk, h, hk, d, torch.bfloat16, device="meta")
    out, lse = fwd(q, k, v, 0.5, True)
    check_fake_outputs(out, lse, q)


@pytest.mark.parametrize("head_dim", [20, 100, 250])
def test_fake_tensor_mode_flash_attn_func(head_dim):
    # Exercises the Python wrapper's padding of head dims that are not a multiple of 8.
    with FakeTensorMode():
        q, k, v = qkv(2, 33, 65, 8, 4, head_dim, torch.float16, device="cuda")
        out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_fake_outputs(out, lse, q)
    assert probs is None


# ---------------------------------------------------------------- TorchScript


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_torchscript_compiles():
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
        return torch.ops.flash_attn2.fwd(q, k, v, scale, causal)

    scripted = torch.jit.script(attend)
    assert "flash_attn2::fwd" in str(scripted.graph)


def test_bwd_schema():
    schema = str(torch.ops.flash_attn2.bwd.default._schema)
    for arg in (
        "Tensor dout",
        "Tensor q",
        "Tensor k",
        "Tensor v",
        "Tensor out",
        "Tensor softmax_lse",
        "float softmax_scale",
        "bool causal",
        "bool deterministic=False",
    ):
        assert arg in schema, (arg, schema)
    assert "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dlearnable_sink)" in schema


def test_bwd_fake_shapes_gqa():
    with FakeTensorMode():
        q, k, v = qkv(b=2, sq=33, sk=17, h=6, hk=2, d=64)
        out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, True)
        dq, dk, dv, dsink = torch.ops.flash_attn2.bwd(torch.empty_like(out), q, k, v, out, lse, 0.125, True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert dq.dtype == q.dtype and dk.dtype == k.dtype
        # Without a learnable sink its gradient is an empty placeholder.
        assert dsink.shape == (0,) and dsink.dtype == torch.float32
        sink = torch.empty(6, dtype=torch.float32)
        out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, True, learnable_sink=sink)
        *_, dsink = torch.ops.flash_attn2.bwd(
            torch.empty_like(out), q, k, v, out, lse, 0.125, True, learnable_sink=sink
        )
        assert dsink.shape == (6,) and dsink.dtype == torch.float32


def test_bwd_fake_gradients_are_contiguous():
    # The op returns contiguous gradients for strided inputs; the fakes must say the same, or compiled
    # training on (batch, heads, seqlen, head_dim)-transposed inputs fails its stride checks.
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 33, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
        out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, False)
        grads = torch.ops.flash_attn2.bwd(torch.empty_like(out), q, k, v, out, lse, 0.125, False)[:3]
        assert all(g.is_contiguous() and g.shape == q.shape for g in grads)
        qv, kv, vv = (torch.empty(4, 50, 64, dtype=torch.float16).transpose(0, 1) for _ in range(3))
        cu = torch.tensor([0, 20, 50], dtype=torch.int32)
        out, lse = torch.ops.flash_attn2.varlen_fwd(qv, kv, vv, cu, cu, 30, 30, 0.125, False)
        grads = torch.ops.flash_attn2.varlen_bwd(
            torch.empty_like(out), qv, kv, vv, out, lse, cu, cu, 30, 30, 0.125, False
        )[:3]
        assert all(g.is_contiguous() and g.shape == qv.shape for g in grads)


def test_autograd_through_fake_op():
    # Autograd is registered on the op: meta inputs run the fake forward and backward.
    q, k, v = (t.to("meta").requires_grad_() for t in qkv(h=4, hk=2))
    out = flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def bwd_args(**overrides):
    q, k, v = qkv()
    args = dict(
        dout=torch.randn_like(q),
        q=q,
        k=k,
        v=v,
        out=torch.randn_like(q),
        softmax_lse=torch.randn(q.shape[0], q.shape[2], q.shape[1]),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "name, bad",
    [
        ("dout", lambda a: a["dout"][:, :-1]),
        ("dout", lambda a: a["dout"].to(torch.bfloat16)),
        ("out", lambda a: a["out"][:, :, :-1]),
        ("softmax_lse", lambda a: a["softmax_lse"].half()),
        ("softmax_lse", lambda a: a["softmax_lse"][:, :, :-1]),
        ("dout", lambda a: torch.randn(2, 16, 4, 128, dtype=torch.float16)[..., ::2]),
    ],
)
def test_bwd_rejects_bad_gradient_inputs(name, bad):
    args = bwd_args()
    args[name] = bad(args)
    with pytest.raises(BAD_INPUT, match=name):
        torch.ops.flash_attn2.bwd(
            args["dout"], args["q"], args["k"], args["v"], args["out"], args["softmax_lse"], 0.125, False
        )


def test_bwd_rejects_cpu_tensors():
    args = bwd_args()
    with pytest.raises(BAD_INPUT, match="CUDA"):
        torch.ops.flash_attn2.bwd(*args.values(), 0.125, False)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("head_dim", [64, 40])
def test_torch_compile_fullgraph(head_dim):
    # Dynamo must trace flash_attn_func (padding, the op, slicing) into one graph. Meta inputs let
    # the compiled graph run through the fake implementation without a GPU.
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    attend = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), backend=capture, fullgraph=True)
    q, k, v = (t.to("meta") for t in qkv(b=2, sq=33, sk=17, h=4, hk=2, d=head_dim))
    out = attend(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes]
    assert torch.ops.flash_attn2.fwd in targets or torch.ops.flash_attn2.fwd.default in targets


# ---------------------------------------------------------------- reference


def naive_attention(q, k, v, scale, causal):
    """One query row at a time with Python scalars: slow, but each step is visible."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=q.dtype)
    lse = torch.empty(b, h, sq, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            kv_head = hi // (h // hk)
            for i in range(sq):
                last = i + sk - sq if causal else sk - 1  # last visible key index
                if last < 0:
                    lse[bi, hi, i] = math.inf
                    continue
                scores = [scale * float(q[bi, i, hi] @ k[bi, j, kv_head]) for j in range(last + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[bi, hi, i] = top + math.log(total)
                for j, w in enumerate(weights):
                    out[bi, i, hi] += (w / total) * v[bi, j, kv_head]
    return out, lse


REF_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (2, 5, 5, 2, 2, 8),
    (1, 3, 7, 4, 2, 16),  # seqlen_q < seqlen_k, GQA
    (2, 7, 3, 3, 1, 8),  # seqlen_q > seqlen_k: causal leaves the first 4 rows empty, MQA
    (1, 1, 9, 2, 1, 4),
    (1, 6, 1, 2, 2, 4),
]


@pytest.mark.parametrize("shape", REF_CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_reference_matches_naive(shape, causal, scale):
    b, sq, sk, h, hk, d = shape
    torch.manual_seed(0)
    q, k, v = qkv(b, sq, sk, h, hk, d, torch.float64)
    expect_out, expect_lse = naive_attention(q, k, v, scale or 1 / math.sqrt(d), causal)

    # upcast=False computes in the input dtype, here float64; lse is float32 by contract.
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal, upcast=False)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert lse.shape == (b, h, sq)
    torch.testing.assert_close(out, expect_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expect_lse.float(), rtol=1e-6, atol=1e-6)

    out32, lse32 = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32, expect_out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse32, expect_lse.float(), rtol=1e-5, atol=1e-5)


def test_reference_empty_rows():
    # seqlen_q - seqlen_k = 4 rows see no key under the bottom-right causal mask.
    q, k, v = qkv(1, 7, 3, 2, 2, 8, torch.float32)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(out[:, :4] == 0)
    assert torch.all(torch.isposinf(lse[:, :, :4]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 4:]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_reference_no_keys(causal):
    # seqlen_k == 0: every row sees no key, with the same convention as the causal case.
    q, k, v = qkv(2, 5, 0, 2, 2, 8, torch.float32)
    out, lse = attention_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and torch.all(out == 0)
    assert lse.shape == (2, 2, 5) and torch.all(torch.isposinf(lse))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_lowp(dtype):
    q, k, v = qkv(1, 9, 12, 4, 2, 16, dtype)
    out, lse = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out32, lse32 = attention_ref(q, k, v, causal=True)
    assert out32.dtype == torch.float32
    # Same math, lower precision: close but not identical.
    torch.testing.assert_close(out.float(), out32, rtol=0, atol=0.05)
    torch.testing.assert_close(lse, lse32, rtol=0, atol=0.05)


# ---------------------------------------------------------------- input validation
# All shape/dtype/stride checks run before the device check, so CPU tensors reach them.


@pytest.mark.parametrize("causal", [False, True])
def test_op_rejects_cpu_tensors(causal):
    d, dtype = compiled_config(causal)
    q, k, v = qkv(d=d, dtype=dtype)
    with pytest.raises(BAD_INPUT, match="CUDA"):
        fwd(q, k, v, 0.125, causal)


def test_flash_attn_func_rejects_cpu_tensors():
    d, dtype = compiled_config()
    q, k, v = qkv(d=d, dtype=dtype)
    with pytest.raises(BAD_INPUT, match="CUDA"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("call", ["op", "func"])
def test_rejects_float32(call):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(BAD_INPUT, match=r"\bq\b"):
        fwd(q, k, v, 0.125, False) if call == "op" else flash_attn_func(q, k, v)


@pytest.mark.parametrize("call", ["op", "func"])
@pytest.mark.parametrize("odd", ["k", "v"])
def test_rejects_mixed_dtypes(call, odd):
    q, k, v = qkv(**{odd: torch.bfloat16})
    with pytest.raises(BAD_INPUT, match=rf"\b{odd}\b"):
        fwd(q, k, v, 0.125, False) if call == "op" else flash_attn_func(q, k, v)


def test_flash_attn_func_rejects_head_dim_over_256():
    q, k, v = qkv(d=264)
    with pytest.raises(BAD_INPUT, match="head_dim"):
        flash_attn_func(q, k, v)
    q, k, v = qkv(d=257)  # would pad to 264
    with pytest.raises(BAD_INPUT, match="head_dim"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("head_dim", [264, 60, 4])
def test_op_rejects_bad_head_dim(head_dim):
    # Over 256, or not a multiple of 8 (the wrapper pads; the raw op does not).
    q, k, v = qkv(d=head_dim)
    with pytest.raises(BAD_INPUT, match="head_dim"):
        fwd(q, k, v, 0.125, False)


def test_op_rejects_head_dim_mismatch():
    q, _, _ = qkv(d=64)
    _, k, v = qkv(d=128)
    with pytest.raises(BAD_INPUT, match="head_dim"):
        fwd(q, k, v, 0.125, False)


@pytest.mark.parametrize("call", ["op", "func"])
def test_rejects_batch_mismatch(call):
    q, _, _ = qkv(b=2)
    _, k, v = qkv(b=3)
    with pytest.raises(BAD_INPUT, match=r"\bk\b|batch"):
        fwd(q, k, v, 0.125, False) if call == "op" else flash_attn_func(q, k, v)


@pytest.mark.parametrize("call", ["op", "func"])
def test_rejects_k_v_head_mismatch(call):
    q, k, _ = qkv(h=4, hk=4)
    _, _, v = qkv(h=4, hk=2)
    with pytest.raises(BAD_INPUT, match=r"\bv\b"):
        fwd(q, k, v, 0.125, False) if call == "op" else flash_attn_func(q, k, v)


def test_rejects_k_v_seqlen_mismatch():
    q, k, _ = qkv(sk=16)
    _, _, v = qkv(sk=17)
    with pytest.raises(BAD_INPUT, match=r"\bv\b"):
        fwd(q, k, v, 0.125, False)


@pytest.mark.parametrize("call", ["op", "func"])
def test_rejects_nheads_not_multiple_of_nheads_k(call):
    q, k, v = qkv(h=6, hk=4)
    with pytest.raises(BAD_INPUT, match="nheads_k"):
        fwd(q, k, v, 0.125, False) if call == "op" else flash_attn_func(q, k, v)


@pytest.mark.parametrize("scale", [-0.125, float("nan"), float("inf"), 1e39])
def test_op_rejects_bad_softmax_scale(scale):
    # The op needs a finite, non-negative scale; flash_attn_func turns a negative one into -q.
    q, k, v = qkv()
    with pytest.raises(BAD_INPUT, match="softmax_scale"):
        fwd(q, k, v, scale, False)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_op_rejects_noncontiguous_last_dim(name):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = torch.randn(*tensors[name].shape[:-1], 128, dtype=torch.float16)[..., ::2]
    assert tensors[name].stride(-1) == 2
    with pytest.raises(BAD_INPUT, match=rf"\b{name}\b"):
        fwd(tensors["q"], tensors["k"], tensors["v"], 0.125, False)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_rejects_wrong_ndim(name, ndim):
    tensors = dict(zip("qkv", qkv()))
    t = tensors[name]
    tensors[name] = t.flatten(0, 1) if ndim == 3 else t.unsqueeze(0)
    with pytest.raises(BAD_INPUT, match=rf"\b{name}\b"):
        fwd(tensors["q"], tensors["k"], tensors["v"], 0.125, False)


@pytest.mark.parametrize(
    "option, value",
    [
        ("dropout_p", 0.1),
        ("window_size", (128, 0)),
        ("window_size", (-1, 64)),
        ("softcap", 30.0),
        ("alibi_slopes", "per_head"),
    ],
)
def test_flash_attn_func_variant_options_reach_the_device_check(option, value):
    # Every variant is supported: on CPU tensors a call with one passes the argument checks and fails on the
    # device check, like a plain call.
    q, k, v = qkv()
    if value == "per_head":
        value = torch.rand(q.shape[2])
    with pytest.raises(BAD_INPUT, match="CUDA"):
        flash_attn_func(q, k, v, **{option: value})


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("dropout_p", 1.0, "dropout_p"),
        ("dropout_p", -0.1, "dropout_p"),
        ("window_size", (-2, 0), "window_size"),
        ("window_size", (1, 2, 3), "window_size"),
        ("softcap", -1.0, "softcap"),
        ("softcap", float("nan"), "softcap"),
        ("alibi_slopes", "fp16", "alibi_slopes"),
        ("alibi_slopes", "wrong_shape", "alibi_slopes"),
    ],
)
def test_flash_attn_func_rejects_bad_variant_values(option, value, match):
    q, k, v = qkv()
    if value == "fp16":
        value = torch.rand(q.shape[2]).half()
    elif value == "wrong_shape":
        value = torch.rand(q.shape[2] + 1)
    with pytest.raises(BAD_INPUT, match=match):
        flash_attn_func(q, k, v, **{option: value})


def test_op_requires_rng_state_with_dropout():
    q, k, v = qkv()
    with pytest.raises(BAD_INPUT, match="rng_state"):
        fwd(q, k, v, 0.125, False, False, 0, "", -1, -1, 0.0, None, 0.1, None)
    with pytest.raises(BAD_INPUT, match="rng_state"):
        fwd(q, k, v, 0.125, False, False, 0, "", -1, -1, 0.0, None, 0.1, torch.zeros(3, dtype=torch.int64))


def test_flash_attn_func_accepts_default_options():
    # The variants' defaults: on CPU tensors the call fails on the device check.
    d, dtype = compiled_config()
    q, k, v = qkv(d=d, dtype=dtype)
    with pytest.raises(BAD_INPUT, match="CUDA"):
        flash_attn_func(
            q,
            k,
            v,
            dropout_p=0.0,
            window_size=(-1, -1),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=True,
        )


# ---------------------------------------------------------------- varlen and packed layouts


def varlen_args(lens=(3, 0, 5), h=4, hk=2, d=64, dtype=torch.float16, device="cpu"):
    total = sum(lens)
    q = torch.randn(total, h, d, dtype=dtype, device=device)
    k, v = (torch.randn(total, hk, d, dtype=dtype, device=device) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    return q, k, v, cu, cu.clone(), max(lens), max(lens)


def test_varlen_schemas():
    fwd_schema = str(torch.ops.flash_attn2.varlen_fwd.default._schema)
    for arg in (
        "Tensor q",
        "Tensor k",
        "Tensor v",
        "Tensor cu_seqlens_q",
        "Tensor cu_seqlens_k",
        "int max_seqlen_q",
        "int max_seqlen_k",
        "float softmax_scale",
        "bool causal",
        "bool deterministic=False",
    ):
        assert arg in fwd_schema, (arg, fwd_schema)
    assert "-> (Tensor out, Tensor softmax_lse)" in fwd_schema
    bwd_schema = str(torch.ops.flash_attn2.varlen_bwd.default._schema)
    for arg in ("Tensor dout", "Tensor out", "Tensor softmax_lse", "Tensor cu_seqlens_q", "int max_seqlen_k"):
        assert arg in bwd_schema, (arg, bwd_schema)
    assert "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dlearnable_sink)" in bwd_schema


def test_varlen_fake_shapes():
    with FakeTensorMode():
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_args(h=6, hk=2)
        out, lse = torch.ops.flash_attn2.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.125, True)
        assert out.shape == q.shape and lse.shape == (6, q.shape[0]) and lse.dtype == torch.float32
        dq, dk, dv, dsink = torch.ops.flash_attn2.varlen_bwd(
            torch.empty_like(out), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.125, True
        )
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dsink.shape == (0,)


def test_varlen_autograd_through_fake_op():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    q, k, v = (t.to("meta").requires_grad_() for t in (q, k, v))
    out = flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu_q.to("meta"), cu_k.to("meta"), max_q, max_k, causal=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize(
    "name, bad, error",
    [
        # The stable ABI carries std::invalid_argument (ValueError) but no TypeError: a wrong dtype is a ValueError.
        ("cu_seqlens_q", lambda a: a[3].long(), ValueError),
        ("cu_seqlens_k", lambda a: a[4].float(), ValueError),
        ("cu_seqlens_k", lambda a: a[4][:-1], ValueError),
        ("cu_seqlens_q", lambda a: a[3].view(1, -1), ValueError),
        ("cu_seqlens_q", lambda a: a[3].repeat_interleave(2)[::2], ValueError),
    ],
)
def test_varlen_rejects_bad_cu_seqlens(name, bad, error):
    args = list(varlen_args())
    args[3 if name == "cu_seqlens_q" else 4] = bad(args)
    with pytest.raises(error, match=name):
        torch.ops.flash_attn2.varlen_fwd(*args, 0.125, False)


@pytest.mark.parametrize("index, name", [(5, "max_seqlen_q"), (6, "max_seqlen_k")])
def test_varlen_rejects_bad_max_seqlen(index, name):
    args = list(varlen_args())
    args[index] = -1
    with pytest.raises(ValueError, match=name):
        torch.ops.flash_attn2.varlen_fwd(*args, 0.125, False)


def test_varlen_rejects_dense_layout():
    q, k, v, *rest = varlen_args()
    with pytest.raises(ValueError, match=r"q must be a 3-D tensor"):
        flash_attn_cuda.flash_attn_varlen_func(q[None], k, v, *rest)
    with pytest.raises(ValueError, match=r"q must have shape \(total_q"):
        torch.ops.flash_attn2.varlen_fwd(q[None], k, v, *rest, 0.125, False)


def test_varlen_rejects_cpu_tensors():
    with pytest.raises(BAD_INPUT, match="CUDA"):
        torch.ops.flash_attn2.varlen_fwd(*varlen_args(), 0.125, False)


def test_varlen_block_table_needs_paged_caches():
    # With a block_table, k and v are caches of pages (4-D); the 3-D varlen k is refused by name.
    with pytest.raises(ValueError, match="k must be a 4-D tensor"):
        flash_attn_cuda.flash_attn_varlen_func(*varlen_args(), block_table=torch.zeros(1, 1, dtype=torch.int32))


def _permuted(b, s, h, d):
    # (b, s, h, d) viewed from a (b, h, d, s) buffer (a transposed key cache): the sequence is innermost, a
    # layout that F.pad keeps.
    return torch.randn(b, h, d, s, dtype=torch.float16).permute(0, 3, 1, 2)


def _misaligned(b, s, h, d):
    # Contiguous, but starting 2 bytes into its storage.
    return torch.randn(b * s * h * d + 1, dtype=torch.float16)[1:].view(b, s, h, d)


@pytest.mark.parametrize(
    "make",
    [_permuted, _misaligned, lambda *shape: torch.randn(*shape, dtype=torch.float16)],
    ids=["permuted", "misaligned", "contiguous"],
)
@pytest.mark.parametrize("head_dim", [64, 100])
def test_op_gets_kernel_ready_inputs(monkeypatch, make, head_dim):
    # Whatever the layout handed to flash_attn_func, the op sees a unit last stride, other strides that are
    # multiples of 8 elements, and a 16-byte aligned start (the kernels move 16-byte chunks).
    seen = []

    def fake_op(q, k, v, *rest):
        seen.extend((q, k, v))
        return torch.empty_like(q), torch.empty(1)

    monkeypatch.setattr(flash_attn_cuda._ops, "_FWD", fake_op)
    q, k, v = (make(2, 9, 4, head_dim) for _ in range(3))
    out = flash_attn_func(q, k, v)
    assert out.shape == q.shape
    for t in seen:
        assert t.stride(-1) == 1 and t.shape[-1] % 8 == 0
        assert all(stride % 8 == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)
        assert t.data_ptr() % 16 == 0


@pytest.mark.parametrize(
    "func, packed_shape, dim",
    [
        ("flash_attn_qkvpacked_func", (2, 9, 3, 4, 64), 2),
        ("flash_attn_varlen_qkvpacked_func", (9, 3, 4, 64), 1),
    ],
)
def test_packed_views_reach_the_op_without_copies(monkeypatch, func, packed_shape, dim):
    packed = torch.randn(packed_shape, dtype=torch.float16)
    seen = {}

    def fake_op(q, k, v, *rest):
        seen.update(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr())
        return torch.empty_like(q), torch.empty(1)

    op = "varlen_fwd" if "varlen" in func else "fwd"
    monkeypatch.setattr(flash_attn_cuda._ops, "_VARLEN_FWD" if op == "varlen_fwd" else "_FWD", fake_op)
    args = (torch.tensor([0, 9], dtype=torch.int32), 9) if "varlen" in func else ()
    getattr(flash_attn_cuda, func)(packed, *args)
    step = packed.stride(dim) * packed.element_size()
    assert seen == {"q": packed.data_ptr(), "k": packed.data_ptr() + step, "v": packed.data_ptr() + 2 * step}


def test_padding_round_trip():
    batch, seqlen = 3, 7
    hidden = torch.randn(batch, seqlen, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    unpadded, indices, cu_seqlens, max_seqlen, used = flash_attn_cuda.unpad_input(hidden, mask)
    assert unpadded.shape == (10, 4, 8)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 10, 10]
    assert max_seqlen == 7 and used.tolist() == [3, 7, 0]
    padded = flash_attn_cuda.pad_input(unpadded, indices, batch, seqlen)
    assert torch.equal(padded, hidden * mask[..., None, None])


def test_unpad_input_unused_mask():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    unpadded, _, cu_seqlens, max_seqlen, used = flash_attn_cuda.unpad_input(hidden, mask, unused)
    assert cu_seqlens.tolist() == [0, 3, 4] and max_seqlen == 3 and used.tolist() == [2, 1]
    assert torch.equal(unpadded, hidden[[0, 0, 0, 1], [0, 1, 2, 0]])


@pytest.mark.parametrize("python_autograd", [False, True], ids=["default", "FLASH_ATTN2_PYTHON_AUTOGRAD=1"])
def test_autograd_home(python_autograd):
    # C++ autograd where the build has a library for the running torch minor version, Python elsewhere or when
    # asked; either way the meta (fake) forward and backward run through it, dense and varlen.
    import os
    import subprocess
    import sys

    script = (
        "import torch, flash_attn_cuda\n"
        "from flash_attn_cuda import _ops\n"
        "print(_ops.AUTOGRAD)\n"
        "q, k, v = (torch.empty(2, 9, 4, 64, dtype=torch.float16, device='meta').requires_grad_() for _ in range(3))\n"
        "out = flash_attn_cuda.flash_attn_func(q, k, v, causal=True)\n"
        "assert all(g.shape == q.shape for g in torch.autograd.grad(out.sum(), (q, k, v)))\n"
        "cu = torch.tensor([0, 4, 9], dtype=torch.int32, device='meta')\n"
        "q, k, v = (torch.empty(9, 4, 64, dtype=torch.float16, device='meta').requires_grad_() for _ in range(3))\n"
        "out = flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)\n"
        "assert all(g.shape == q.shape for g in torch.autograd.grad(out.sum(), (q, k, v)))\n"
        "sink = torch.empty(4, dtype=torch.float32, device='meta').requires_grad_()\n"
        "out = flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, learnable_sink=sink)\n"
        "dq, dsink = torch.autograd.grad(out.sum(), (q, sink))\n"
        "assert dq.shape == q.shape and dsink.shape == sink.shape\n"
    )
    env = dict(os.environ)
    env.pop("FLASH_ATTN2_PYTHON_AUTOGRAD", None)
    if python_autograd:
        env["FLASH_ATTN2_PYTHON_AUTOGRAD"] = "1"
    cwd = os.path.dirname(os.path.dirname(flash_attn_cuda.__file__))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    import importlib.util

    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    built = importlib.util.find_spec(f"flash_attn_cuda._autograd_torch{minor.replace('.', '_')}") is not None
    expected = f"C++ (torch {minor})" if built and not python_autograd else "Python"
    assert result.stdout.strip() == expected
