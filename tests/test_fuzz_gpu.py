"""Property-based fuzzing of flash_attn_func and flash_attn_varlen_func against the reference, on a CUDA device.

Hypothesis draws whole configurations: batch, seqlen_q and seqlen_k (biased to short lengths and to the edges of
the 16/64/128-row blocks), GQA (nheads_k and the group size), any head dim up to 256 (also ones the wrapper has to
pad), fp16 or bf16, causal, softmax_scale, the layout of each of q, k and v (packed qkv slots, (b, h, s, d) and
(s, b, h, d) storage, rows wider than head_dim, views that start off 16-byte alignment), separate magnitudes for
q, k and v from 1e-3 to 30, deterministic mode, and some of the plan choices that force a code path
(flash_attn_cuda.plan.force_plan: split-KV, mma.sync instead of wgmma, GQA group walks, key blocks per CTA,
short-key and short-query tiles), each asserted through the plan of the example's sizes. The varlen test draws
lists of sequence lengths, zeros included.

Every example runs the forward (out and LSE) and the backward (dq, dk, dv) on NaN-poisoned memory and applies
the correctness rule to all five against attention_ref in float32 (ref) and in the input dtype (ref_lowp), with
the atol of conftest.check_results, as every test of the suite does: one ulp of the dtype (tiny tensors) and,
for dq and dk, the two errors that FlashAttention-2's backward has by construction (conftest.gradient_floors).
Examples whose reference values the dtype cannot represent are skipped. A failure prints the falsifying example as a
constructor call, to paste into DENSE_REGRESSIONS or VARLEN_REGRESSIONS below.

The default run (`python -m pytest tests/test_fuzz_gpu.py`) draws a few dozen examples in total. The tests marked
exhaustive draw FLASH_ATTN2_FUZZ_EXAMPLES examples each (default 500):

    FLASH_ATTN2_FUZZ_EXAMPLES=500 python -m pytest tests/test_fuzz_gpu.py --exhaustive

`--hypothesis-seed=N` replays one run's draws. Hypothesis also saves each failure in .hypothesis/ (which it
git-ignores itself) and replays it first on the next run; keep it as an explicit example all the same.
"""

import dataclasses
import functools
import itertools
import math
import os

import pytest
import torch
from conftest import (
    DTYPE_NAMES,
    DTYPES,
    KERNEL_HEAD_DIMS,
    amax,
    check_forced_plans,
    check_results,
    cu_seqlens,
    gradient_floors,
    poison_allocator,
    requires_gpu,
    varlen_attention,
)

# hypothesis is a test-only dependency: a checkout without it skips this module rather than failing to collect.
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flash_attn_cuda  # noqa: E402
from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flash_attn_cuda.plan import force_plan  # noqa: E402
from flash_attn_cuda.reference import attention_ref  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_gpu]

# Block edges of the forward and backward tiles (16, 64 and 128 rows) and a few short odd lengths.
EDGE_SEQLENS = (1, 2, 3, 5, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513)
# The fp32 reference materializes (batch, heads, seqlen_q, seqlen_k) scores, and the backward a few more such
# tensors: 4 x 16 x 600 x 600 floats are 92 MB, which keeps an example at a few milliseconds.
MAX_SEQLEN = 600
MAX_VARLEN_SEQS = 5
DENSE_LAYOUTS = ("contiguous", "packed", "heads_major", "seq_major", "wide_rows", "misaligned")
VARLEN_LAYOUTS = ("contiguous", "packed", "heads_major", "wide_rows", "misaligned")
# force_plan keywords that force a path the small fuzz shapes would not take by themselves: split-KV starts at
# 1024 keys, and the group walks and key blocks per CTA depend on the grid size. Where one does not apply
# (another head dim, a GPU without the Hopper kernels, deterministic mode, varlen splits), the plan says it is
# off (conftest.check_forced_plans).
FORCE = {
    "kernel": ("mma_sync",),
    "num_splits": (1, 2, 3, 7),
    "gqa_walk": (False, True),
    "key_blocks": (1, 2, 3),
    "short_keys": (False, True),
    "short_queries": (False, True),
}
NAMES = ("out", "lse", "dq", "dk", "dv")

DEFAULT_DENSE_EXAMPLES = 20
DEFAULT_VARLEN_EXAMPLES = 10
EXHAUSTIVE_EXAMPLES = int(os.environ.get("FLASH_ATTN2_FUZZ_EXAMPLES", "500"))

# Examples take milliseconds but vary a lot (first kernel loads, shrinking), so no deadline. Health checks off:
# too_slow and data_too_large (each example draws many values), filter_too_much (the assumes below can reject
# a run of fp16 examples with large magnitudes), function_scoped_fixture (none is used per example, but a
# caller's autouse fixture must not break the module).
FUZZ = settings(
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


@dataclasses.dataclass(frozen=True)
class Dense:
    """One flash_attn_func call. Its repr is the constructor call, for @example."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_k: int
    group: int  # query heads per key/value head
    head_dim: int
    dtype: torch.dtype
    causal: bool
    softmax_scale: float | None
    layouts: tuple  # of q, k, v
    magnitudes: tuple  # of q, k, v
    deterministic: bool = False
    force: tuple = ()  # (force_plan keyword, value) pairs
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Varlen:
    """One flash_attn_varlen_func call on sequences of lengths lens_q[i] (queries) and lens_k[i] (keys)."""

    lens_q: tuple
    lens_k: tuple
    max_seqlen_slack: int  # added to max(lens) for max_seqlen_q and max_seqlen_k, capped at the totals
    nheads_k: int
    group: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    softmax_scale: float | None
    layouts: tuple
    magnitudes: tuple
    deterministic: bool = False
    force: tuple = ()
    seed: int = 0


# Every failure the fuzz ever finds stays here as an explicit example, run by the default and the exhaustive
# tests alike, so that it is checked on every run whatever hypothesis draws.
def _nan_dq_hopper(seqlen, causal):
    # NaN in dq on Hopper before its fix: fp16, q * 5, k * 3, v * 3, seqlen_q = seqlen_k <= 5, head dim 64.
    return Dense(
        batch=2,
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        nheads_k=5,
        group=1,
        head_dim=64,
        dtype=torch.float16,
        causal=causal,
        softmax_scale=None,
        layouts=("contiguous",) * 3,
        magnitudes=(5.0, 3.0, 3.0),
    )


def _one_key_dominates(force):
    # Found by the fuzz at de60a04 on an H200: with wgmma the NaN in dq above; on the mma.sync kernels a dq error
    # 2.3 x the rule's bound, from D read from the fp16 output (see rounded_output_floors).
    return Dense(
        batch=1,
        seqlen_q=1,
        seqlen_k=2,
        nheads_k=3,
        group=1,
        head_dim=32,
        dtype=torch.float16,
        causal=False,
        softmax_scale=None,
        layouts=("contiguous",) * 3,
        magnitudes=(8.66, 8.66, 1.0),
        force=force,
    )


DENSE_REGRESSIONS = [
    *(_nan_dq_hopper(s, c) for s in (1, 2, 5) for c in (False, True)),
    _one_key_dominates(()),
    _one_key_dominates((("kernel", "mma_sync"),)),
]
VARLEN_REGRESSIONS = [
    # Found by the fuzz at de60a04 on an H200: the same NaN in dq, through varlen, at head dim 32.
    Varlen(
        lens_q=(1, 0, 0, 0, 0),
        lens_k=(1, 0, 0, 0, 0),
        max_seqlen_slack=0,
        nheads_k=2,
        group=1,
        head_dim=32,
        dtype=torch.float16,
        causal=False,
        softmax_scale=None,
        layouts=("contiguous",) * 3,
        magnitudes=(1.0, 17.8, 1.0),
    ),
    # Found at de60a04: dk 2.65e-4 off (two fp16 ulps of its largest entry, 0.18) on 32 entries, where ref_lowp
    # was 1.0e-4 off: a fault of the check, fixed by one_ulp.
    Varlen(
        lens_q=(1,),
        lens_k=(2,),
        max_seqlen_slack=0,
        nheads_k=1,
        group=1,
        head_dim=16,
        dtype=torch.float16,
        causal=False,
        softmax_scale=None,
        layouts=("contiguous",) * 3,
        magnitudes=(1.0, 1.0, 1.0),
    ),
]


def with_examples(cases):
    def decorate(test):
        for case in reversed(cases):
            test = example(case=case)(test)
        return test

    return decorate


@functools.cache
def compiled_configs():
    """(kernel head dim, dtype, causal) for which this build has both the forward and the backward kernel."""
    return tuple(
        (d, dtype, causal)
        for d, dtype, causal in itertools.product(KERNEL_HEAD_DIMS, DTYPES, (False, True))
        if flash_attn_cuda.kernel_available(d, dtype, causal, backward=True)
    )


@pytest.fixture(scope="module", autouse=True)
def _setup():
    if not compiled_configs():
        pytest.skip("no head dim has both its forward and backward kernels in this build")
    # The float32 reference must not run its matmuls in TF32.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


# ---------------------------------------------------------------- strategies


def seqlens(min_len=1):
    # one_of shrinks to its first branch: a failure is reported on the shortest block edge that still fails.
    return st.one_of(st.sampled_from(EDGE_SEQLENS), st.integers(min_len, 40), st.integers(min_len, MAX_SEQLEN))


def magnitudes():
    # Log-uniform in [1e-3, 30], shrinking to 1 (exponent 0); three digits keep the printed example short.
    exponent = st.floats(math.log10(1e-3), math.log10(30.0))
    return st.one_of(st.just(1.0), exponent.map(lambda e: float(f"{10**e:.3g}")))


@st.composite
def kernel_config(draw):
    """(head_dim, dtype, causal) among the compiled kernels: a reduced build (FLASH_ATTN2_HDIMS, _DTYPES) still
    gets all its examples, none rejected. head_dim is the kernel's own size, a multiple of 8 below it, or any
    size in between the previous kernel's and its own, which the wrapper zero-pads to a multiple of 8."""
    kernel_dim, dtype, causal = draw(st.sampled_from(compiled_configs()))
    lower = max((d for d in KERNEL_HEAD_DIMS if d < kernel_dim), default=0)
    head_dim = draw(
        st.one_of(
            st.just(kernel_dim),
            st.sampled_from(range(lower + 8, kernel_dim + 1, 8)),
            st.integers(lower + 1, kernel_dim),
        )
    )
    return head_dim, dtype, causal


@st.composite
def forced_choices(draw):
    names = draw(st.lists(st.sampled_from(sorted(FORCE)), unique=True, max_size=3))
    return tuple((name, draw(st.sampled_from(FORCE[name]))) for name in sorted(names))


@st.composite
def common(draw, layouts):
    """The fields that Dense and Varlen share, as keyword arguments."""
    head_dim, dtype, causal = draw(kernel_config())
    return dict(
        nheads_k=draw(st.integers(1, 4)),
        group=draw(st.integers(1, 4)),
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 1.0))),
        layouts=tuple(draw(st.sampled_from(layouts)) for _ in "qkv"),
        magnitudes=tuple(draw(magnitudes()) for _ in "qkv"),
        deterministic=draw(st.booleans()),
        force=draw(forced_choices()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def dense_cases(draw):
    return Dense(
        batch=draw(st.integers(1, 4)), seqlen_q=draw(seqlens()), seqlen_k=draw(seqlens()), **draw(common(DENSE_LAYOUTS))
    )


@st.composite
def varlen_cases(draw):
    n = draw(st.integers(1, MAX_VARLEN_SEQS))
    lens = [draw(seqlens()) for _ in range(2 * n)]
    # Some sequences with no queries or no keys; drawn apart so that most examples have none and a failure
    # shrinks to the fewest.
    for i in draw(st.lists(st.integers(0, 2 * n - 1), max_size=n)):
        lens[i] = 0
    lens_q, lens_k = tuple(lens[:n]), tuple(lens[n:])
    # max_seqlen is an upper bound (a static-shape or CUDA-graph caller passes its buffer's); the extra
    # query and key blocks it launches must find nothing to do.
    slack = draw(st.one_of(st.just(0), st.integers(1, 130)))
    return Varlen(lens_q=lens_q, lens_k=lens_k, max_seqlen_slack=slack, **draw(common(VARLEN_LAYOUTS)))


# ---------------------------------------------------------------- inputs


def make_input(shape, layout, dtype, magnitude, gen):
    """A (..., seqlen, heads, head_dim) tensor of randn * magnitude values, as a view in the given layout.

    The storage around a view is NaN, so a kernel that reads past the view in place turns its results NaN.
    The wrapper copies the views that the kernel cannot take as they are: a head dim that is not a multiple of
    8 (zero-padded), strides that are not multiples of 8 elements, a start that is not 16-byte aligned.
    """
    values = (torch.randn(shape, generator=gen, device="cuda") * magnitude).to(dtype)
    if layout == "contiguous":
        return values

    def storage(*sizes):
        return torch.full(sizes, float("nan"), dtype=dtype, device="cuda")

    *lead, heads, dim = shape
    if layout == "packed":
        # The middle slot (k) of a fused qkv projection's output, (..., 3, heads, head_dim).
        view = storage(*lead, 3, heads, dim).select(-3, 1)
    elif layout == "heads_major":
        # (batch, heads, seqlen, head_dim) storage, as scaled_dot_product_attention takes it.
        view = storage(*lead[:-1], heads, lead[-1], dim).transpose(-3, -2)
    elif layout == "seq_major":
        # (seqlen, batch, heads, head_dim) storage; dense inputs only.
        batch, seqlen = lead
        view = storage(seqlen, batch, heads, dim).transpose(0, 1)
    elif layout == "wide_rows":
        # head_dim inside rows 8 elements wider: an aligned start, read in place when head_dim % 8 == 0.
        view = storage(*lead, heads, dim + 8)[..., :dim]
    elif layout == "misaligned":
        # x[..., 1:1 + head_dim] of rows 3 elements wider: a start 2 bytes past alignment, odd strides.
        view = storage(*lead, heads, dim + 3)[..., 1 : 1 + dim]
    else:
        raise ValueError(layout)
    view.copy_(values)
    return view


def make_qkv(case, q_shape, kv_shape, gen):
    return tuple(
        make_input(shape, layout, case.dtype, magnitude, gen)
        for shape, layout, magnitude in zip((q_shape, kv_shape, kv_shape), case.layouts, case.magnitudes)
    )


# ---------------------------------------------------------------- running and checking


def run_ours(call, q, k, v, dout, force):
    """(out, lse, dq, dk, dv) of call(q, k, v) -> (out, lse, None) under force_plan(**force), each pass on
    NaN-poisoned memory."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with force_plan(**force):
        poison_allocator(q.device)
        out, lse, _ = call(q, k, v)
        # Again before the backward: its outputs and workspaces are allocated after the forward's.
        poison_allocator(q.device)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    return out.detach(), lse.detach(), dq, dk, dv


def run_reference(attend, q, k, v, dout, upcast):
    """(out, lse, dq, dk, dv) of attend(q, k, v, upcast) -> (out, lse), in float32 or in the input dtype."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse.detach(), *grads)


def representable(ours, ref, lowp, dtype):
    """Whether the rule can judge this example: ref fits the dtype and ref_lowp is finite where ref is.

    An fp16 gradient over 65504 is inf in any fp16 result, and a low-precision reference that overflows in an
    intermediate (q k^T over 65504 before the scale, in fp16) is NaN: then the bound itself is undefined. Half
    the dtype's maximum leaves room for the rounding of values just below it.
    """
    limit = torch.finfo(dtype).max / 2
    for o, r, lp in zip(ours, ref, lowp):
        finite = torch.isfinite(r)
        if o.dtype == dtype and amax(r[finite]) > limit:
            return False
        if not torch.isfinite(lp[finite]).all():
            return False
    return True


def check(ours, ref, lowp, dtype, floors):
    """The correctness rule on (out, lse, dq, dk, dv) (conftest.check_results), after the NaN check."""
    # NaN is never right, also in examples the rule cannot judge below.
    for name, o in zip(NAMES, ours):
        n_nan = torch.isnan(o).sum().item()
        assert n_nan == 0, f"{name}: {n_nan} NaN of {o.numel()} entries"
    # The one skip besides missing kernels: the references cannot represent this example (see representable).
    assume(representable(ours, ref, lowp, dtype))
    check_results(NAMES, ours, ref, lowp, dtype, floors)


def record(case):
    """Labels for --hypothesis-show-statistics, to see what a run covered."""
    event(f"{DTYPE_NAMES[case.dtype]} {'causal' if case.causal else 'full'}")
    event("head_dim padded by the wrapper" if case.head_dim % 8 else "head_dim % 8 == 0")
    event("GQA" if case.group > 1 else "MHA")
    for layout in set(case.layouts):
        event(f"layout {layout}")
    for name, value in case.force:
        event(f"{name}={value}")


def effective_scale(case):
    return case.head_dim**-0.5 if case.softmax_scale is None else case.softmax_scale


def dense_results(case):
    """(ours, ref, lowp, floors) of a Dense case; ours, ref and lowp are (out, lse, dq, dk, dv)."""
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    h = case.nheads_k * case.group
    q_shape = (case.batch, case.seqlen_q, h, case.head_dim)
    q, k, v = make_qkv(case, q_shape, (case.batch, case.seqlen_k, case.nheads_k, case.head_dim), gen)
    dout = torch.randn(q_shape, generator=gen, device="cuda").to(case.dtype)

    def call(q, k, v):
        return flash_attn_func(
            q,
            k,
            v,
            softmax_scale=case.softmax_scale,
            causal=case.causal,
            deterministic=case.deterministic,
            return_attn_probs=True,
        )

    def attend(q, k, v, upcast):
        return attention_ref(q, k, v, case.softmax_scale, case.causal, upcast=upcast)

    check_forced_plans(q, k, case.causal, dict(case.force), deterministic=case.deterministic)
    ours = run_ours(call, q, k, v, dout, dict(case.force))
    ref = run_reference(attend, q, k, v, dout, upcast=True)
    lowp = run_reference(attend, q, k, v, dout, upcast=False)
    rows = case.seqlen_q * case.group  # the query rows that add into one key's dk
    return ours, ref, lowp, gradient_floors(attend, q, k, v, dout, ours[0], effective_scale(case), rows)


def varlen_results(case):
    """(ours, ref, lowp, floors) of a Varlen case, as dense_results."""
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    h, d = case.nheads_k * case.group, case.head_dim
    total_q, total_k = sum(case.lens_q), sum(case.lens_k)
    q, k, v = make_qkv(case, (total_q, h, d), (total_k, case.nheads_k, d), gen)
    dout = torch.randn((total_q, h, d), generator=gen, device="cuda").to(case.dtype)
    max_q = min(max(case.lens_q) + case.max_seqlen_slack, total_q)
    max_k = min(max(case.lens_k) + case.max_seqlen_slack, total_k)
    cu_q, cu_k = cu_seqlens(case.lens_q), cu_seqlens(case.lens_k)

    def call(q, k, v):
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            softmax_scale=case.softmax_scale,
            causal=case.causal,
            deterministic=case.deterministic,
            return_attn_probs=True,
        )

    def attend(q, k, v, upcast):
        return varlen_attention(q, k, v, case.lens_q, case.lens_k, case.causal, case.softmax_scale, upcast)

    check_forced_plans(
        q,
        k,
        case.causal,
        dict(case.force),
        deterministic=case.deterministic,
        lens=(case.lens_q, case.lens_k),
        max_seqlens=(max_q, max_k),
    )
    ours = run_ours(call, q, k, v, dout, dict(case.force))
    ref = run_reference(attend, q, k, v, dout, upcast=True)
    lowp = run_reference(attend, q, k, v, dout, upcast=False)
    rows = max(case.lens_q) * case.group
    return ours, ref, lowp, gradient_floors(attend, q, k, v, dout, ours[0], effective_scale(case), rows)


def check_dense(case):
    # Only examples given explicitly can name a kernel that is not compiled; drawn ones pick compiled kernels.
    assume(flash_attn_cuda.kernel_available(case.head_dim, case.dtype, case.causal, backward=True))
    record(case)
    ours, ref, lowp, floors = dense_results(case)
    check(ours, ref, lowp, case.dtype, floors)


def check_varlen(case):
    assume(flash_attn_cuda.kernel_available(case.head_dim, case.dtype, case.causal, backward=True))
    record(case)
    event("a sequence of no queries or no keys" if 0 in case.lens_q + case.lens_k else "no empty sequence")
    ours, ref, lowp, floors = varlen_results(case)
    check(ours, ref, lowp, case.dtype, floors)


# ---------------------------------------------------------------- tests


@with_examples(DENSE_REGRESSIONS)
@settings(FUZZ, max_examples=DEFAULT_DENSE_EXAMPLES)
@given(case=dense_cases())
def test_fuzz_dense(case):
    check_dense(case)


@with_examples(VARLEN_REGRESSIONS)
@settings(FUZZ, max_examples=DEFAULT_VARLEN_EXAMPLES)
@given(case=varlen_cases())
def test_fuzz_varlen(case):
    check_varlen(case)


@pytest.mark.exhaustive
@with_examples(DENSE_REGRESSIONS)
@settings(FUZZ, max_examples=EXHAUSTIVE_EXAMPLES)
@given(case=dense_cases())
def test_fuzz_dense_exhaustive(case):
    check_dense(case)


@pytest.mark.exhaustive
@with_examples(VARLEN_REGRESSIONS)
@settings(FUZZ, max_examples=EXHAUSTIVE_EXAMPLES)
@given(case=varlen_cases())
def test_fuzz_varlen_exhaustive(case):
    check_varlen(case)
