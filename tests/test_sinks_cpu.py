"""CPU tests of learnable attention sinks on the Python side: the op table gives every attention op the sink as its
last argument and the backward ops its gradient; the public functions check learnable_sink (and its alias s_aux)
before any op runs, convert it to what the ops take, and hand it on in the right place.

The public functions are exercised with the ops replaced by recorders, so no GPU is needed. The tests on meta
tensors run the registered ops' fake implementations and autograd.
"""

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from flash_attn_cuda import interface

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"


def load_op_table():
    """csrc/op_table.py, read directly (it imports nothing of the package)."""
    path = CSRC / "op_table.py"
    if not path.is_file():
        pytest.skip("no csrc/ next to the tests")
    spec = importlib.util.spec_from_file_location("flash_attn_op_table_for_sinks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the op table

SINK_OPS = ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache", "varlen_fwd_paged")


@pytest.mark.parametrize("name", SINK_OPS)
def test_ops_take_the_sink_last(name):
    ops = {op.name: op for op in load_op_table().OPS}
    last = ops[name].flat_args()[-1]
    assert (last.name, last.type, last.default) == ("learnable_sink", "Tensor?", "None"), (name, last)


@pytest.mark.parametrize("name", ["bwd", "varlen_bwd"])
def test_backward_ops_return_the_sink_gradient(name):
    ops = {op.name: op for op in load_op_table().OPS}
    assert [r.name for r in ops[name].returns] == ["dq", "dk", "dv", "dlearnable_sink"]
    assert all(r.type == "Tensor" for r in ops[name].returns)


def test_forward_ops_pair_the_sink_with_its_gradient():
    # Autograd pairs each output d<name> of the backward with the forward argument <name>; the sink's gradient
    # must find its argument, and the backward must get the sink from the forward by that name.
    ops = {op.name: op for op in load_op_table().OPS}
    for fwd_name in ("fwd", "varlen_fwd"):
        fwd = ops[fwd_name]
        bwd = ops[fwd.backward]
        fwd_args = [a.name for a in fwd.flat_args()]
        assert "learnable_sink" in [a.name for a in bwd.flat_args()], fwd_name
        for r in bwd.returns:
            assert r.name.startswith("d") and r.name[1:] in fwd_args, (fwd_name, r.name)


def test_public_variants_follow_the_table():
    # interface.Variants is passed as the trailing arguments of fwd, bwd, varlen_fwd and varlen_bwd: its fields
    # must be the variants group, in order, the sink last.
    table = load_op_table()
    assert interface.Variants._fields == tuple(a.name for a in table.VARIANTS.args)
    assert interface.Variants._fields[-1] == "learnable_sink"
    ops = {op.name: op for op in table.OPS}
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"):
        names = tuple(a.name for a in ops[name].flat_args())
        assert names[-len(interface.Variants._fields) :] == interface.Variants._fields, name


# ---------------------------------------------------------------- the public functions, with recorded ops


class Recorder:
    """Stands in for the op module (fwd, varlen_fwd, varlen_fwd_paged, rng_state) and for torch.ops.flash_attn2's
    fwd_kvcache, recording every call; the attention calls return zeros of the right shapes."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _outputs(q):
        lse = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
        return torch.zeros_like(q), torch.zeros(lse, dtype=torch.float32, device=q.device)

    def rng_state(self, like):
        self.calls.append(("rng_state", (like,), {}))
        return torch.zeros(2, dtype=torch.int64, device=like.device)

    def fwd(self, *args, **kwargs):
        self.calls.append(("fwd", args, kwargs))
        return self._outputs(args[0])

    def varlen_fwd(self, *args, **kwargs):
        self.calls.append(("varlen_fwd", args, kwargs))
        return self._outputs(args[0])

    def varlen_fwd_paged(self, *args, **kwargs):
        self.calls.append(("varlen_fwd_paged", args, kwargs))
        return self._outputs(args[0])

    def op(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self._outputs(args[0])

        return call

    def only(self, name):
        """The one recorded call of ``name``: (args, kwargs)."""
        found = [(args, kwargs) for call, args, kwargs in self.calls if call == name]
        assert len(found) == 1, [c[0] for c in self.calls]
        return found[0]


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(interface, "_ops", rec)
    monkeypatch.setattr(torch.ops.flash_attn2, "fwd_kvcache", rec.op("fwd_kvcache"), raising=False)
    return rec


B, S, H, HK, D = 2, 5, 4, 2, 16


def dense(dtype=torch.bfloat16, device="cpu"):
    return (
        torch.randn(B, S, H, D, dtype=dtype, device=device),
        torch.randn(B, S + 2, HK, D, dtype=dtype, device=device),
        torch.randn(B, S + 2, HK, D, dtype=dtype, device=device),
    )


def packed_rows(dtype=torch.bfloat16, device="cpu"):
    lens = [3, 0, 4]
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens), H, D, dtype=dtype, device=device)
    k = torch.randn(sum(lens), HK, D, dtype=dtype, device=device)
    return q, k, torch.randn_like(k), cu, max(lens)


def pages(dtype=torch.bfloat16, device="cpu"):
    cache = torch.randn(6, 16, HK, D, dtype=dtype, device=device)
    return cache, torch.randn_like(cache), torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int32, device=device)


def sink(dtype=torch.float32, shape=(H,), device="cpu"):
    return torch.randn(shape, device=device).to(dtype)


# Each public function with a sink under the given name: (name of the recorded op, how the sink reaches it, call).
# "variants": the last field of the Variants passed to the op module; "keyword": the op's learnable_sink keyword.
def call_func(s, name="learnable_sink", **kwargs):
    q, k, v = dense()
    return interface.flash_attn_func(q, k, v, **{name: s}, **kwargs)


def call_varlen(s, name="learnable_sink", **kwargs):
    q, k, v, cu, max_len = packed_rows()
    return interface.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, **{name: s}, **kwargs)


def call_paged(s, name="learnable_sink", **kwargs):
    q, _, _, cu, max_len = packed_rows()
    k_cache, v_cache, table = pages()
    return interface.flash_attn_varlen_func(
        q, k_cache, v_cache, cu, cu, max_len, max_len, block_table=table, **{name: s}, **kwargs
    )


def call_kvcache(s, name="learnable_sink", **kwargs):
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    k_cache, v_cache = torch.randn(B, 32, HK, D, dtype=torch.bfloat16), torch.randn(B, 32, HK, D, dtype=torch.bfloat16)
    return interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, **{name: s}, **kwargs)


def call_qkvpacked(s, name="learnable_sink", **kwargs):
    qkv = torch.randn(B, S, 3, H, D, dtype=torch.bfloat16)
    return interface.flash_attn_qkvpacked_func(qkv, **{name: s}, **kwargs)


def call_kvpacked(s, name="learnable_sink", **kwargs):
    q, _, _ = dense()
    kv = torch.randn(B, S + 2, 2, HK, D, dtype=torch.bfloat16)
    return interface.flash_attn_kvpacked_func(q, kv, **{name: s}, **kwargs)


def call_varlen_qkvpacked(s, name="learnable_sink", **kwargs):
    q, _, _, cu, max_len = packed_rows()
    qkv = torch.randn(q.shape[0], 3, H, D, dtype=torch.bfloat16)
    return interface.flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, **{name: s}, **kwargs)


def call_varlen_kvpacked(s, name="learnable_sink", **kwargs):
    q, k, _, cu, max_len = packed_rows()
    kv = torch.randn(k.shape[0], 2, HK, D, dtype=torch.bfloat16)
    return interface.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max_len, max_len, **{name: s}, **kwargs)


CALLS = {
    "func": ("fwd", "variants", call_func),
    "varlen": ("varlen_fwd", "variants", call_varlen),
    "paged": ("varlen_fwd_paged", "keyword", call_paged),
    "kvcache": ("fwd_kvcache", "keyword", call_kvcache),
    "qkvpacked": ("fwd", "variants", call_qkvpacked),
    "kvpacked": ("fwd", "variants", call_kvpacked),
    "varlen_qkvpacked": ("varlen_fwd", "variants", call_varlen_qkvpacked),
    "varlen_kvpacked": ("varlen_fwd", "variants", call_varlen_kvpacked),
}
# The functions that also take vLLM's name for the sink.
ALIASED = ("varlen", "paged", "kvcache")


def passed_sink(recorder, op, how):
    """The sink that reached the recorded op."""
    args, kwargs = recorder.only(op)
    if how == "keyword":
        return kwargs["learnable_sink"]
    variants = next(a for a in args if isinstance(a, interface.Variants))
    return variants.learnable_sink


@pytest.mark.parametrize("case", list(CALLS))
def test_sink_reaches_the_op(case, recorder):
    op, how, call = CALLS[case]
    s = sink()
    call(s)
    # A float32 contiguous sink is handed on as it is.
    assert passed_sink(recorder, op, how) is s


@pytest.mark.parametrize("case", list(CALLS))
def test_no_sink_passes_none(case, recorder):
    op, how, call = CALLS[case]
    call(None)
    assert passed_sink(recorder, op, how) is None


@pytest.mark.parametrize("case", ALIASED)
def test_s_aux_is_the_sink(case, recorder):
    op, how, call = CALLS[case]
    s = sink()
    call(s, name="s_aux")
    assert passed_sink(recorder, op, how) is s


@pytest.mark.parametrize("case", ALIASED)
def test_sink_and_s_aux_together_are_refused(case, recorder):
    _, _, call = CALLS[case]
    with pytest.raises(ValueError, match="s_aux"):
        call(sink(), s_aux=sink())
    assert recorder.calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["func", "varlen"])
def test_low_precision_sink_is_converted_differentiably(case, dtype, recorder):
    # The ops take float32: a bf16 or fp16 sink reaches them converted, and the float32 gradient they give comes
    # back through the conversion in the sink's own dtype.
    op, how, call = CALLS[case]
    s = sink(dtype).requires_grad_()
    call(s)
    passed = passed_sink(recorder, op, how)
    assert passed.dtype == torch.float32 and passed.is_contiguous() and passed.requires_grad
    assert torch.equal(passed.detach(), s.detach().float())
    grad = torch.randn(H)
    passed.backward(grad)
    assert s.grad.dtype == dtype and torch.equal(s.grad, grad.to(dtype))


def test_strided_sink_is_made_contiguous(recorder):
    op, how, call = CALLS["func"]
    s = torch.randn(2 * H)[::2]
    assert not s.is_contiguous()
    call(s)
    passed = passed_sink(recorder, op, how)
    assert passed.is_contiguous() and torch.equal(passed, s)


# Bad sinks, each built on demand for q on the CPU, and what the message must say besides the argument's name.
BAD_SINKS = {
    "too-many-heads": (lambda: sink(shape=(H + 1,)), "shape"),
    "kv-heads": (lambda: sink(shape=(HK,)), "shape"),
    "2d": (lambda: sink(shape=(1, H)), "shape"),
    "scalar": (lambda: torch.tensor(0.5), "shape"),
    "int32": (lambda: torch.arange(H, dtype=torch.int32), "float32"),
    "float64": (lambda: sink(torch.float64), "float32"),
    "bool": (lambda: torch.ones(H, dtype=torch.bool), "float32"),
    "list": (lambda: [0.0] * H, "tensor"),
    "other-device": (lambda: sink(device="meta"), "device"),
}


@pytest.mark.parametrize("bad", list(BAD_SINKS))
@pytest.mark.parametrize("case", list(CALLS))
def test_bad_sink_is_refused_before_any_op(case, bad, recorder):
    _, _, call = CALLS[case]
    make, what = BAD_SINKS[bad]
    with pytest.raises(ValueError, match=f"learnable_sink.*{what}|{what}.*learnable_sink"):
        call(make())
    names = ["s_aux"] if case in ALIASED else []
    for name in names:
        with pytest.raises(ValueError, match=f"s_aux.*{what}|{what}.*s_aux"):
            call(make(), name=name)
    # Nothing ran, not even dropout's draw.
    assert recorder.calls == []


def test_bad_sink_draws_no_dropout_state(recorder):
    with pytest.raises(ValueError, match="learnable_sink"):
        call_func(sink(shape=(H + 1,)), dropout_p=0.25)
    assert recorder.calls == []


@pytest.mark.parametrize("name", ["learnable_sink", "s_aux"])
def test_paged_takes_a_sink_that_requires_grad(name, recorder):
    # Paged calls have no backward, but their forward runs with inputs that require grad (a backward through its
    # outputs raises: test_kvcache_cpu's paged autograd tests), the sink as q, k and v.
    s = sink().requires_grad_()
    call_paged(s, name=name)
    assert passed_sink(recorder, "varlen_fwd_paged", "keyword") is s


# flash-attn 2.x's positional parameters of each function; the sink (and its alias) come after them, by keyword.
FLASH_ATTN_2_PARAMETERS = {
    "flash_attn_func": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
    "return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
    "causal window_size softcap alibi_slopes deterministic return_attn_probs block_table",
    "flash_attn_qkvpacked_func": "qkv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
    "return_attn_probs",
    "flash_attn_kvpacked_func": "q kv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
    "return_attn_probs",
    "flash_attn_varlen_qkvpacked_func": "qkv cu_seqlens max_seqlen dropout_p softmax_scale causal window_size "
    "softcap alibi_slopes deterministic return_attn_probs",
    "flash_attn_varlen_kvpacked_func": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
    "softmax_scale causal window_size softcap alibi_slopes deterministic return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens cache_batch_idx "
    "cache_leftpad block_table softmax_scale causal window_size softcap rotary_interleaved alibi_slopes num_splits "
    "return_softmax_lse",
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_PARAMETERS))
def test_signatures_keep_the_positional_order(name):
    params = inspect.signature(getattr(interface, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLASH_ATTN_2_PARAMETERS[name].split()
    keyword_only = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    expected = {"learnable_sink": None}
    if name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        # vLLM's alias, and FlashAttention-3's serving arguments.
        expected.update(s_aux=None, pack_gqa=None, out=None, lse_out=None)
    if name == "flash_attn_varlen_func":
        expected.update(seqused_q=None, seqused_k=None, num_splits=0)
    if name == "flash_attn_with_kvcache":
        expected.update(scheduler_metadata=None)
    assert keyword_only == expected


# ---------------------------------------------------------------- through the registered ops, on meta tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["func", "varlen"])
def test_sink_gradient_through_the_ops(case, dtype):
    # The fake implementations and the registered autograd on meta tensors: the sink gets a gradient of its shape
    # and dtype, and q, k and v theirs; without a sink the gradients of q, k and v are unchanged in shape.
    s = torch.empty(H, dtype=dtype, device="meta").requires_grad_()
    if case == "func":
        q, k, v = (t.requires_grad_() for t in dense(torch.float16, "meta"))
        out = interface.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    else:
        q, k, v, cu, max_len = packed_rows(torch.float16, "meta")
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = interface.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, s_aux=s)
    dq, dk, dv, ds = torch.autograd.grad(out.sum(), (q, k, v, s))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert ds.shape == s.shape and ds.dtype == dtype


def test_sink_returned_lse_shape_through_the_ops():
    q, k, v = dense(torch.bfloat16, "meta")
    out, lse, s_dmask = interface.flash_attn_func(
        q, k, v, return_attn_probs=True, learnable_sink=torch.empty(H, device="meta")
    )
    assert out.shape == q.shape and lse.shape == (B, H, S) and lse.dtype == torch.float32 and s_dmask is None


def test_backward_ops_give_an_empty_placeholder_without_a_sink():
    # The schema cannot return None: without a sink the backward op's fourth output is an empty float32 tensor.
    q, k, v = dense(torch.float16, "meta")
    out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.25, False)
    *grads, ds = torch.ops.flash_attn2.bwd(torch.empty_like(out), q, k, v, out, lse, 0.25, False)
    assert ds.shape == (0,) and ds.dtype == torch.float32 and len(grads) == 3
    s = torch.empty(H, dtype=torch.float32, device="meta")
    out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.25, False, learnable_sink=s)
    *_, ds = torch.ops.flash_attn2.bwd(torch.empty_like(out), q, k, v, out, lse, 0.25, False, learnable_sink=s)
    assert ds.shape == (H,) and ds.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_torchscript_passes_the_sink():
    # TorchScript binds the op's schema: the sink is an optional tensor argument it can pass by name.
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor):
        return torch.ops.flash_attn2.fwd(q, k, v, 0.125, True, learnable_sink=sink)

    scripted = torch.jit.script(attend)
    assert "flash_attn2::fwd" in str(scripted.graph)
    q = torch.empty(2, 9, 4, 64, dtype=torch.float16, device="meta")
    out, lse = scripted(q, q, q, torch.empty(4, dtype=torch.float32, device="meta"))
    assert out.shape == q.shape and lse.shape == (2, 4, 9)
