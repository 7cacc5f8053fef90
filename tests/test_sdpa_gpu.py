"""PyTorch's scaled_dot_product_attention on our kernels (flash_attn_cuda.sdpa) on a CUDA device.

After ``sdpa.activate()``, SDPA's flash backend and the aten flash attention ops under it run our kernels; every
check below asserts through ``sdpa.calls`` that they did (and, once, through a profiler trace that names the
flash_attn2 ops), and applies the correctness rule of conftest.check_results to what came back, against
flash_attn_cuda.reference in float32 on upcast inputs (ref) and in the input dtype (ref_lowp). A fixture activates
and always deactivates, so that no test leaves PyTorch's kernels replaced.

Covered: F.scaled_dot_product_attention forced to the flash backend, bf16 and fp16, on the transposed views of
(b, s, h, d) tensors that models pass and on contiguous (b, h, s, d) tensors, out and the three gradients; odd and
unequal lengths both ways, head dims 64 and 128 and two that SDPA pads to a multiple of 8 itself (100 and 36), GQA
through enable_gqa, an explicit scale. SDPA's is_causal aligns its mask to the top-left corner and its flash
backend refuses is_causal when seqlen_q != seqlen_k, so is_causal runs with equal lengths only; causal attention
with unequal lengths goes through torch.nn.attention.bias.causal_lower_right, which SDPA hands to the flash op with
is_causal=True, whose mask the flash kernels (PyTorch's and ours) align to the bottom-right corner, as the
reference does. Also: dropout through the aten op itself (the mask rebuilt from the returned rng_state),
torch.compile(fullgraph=True) of a training step, a Llama model of HF transformers with attn_implementation="sdpa"
against the same weights on flash_attn_func, PyTorch's kernels again after deactivate(), a call that only
PyTorch's kernel can serve (return_debug_mask), torch.nn.attention.varlen.varlen_attn, and a CUDA graph of a
training step. One test is expected to fail until sdpa tells its own dropout rng_state apart from PyTorch's in a way
that survives a copy (saved tensors offloaded with save_on_cpu).
"""

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DTYPE_IDS,
    DTYPES,
    check_close,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    rand,
    require_fwd_bwd_kernels,
    requires_gpu,
    varlen_attention,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func, sdpa
from flash_attn_cuda.dropout import keep_mask
from flash_attn_cuda.reference import attention_ref

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

DEVICE = "cuda"
KINDS = ("forward", "backward", "fallback_forward", "fallback_backward")


@pytest.fixture
def active():
    """Our kernels behind SDPA for the test, PyTorch's back after it, whatever the test did."""
    sdpa.activate()
    try:
        assert sdpa.is_active()
        yield
    finally:
        sdpa.deactivate()
    assert not sdpa.is_active()


@contextlib.contextmanager
def counted():
    """{kind: how many calls of that kind sdpa.calls counted inside the block}, filled in when the block ends."""
    before = collections.Counter(sdpa.calls)
    ran = {}
    yield ran
    ran.update({kind: sdpa.calls[kind] - before[kind] for kind in KINDS})


def flash_backend():
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def require_served(head_dim, dtype, causal, variants=False):
    """Skips unless this build has the kernels that serve the call: without them sdpa hands it to PyTorch's
    kernel, and the counts the tests assert would not move. head_dim: as the aten op sees it (padded by SDPA)."""
    require_fwd_bwd_kernels(head_dim, dtype, causal)
    if variants and not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True, variants=True):
        pytest.skip(f"variants kernels for head_dim={head_dim} {dtype} causal={causal} not compiled")


def padded(head_dim):
    """The head dim the aten op sees: SDPA pads q, k and v to a multiple of 8 before calling it."""
    return -(-head_dim // 8) * 8


def sdpa_tensors(b, sq, sk, h, hk, d, dtype, layout="bshd"):
    """q, k, v (leaves that require grad) and dout in SDPA's (batch, heads, seqlen, head_dim) shape: with layout
    "bshd" the transposed views of (b, s, h, d) tensors, what models pass (a projection viewed as (b, s, h, d),
    then transposed); with "bhsd" contiguous tensors of that shape."""

    def make(s, heads):
        if layout == "bshd":
            return rand(b, s, heads, d, dtype=dtype, device=DEVICE).transpose(1, 2)
        return rand(b, heads, s, d, dtype=dtype, device=DEVICE)

    q, k, v = (make(s, heads).requires_grad_() for s, heads in ((sq, h), (sk, hk), (sk, hk)))
    return q, k, v, make(sq, h)


def flash_layout(*tensors):
    """SDPA's (b, h, s, d) tensors as the reference's (b, s, h, d) views, detached."""
    return tuple(t.detach().transpose(1, 2) for t in tensors)


def reference(attend, q, k, v, dout, upcast):
    """(out, lse, dq, dk, dv) of ``attend(q, k, v, upcast)`` and autograd through it, in q's layout."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse.detach(), *grads)


def check_dense(q, k, v, dout, ours, causal, scale=None, lse=None, dropout_p=0.0, mask=None):
    """The rule on ours = (out, dq, dk, dv) of an SDPA-layout call (b, h, s, d) against attention_ref with
    bottom-right causal masking, and on the LSE (b, h, seqlen_q) when given. q, k, v, dout: the call's."""
    qf, kf, vf, doutf = flash_layout(q, k, v, dout)
    out, dq, dk, dv = flash_layout(*ours)

    def attend(q, k, v, upcast, dropped=True):
        return attention_ref(
            q,
            k,
            v,
            scale,
            causal,
            upcast=upcast,
            dropout_p=dropout_p if dropped else 0.0,
            dropout_mask=mask if dropped else None,
        )

    ref = reference(attend, qf, kf, vf, doutf, upcast=True)
    lowp = reference(attend, qf, kf, vf, doutf, upcast=False)
    softmax_scale = qf.shape[-1] ** -0.5 if scale is None else scale
    rows = qf.shape[1] * (qf.shape[2] // kf.shape[2])
    floors = gradient_floors(attend, qf, kf, vf, doutf, abs(softmax_scale), rows, dropout_p)
    names, results = ("out", "dq", "dk", "dv"), (out, dq, dk, dv)
    if lse is not None:
        names, results = ("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)
    else:
        ref, lowp = ref[:1] + ref[2:], lowp[:1] + lowp[2:]
    check_results(names, results, ref, lowp, q.dtype, floors)


def attend_sdpa(q, k, v, mask, scale=None):
    """F.scaled_dot_product_attention with mask "none", "causal" (is_causal: equal lengths only) or "lower_right"
    (torch.nn.attention.bias.causal_lower_right: bottom-right causal with unequal lengths), GQA by enable_gqa."""
    gqa = q.shape[1] != k.shape[1]
    if mask == "lower_right":
        bias = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal", scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------- F.scaled_dot_product_attention

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, scale). The logits stay within conftest.LOGIT_STD:
# scale 0.3 at head dim 64 gives a standard deviation of 2.4, 0.2 at 36 of 1.2.
CASES = {
    "causal-128": (2, 257, 257, 4, 4, 128, "causal", None),
    "sq<sk-64": (2, 113, 300, 4, 4, 64, "none", None),
    "gqa-sq>sk-scale": (2, 300, 113, 6, 2, 64, "none", 0.3),
    "gqa-causal-128": (1, 211, 211, 8, 2, 128, "causal", None),
    "pad100-gqa-sq<sk": (2, 97, 161, 4, 2, 100, "none", None),
    "pad36-causal-scale": (2, 150, 150, 4, 4, 36, "causal", 0.2),
    "lower_right-gqa-sq<sk": (2, 77, 230, 4, 2, 64, "lower_right", None),
    "lower_right-sq>sk-128": (1, 230, 77, 4, 4, 128, "lower_right", None),
}


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("layout", ["bshd", "bhsd"], ids=["transposed", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_sdpa_runs_our_kernels(active, case, dtype, layout):
    """One forward and one backward of ours per call, none of PyTorch's; out, dq, dk and dv meet the rule."""
    b, sq, sk, h, hk, d, mask, scale = case
    require_served(padded(d), dtype, mask != "none")
    q, k, v, dout = sdpa_tensors(b, sq, sk, h, hk, d, dtype, layout)
    with counted() as ran, flash_backend():
        poison_allocator(q.device)
        out = attend_sdpa(q, k, v, mask, scale)
        poison_allocator(q.device)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert ran == {"forward": 1, "backward": 1, "fallback_forward": 0, "fallback_backward": 0}
    assert out.shape == (b, h, sq, d) and out.dtype == dtype
    check_dense(q, k, v, dout, (out, *grads), mask != "none", scale)


def profiled_op_names(fn):
    """The names of the operators that a profiler saw fn() dispatch, forward and backward."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def sdpa_step(q, k, v, dout, mask="causal"):
    with flash_backend():
        out = attend_sdpa(q, k, v, mask)
        return out, torch.autograd.grad(out, (q, k, v), dout)


def test_profiler_names_our_ops(active):
    """A profiler trace of an activated SDPA call shows the flash_attn2 ops under the aten flash ops: what a user
    looking at a trace sees of the replacement."""
    require_served(64, torch.bfloat16, True)
    q, k, v, dout = sdpa_tensors(2, 129, 129, 4, 4, 64, torch.bfloat16)
    names = profiled_op_names(lambda: sdpa_step(q, k, v, dout))
    for name in (
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
        "flash_attn2::fwd",
        "flash_attn2::bwd",
    ):
        assert name in names, f"{name} not in the trace: {sorted(n for n in names if '::' in n)}"


def test_deactivate_restores_pytorch_kernels():
    """After deactivate(), SDPA's flash backend runs PyTorch's kernel again: no flash_attn2 op in the trace, no call
    counted, and its results right."""
    sdpa.activate()
    sdpa.deactivate()
    assert not sdpa.is_active()
    q, k, v, dout = sdpa_tensors(2, 129, 129, 4, 2, 64, torch.bfloat16)
    results = []
    with counted() as ran:
        names = profiled_op_names(lambda: results.append(sdpa_step(q, k, v, dout)))
    assert all(count == 0 for count in ran.values()), ran
    assert "aten::_scaled_dot_product_flash_attention" in names
    assert not any(name.startswith("flash_attn2::") for name in names), sorted(names)
    out, grads = results[0]
    check_dense(q, k, v, dout, (out, *grads), causal=True)


# ---------------------------------------------------------------- the aten ops directly

# Dropout at 0.17 drops with probability 44/256 (reference.effective_dropout_p), as our kernels do; the reference
# rebuilds the kernels' mask from the rng_state that the op returns.
DROPOUT_P = 0.17


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "b, sq, sk, h, hk, d, causal",
    [(2, 113, 203, 6, 2, 64, False), (2, 203, 113, 4, 4, 128, True)],
    ids=["gqa-sq<sk", "causal-sq>sk"],
)
def test_flash_op_with_dropout(active, b, sq, sk, h, hk, d, causal, dtype):
    """aten._scaled_dot_product_flash_attention with dropout, called directly (the op's causal mask is bottom-right,
    so unequal lengths are fine here): ours runs both passes, its rng_state gives the mask that the kernels
    applied (dropout.keep_mask), and out, the LSE and the gradients by autograd meet the rule under that mask."""
    require_served(d, dtype, causal, variants=True)
    q, k, v, dout = sdpa_tensors(b, sq, sk, h, hk, d, dtype)
    scale = 0.11
    with counted() as ran:
        poison_allocator(q.device)
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, DROPOUT_P, causal, False, scale=scale)
        out, lse, rng_state = result[0], result[1], result[6]
        poison_allocator(q.device)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert ran == {"forward": 1, "backward": 1, "fallback_forward": 0, "fallback_backward": 0}
    assert rng_state.shape == (2,) and rng_state.dtype == torch.uint64
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    mask = keep_mask(rng_state.view(torch.int64), DROPOUT_P, b, h, sq, sk)
    check_dense(q, k, v, dout, (out, *grads), causal, scale, lse=lse, dropout_p=DROPOUT_P, mask=mask)


# PyTorch's kernel drops with probability p itself and ours with effective_dropout_p(p); both scale what they keep
# by 1 / (1 - p). At 0.25 the two probabilities are the same too.
FALLBACK_DROPOUT_P = 0.25


def test_unserved_call_runs_pytorch_kernel(active):
    """return_debug_mask (with dropout, which PyTorch's kernel needs for it) is a call that only PyTorch's kernel
    can serve: it runs there without an error, and so does its backward, whose rng_state a forward of PyTorch's
    made. The mask PyTorch's kernel applied is in the sign bits of the debug mask (negative where dropped); out,
    the LSE and the gradients meet the rule under it."""
    b, sq, sk, h, d = 2, 100, 130, 4, 64
    q, k, v, dout = sdpa_tensors(b, sq, sk, h, h, d, torch.bfloat16)
    with counted() as ran:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, FALLBACK_DROPOUT_P, False, True)
        out, lse, debug_mask = result[0], result[1], result[8]
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # PyTorch's SDPA kernels call _flash_attention_forward/_backward through the dispatcher, which comes back
    # here and falls back again: two of each, and nothing served here.
    assert ran == {"forward": 0, "backward": 0, "fallback_forward": 2, "fallback_backward": 2}
    assert debug_mask.shape[:2] == (b, h) and debug_mask.shape[2] >= sq and debug_mask.shape[3] >= sk
    mask = ~torch.signbit(debug_mask[:, :, :sq, :sk])
    # The decoding holds if about 1 - p of the entries are kept (binomial: 104000 entries, sigma about 0.0013).
    kept = mask.float().mean().item()
    assert abs(kept - (1 - FALLBACK_DROPOUT_P)) < 0.01, kept
    check_dense(q, k, v, dout, (out, *grads), False, lse=lse, dropout_p=FALLBACK_DROPOUT_P, mask=mask)


def test_dropout_backward_after_offloading(active):
    """Saved tensors offloaded to host memory (torch.autograd.graph.save_on_cpu, which copies each one out and back)
    must not change which kernels run the backward of a dropout call that ours served: ours again, under the mask
    of the returned rng_state, with gradients that meet the rule."""
    b, sq, sk, h, d = 2, 113, 113, 4, 64
    require_served(d, torch.bfloat16, False, variants=True)
    q, k, v, dout = sdpa_tensors(b, sq, sk, h, h, d, torch.bfloat16)
    with counted() as ran:
        with torch.autograd.graph.save_on_cpu():
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, DROPOUT_P, False, False)
        out, lse, rng_state = result[0], result[1], result[6]
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert ran == {"forward": 1, "backward": 1, "fallback_forward": 0, "fallback_backward": 0}
    mask = keep_mask(rng_state.view(torch.int64), DROPOUT_P, b, h, sq, sk)
    check_dense(q, k, v, dout, (out, *grads), False, lse=lse, dropout_p=DROPOUT_P, mask=mask)


# ---------------------------------------------------------------- varlen

# At most 128 query rows per sequence: newer torch runs varlen_attn on cuDNN above that where it can (torch
# 2.11 never does), and these calls are meant for the flash op. One single-row sequence; causal rows that see no
# key where a sequence has more queries than keys.
VARLEN_Q = [37, 128, 1, 90]
VARLEN_K = [60, 100, 17, 90]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_attn(active, causal, dtype):
    """torch.nn.attention.varlen.varlen_attn on packed (total, heads, head_dim) tensors runs ours forward and
    backward (through aten._flash_attention_forward and _backward); out, the LSE and the gradients meet the rule
    against the reference on each sequence apart (bottom-right causal per sequence, as window_size=(-1, 0))."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    h, d = 4, 64
    # varlen_attn passes causal as the window (-1, 0) too, which sdpa serves only where the variants kernels are.
    require_served(d, dtype, causal, variants=causal)
    q = rand(sum(VARLEN_Q), h, d, dtype=dtype, device=DEVICE).requires_grad_()
    k, v = (rand(sum(VARLEN_K), h, d, dtype=dtype, device=DEVICE).requires_grad_() for _ in range(2))
    dout = torch.randn_like(q)
    cu_q, cu_k = cu_seqlens(VARLEN_Q, device=DEVICE), cu_seqlens(VARLEN_K, device=DEVICE)
    window = (-1, 0) if causal else (-1, -1)
    with counted() as ran:
        poison_allocator(q.device)
        out, lse = varlen_attn(
            q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), return_aux=AuxRequest(lse=True), window_size=window
        )
        poison_allocator(q.device)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert ran == {"forward": 1, "backward": 1, "fallback_forward": 0, "fallback_backward": 0}

    def attend(q, k, v, upcast):
        return varlen_attention(q, k, v, VARLEN_Q, VARLEN_K, causal, upcast=upcast)

    ref = reference(attend, q, k, v, dout, upcast=True)
    lowp = reference(attend, q, k, v, dout, upcast=False)
    floors = gradient_floors(attend, q, k, v, dout, d**-0.5, max(VARLEN_Q))
    check_results(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref, lowp, dtype, floors)


# ---------------------------------------------------------------- torch.compile and CUDA graphs


class Attention(torch.nn.Module):
    """q, k and v as parameters in the (b, s, h, d) layout of a model's projections, handed to SDPA as transposed
    views; the output comes back in that layout."""

    def __init__(self, b, s, h, hk, d, dtype):
        super().__init__()
        self.q = torch.nn.Parameter(rand(b, s, h, d, dtype=dtype, device=DEVICE))
        self.k = torch.nn.Parameter(rand(b, s, hk, d, dtype=dtype, device=DEVICE))
        self.v = torch.nn.Parameter(rand(b, s, hk, d, dtype=dtype, device=DEVICE))

    def forward(self):
        q, k, v = (p.transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def test_compiled_training_step(active):
    """torch.compile(fullgraph=True) of a module calling SDPA runs ours in the forward and in the backward of a
    training step, and its output and gradients, like the eager module's, meet the rule. The loss weighs the
    output with a float32 tensor, whose bf16 rounding is then the output's gradient."""
    b, s, h, hk, d, dtype = 2, 256, 8, 2, 64, torch.bfloat16
    require_served(d, dtype, True)
    eager = Attention(b, s, h, hk, d, dtype)
    compiled = Attention(b, s, h, hk, d, dtype)
    compiled.load_state_dict(eager.state_dict())
    weight = torch.randn(b, s, h, d, device=DEVICE)
    for model, fn in ((eager, eager), (compiled, torch.compile(compiled, fullgraph=True))):
        with counted() as ran, flash_backend():
            out = fn()
            (out.float() * weight).sum().backward()
        assert ran["forward"] >= 1 and ran["backward"] >= 1, ran
        assert ran["fallback_forward"] == 0 and ran["fallback_backward"] == 0, ran
        # check_dense takes SDPA's (b, h, s, d) shapes.
        q, k, v, dout, out = (t.detach().transpose(1, 2) for t in (model.q, model.k, model.v, weight.to(dtype), out))
        grads = [p.grad.transpose(1, 2) for p in (model.q, model.k, model.v)]
        check_dense(q, k, v, dout, (out, *grads), causal=True)


@contextlib.contextmanager
def deterministic_algorithms():
    """Deterministic algorithms on, so that our backward adds in a fixed order (sdpa passes the setting on), and the
    filling of uninitialized memory that comes with them off, which the step does not need: the previous settings
    back afterwards. Not warn_only: PyTorch's own flash backward stays non-deterministic in that mode, and the
    step must not depend on sdpa reading the mode otherwise."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_training_step_in_a_cuda_graph(active):
    """An SDPA forward and backward captured once in a CUDA graph (warmed up on a side stream), then replayed on
    fresh inputs: bitwise the eager step on the same values (deterministic backward), which meets the rule."""
    b, s, h, d, dtype = 2, 150, 4, 64, torch.bfloat16
    require_served(d, dtype, True)
    q, k, v, dout = sdpa_tensors(b, s, s, h, h, d, dtype)

    def step():
        out, grads = sdpa_step(q, k, v, dout)
        return (out, *grads)

    with deterministic_algorithms():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), counted() as ran:
            step()  # warm-up: outside the capture, the kernels load and the allocator sees the step's sizes
        torch.cuda.current_stream().wait_stream(side)
        assert ran["forward"] == 1 and ran["backward"] == 1, ran
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        fresh = sdpa_tensors(b, s, s, h, h, d, dtype)
        with torch.no_grad():
            for t, new in zip((q, k, v, dout), fresh):
                t.copy_(new)
            for t in captured:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = tuple(t.detach() for t in step())
    for name, replayed, expected in zip(("out", "dq", "dk", "dv"), captured, eager):
        assert torch.equal(replayed.detach(), expected), name
    check_dense(q, k, v, dout, eager, causal=True)


# ---------------------------------------------------------------- a model of HF transformers

# transformers takes a name with "flash" in it for a flash-attn package or kernel to load: this one has none.
FUNC_INTERFACE = "attn2_cuda_func"


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface on flash_attn_func: (batch, heads, seqlen, head_dim) in, (batch, seqlen,
    heads, head_dim) out; causal, without padding (the test's batches have none, so attention_mask adds
    nothing)."""
    out = flash_attn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        causal=True,
    )
    return out, None


def make_llama(transformers, dtype, implementation, state=None):
    """A 2-layer Llama, GQA 8:2 at head dim 64, with the weights of ``state`` (a state dict) or drawn from a fixed
    seed."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        attn_implementation=implementation,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=DEVICE, dtype=dtype)


def llama_loss_and_grads(model, tokens):
    """Each token's next-token loss, and the gradients of their mean by every layer's q_proj and o_proj weights
    (float32). Per token: the rule's maxima over hundreds of losses are steady, where one mean's rounding error can
    by chance be small in the baseline."""
    model.zero_grad()
    logits = model(input_ids=tokens).logits.float()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    losses.mean().backward()
    grads = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "o_proj"):
            param = getattr(layer.self_attn, name).weight
            # A parameter the loss did not reach has no gradient: zeros, which the check then rejects.
            grads[f"layer{i}.{name}"] = (
                param.grad.float() if param.grad is not None else torch.zeros_like(param).float()
            )
    return losses.detach(), grads


def test_llama_sdpa_trains_through_our_kernels(active):
    """A Llama of HF transformers with attn_implementation="sdpa", SDPA forced to its flash backend in the forward
    and the backward, runs ours in every layer, and gives per-token losses and q_proj / o_proj gradients that meet
    the rule, as the same weights with attention on flash_attn_func do: reference the float32 eager model,
    baseline the bf16 eager one. transformers passes is_causal and no mask when nothing is padded."""
    transformers = pytest.importorskip("transformers")
    if not all(hasattr(transformers, n) for n in ("LlamaConfig", "LlamaForCausalLM", "AttentionInterface")):
        pytest.skip("this transformers has no Llama or no AttentionInterface")
    require_served(64, torch.bfloat16, True)
    transformers.AttentionInterface.register(FUNC_INTERFACE, flash_attention)
    tokens = torch.randint(0, 512, (2, 300), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    base = make_llama(transformers, torch.float32, "eager")
    state = base.state_dict()
    ref_loss, ref_grads = llama_loss_and_grads(base, tokens)
    lowp_loss, lowp_grads = llama_loss_and_grads(make_llama(transformers, torch.bfloat16, "eager", state), tokens)

    model = make_llama(transformers, torch.bfloat16, "sdpa", state)
    with counted() as ran, flash_backend():
        sdpa_loss, sdpa_grads = llama_loss_and_grads(model, tokens)
    layers = len(model.model.layers)
    assert ran == {"forward": layers, "backward": layers, "fallback_forward": 0, "fallback_backward": 0}
    flash_loss, flash_grads = llama_loss_and_grads(
        make_llama(transformers, torch.bfloat16, FUNC_INTERFACE, state), tokens
    )

    for loss, grads in ((sdpa_loss, sdpa_grads), (flash_loss, flash_grads)):
        check_close("losses", loss, ref_loss, lowp_loss)
        for name, ref in ref_grads.items():
            check_close(name, grads[name], ref, lowp_grads[name])
