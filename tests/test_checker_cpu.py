"""Tests of the correctness checker itself (conftest.check_close, check_results, gradient_floors), on the CPU.

The kernel is stood in for by the float32 reference rounded to the input dtype. For the shapes, dtypes and gains the
GPU suite uses, that stand-in must pass, a result of zeros must fail every tensor whose reference is not zero, and
the reference plus noise at twice the plain rule's bound must fail in most draws: a check that cannot fail, or that
passes a wrong result, is a bug of the suite.
"""

import math

import pytest
import torch
from conftest import (
    SMALL_TENSOR,
    Floor,
    amax,
    check_close,
    check_results,
    gradient_floors,
    rule_bound,
)
from test_large_inputs_gpu import EXTREME_GAINS

from flash_attn_cuda.reference import attention_ref

NAMES = ("out", "lse", "dq", "dk", "dv")
FP16, BF16 = torch.float16, torch.bfloat16


class Case:
    """A dense call as the GPU tests make it: (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim), causal,
    dtype and the gains of q, k and v."""

    def __init__(self, shape, causal, dtype, gains=(1.0, 1.0, 1.0)):
        self.shape, self.causal, self.dtype, self.gains = shape, causal, dtype, gains

    def __repr__(self):
        b, sq, sk, h, hk, d = self.shape
        gains = "x".join(f"{g:g}" for g in self.gains)
        mask = "causal" if self.causal else "full"
        return f"b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}-{mask}-{str(self.dtype)[6:]}-gains{gains}"


def _cases():
    cases = []
    # Plain calls: test_bwd_gpu's shapes (its longest lengths left to the GPU), both orders of unequal lengths,
    # lengths of one and two, GQA and MQA.
    for dtype in (FP16, BF16):
        for causal in (False, True):
            cases += [
                Case((2, 113, 257, 4, 4, 64), causal, dtype),
                Case((2, 257, 113, 6, 2, 128), causal, dtype),
                Case((2, 17, 113, 4, 1, 256), causal, dtype),
                Case((1, 2, 5, 2, 2, 32), causal, dtype),
                Case((1, 5, 2, 2, 2, 32), causal, dtype),
                Case((8, 1, 17, 2, 2, 64), causal, dtype),
                Case((3, 17, 1, 2, 1, 96), causal, dtype),
            ]
    # Large magnitudes (test_large_inputs_gpu): fp16 q * 5, k and v * 3, short and unequal lengths.
    for sq, sk in [(3, 2), (5, 17), (17, 5), (65, 129), (129, 63), (2, 2), (1, 2)]:
        for causal in (False, True):
            cases.append(Case((2, sq, sk, 6, 2, 64), causal, FP16, (5.0, 3.0, 3.0)))
    # Extreme gains (test_large_inputs_gpu.test_extreme_gains): large values, tiny tensors everywhere, and tiny
    # keys between large queries and values, where dq scales with |K| alone.
    for dtype in (FP16, BF16):
        for gains in EXTREME_GAINS.values():
            for sq, sk in [(3, 70), (70, 3), (129, 129)]:
                cases.append(Case((2, sq, sk, 4, 2, 64), True, dtype, gains))
    return cases


CASES = _cases()


def _reference(case, seed=0):
    """(inputs, ref, lowp, floors): the reference's (out, lse, dq, dk, dv) in float32 and in the input dtype."""
    generator = torch.Generator().manual_seed(seed)
    b, sq, sk, h, hk, d = case.shape

    def draw(shape, gain):
        return (torch.randn(shape, generator=generator) * gain).to(case.dtype)

    q, k, v = (
        draw((b, sq, h, d), case.gains[0]),
        draw((b, sk, hk, d), case.gains[1]),
        draw((b, sk, hk, d), case.gains[2]),
    )
    dout = draw((b, sq, h, d), 1.0)

    def attend(q, k, v, upcast):
        return attention_ref(q, k, v, None, case.causal, upcast=upcast)

    def run(upcast):
        leaves = [(t.float() if upcast else t).requires_grad_() for t in (q, k, v)]
        out, lse = attend(*leaves, upcast)
        grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
        return [out.detach(), lse.detach(), *grads]

    floors = gradient_floors(attend, q, k, v, dout, d**-0.5, sq * (h // hk))
    return run(True), run(False), floors


def _stand_in(ref, dtype):
    """The kernel's stand-in: the reference rounded to the input dtype (the LSE stays float32)."""
    return [t if name == "lse" else t.to(dtype) for name, t in zip(NAMES, ref)]


def _fails(name, ours, ref, lowp, dtype, floor):
    try:
        check_close(name, ours, ref, lowp, dtype, floor)
    except AssertionError:
        return True
    return False


def _zero_reference(name, ref, floor):
    """Whether the reference is zero where the check looks (outside rows within the float32 floor of zero)."""
    if floor is None or floor.zero_rows == 0:
        return amax(ref[torch.isfinite(ref)]) == 0
    return bool((ref.abs().amax(-1) <= floor.zero_rows).all())


@pytest.fixture(autouse=True)
def _highest_precision():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_checker_discriminates(case):
    """The stand-in passes every check (whose bounds must discriminate), zeros fail every tensor with a nonzero
    reference, and noise at twice the plain rule's bound fails in most draws."""
    ref, lowp, floors = _reference(case)
    check_results(NAMES, _stand_in(ref, case.dtype), ref, lowp, case.dtype, floors)

    for name, r, lp in zip(NAMES, ref, lowp):
        floor = floors.get(name)
        if _zero_reference(name, r, floor):
            continue
        dtype = case.dtype if name != "lse" else torch.float32
        zeros = torch.where(torch.isposinf(r), r, 0.0).to(dtype)
        assert _fails(name, zeros, r, lp, case.dtype, floor), f"{name}: zeros pass"

        finite = torch.isfinite(r)
        plain = rule_bound(torch.where(finite, r, 0.0), torch.where(finite, lp, 0.0))
        generator = torch.Generator().manual_seed(1)
        failed = 0
        for _ in range(10):
            noise = (2 * torch.rand(r.shape, generator=generator, dtype=torch.float64) - 1) * 2 * plain
            noisy = torch.where(finite, r.double() + noise, r.double())
            failed += _fails(name, noisy, r, lp, None, floor)
        assert failed >= 8, f"{name}: noise at twice the plain rule's bound failed in only {failed} of 10 draws"


def test_zero_gradient_fails_under_skewed_gains():
    """Tiny keys between large queries and values (dq scales with |K|, dk with |Q|): zero dq and zero dk fail."""
    for dtype in (FP16, BF16):
        ref, lowp, floors = _reference(Case((2, 70, 3, 4, 2, 64), True, dtype, (30.0, 1e-3, 30.0)))
        for index, name in [(2, "dq"), (3, "dk")]:
            assert _fails(name, torch.zeros_like(ref[index]), ref[index], lowp[index], dtype, floors[name])


def test_rounded_output_floor_ignores_the_kernel_output():
    """The rounded-output floor depends on the inputs alone: a forward far off cannot widen the gradient checks."""
    case = Case((2, 1, 2, 2, 2, 64), False, FP16, (8.66, 8.66, 1.0))
    _, _, floors = _reference(case)
    _, _, again = _reference(case)
    for name in ("dq", "dk"):
        assert torch.equal(floors[name].added, again[name].added)
        assert floors[name].zero_rows == again[name].zero_rows


def test_vacuous_check_fails():
    """A bound not below half of max|ref| fails even when the result is right."""
    ref = torch.tensor([1.0, -0.5, 0.25])
    lowp = ref + torch.tensor([0.3, 0.0, 0.0])
    with pytest.raises(AssertionError, match="cannot discriminate"):
        check_close("t", ref.clone(), ref, lowp)
    check_close("t", ref.clone(), ref, ref + torch.tensor([1e-3, 0.0, 0.0]))


def test_zero_reference_is_not_vacuous():
    """A reference that is zero (every row within its float32 floor) is checked against that floor alone."""
    ref = torch.zeros(3, 4)
    ref[1, 2] = 1e-9
    floor = Floor(0.0, 1e-6)
    check_close("dq", torch.full((3, 4), 5e-7), ref, ref.clone(), floor=floor)
    with pytest.raises(AssertionError, match="bound"):
        check_close("dq", torch.full((3, 4), 5e-6), ref, ref.clone(), floor=floor)


def test_zero_row_floor_only_in_zero_rows():
    """The float32 floor widens rows whose reference is near zero, and no other."""
    ref = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    lowp = ref + torch.tensor([[0.0, 0.0], [1e-3, 0.0]])
    floor = Floor(0.0, 1e-2)
    check_close("dq", ref + torch.tensor([[5e-3, 0.0], [0.0, 0.0]]), ref, lowp, floor=floor)
    with pytest.raises(AssertionError, match="bound"):
        check_close("dq", ref + torch.tensor([[0.0, 0.0], [5e-3, 0.0]]), ref, lowp, floor=floor)


def test_ulp_term_only_for_small_tensors():
    """One ulp of the largest entry is added to low-precision tensors of at most SMALL_TENSOR entries only."""
    small = torch.linspace(-1, 1, SMALL_TENSOR)
    large = torch.linspace(-1, 1, SMALL_TENSOR + 1)
    ulp = torch.finfo(FP16).eps * 2.0 ** math.floor(math.log2(1.0))
    assert rule_bound(small, small, FP16) == pytest.approx(1e-5 + ulp)
    assert rule_bound(large, large, FP16) == pytest.approx(1e-5)
    assert rule_bound(small, small, torch.float32) == pytest.approx(1e-5)


def test_atol_is_relative_for_tiny_tensors():
    """Below max|ref| = 1 the rule's 1e-5 scales with the reference, so that tiny tensors can still be tested."""
    tiny = torch.full((SMALL_TENSOR + 1,), 4e-6)
    assert rule_bound(tiny, tiny) == pytest.approx(4e-11)
    assert rule_bound(tiny * 1e6, tiny * 1e6) == pytest.approx(1e-5)
