"""Shared pytest configuration and helpers for the flash_attn_cuda tests.

Helpers live here (rather than in a package) so test modules can ``from conftest import ...``
under pytest's default import mode.
"""

import functools
import importlib.util
import itertools
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from flash_attn_cuda import _kernel_list
from flash_attn_cuda.plan import override_string, plan
from flash_attn_cuda.reference import attention_ref, dropout_keep_scale, visible_mask

# ---------------------------------------------------------------- shared constants
#
# The kernel head dims and dtypes come from the generated kernel list (csrc/generate.py), so a head dim
# or dtype added there reaches every test.

KERNEL_HEAD_DIMS = list(_kernel_list.HEAD_DIMS)

# The source tree's csrc/, where the generator and its lists live (absent next to an installed package's tests).
CSRC = Path(__file__).resolve().parent.parent / "csrc"


def load_generator():
    """csrc/generate.py as a module (its kernel list, op table and file layout), or a skip without csrc/."""
    if not (CSRC / "generate.py").is_file():
        pytest.skip("no csrc/ next to the tests")
    sys.path.insert(0, str(CSRC))
    try:
        spec = importlib.util.spec_from_file_location("flash_attn_generate", CSRC / "generate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(CSRC))
    return module


DTYPE_IDS = list(_kernel_list.DTYPES)
_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = [_TORCH_DTYPES[name] for name in DTYPE_IDS]
DTYPE_NAMES = dict(zip(DTYPES, DTYPE_IDS))
# Multiples of 8 that the op takes directly but that fill only part of a kernel head dim: 8 above each kernel
# head dim but the largest, and 8 (the smallest).
PARTIAL_HEAD_DIMS = [8] + [d + 8 for d in KERNEL_HEAD_DIMS[:-1]]


def kernel_head_dim(head_dim):
    """The kernel head dim that runs a call of this head dim (after the wrapper pads it to a multiple of 8)."""
    return next(d for d in KERNEL_HEAD_DIMS if d >= head_dim)


MARKERS = {
    "gpu": "needs a CUDA device; skipped when none is present",
    "exhaustive": "full configuration matrix; deselected unless --exhaustive or -m exhaustive",
    "multi_gpu": "needs more than one CUDA device; may skip even under --require-gpu",
}

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def require_fwd_bwd_kernels(head_dim, dtype, causal, variants=False):
    """Skips the calling test unless this build has the forward and backward kernels for the configuration
    (``variants``: those of calls with a window, softcap, ALiBi or dropout)."""
    import flash_attn_cuda

    if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True, variants=variants):
        pytest.skip(f"kernels for head_dim={head_dim} {dtype} causal={causal} variants={variants} not compiled")


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        default=False,
        help="also run tests marked 'exhaustive' (the full configuration matrix)",
    )
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=os.environ.get("FLASH_ATTN2_REQUIRE_GPU", "") not in ("", "0"),
        help="a GPU test that skips (no GPU, a kernel missing from the build, not enough memory) fails instead; "
        "also set by FLASH_ATTN2_REQUIRE_GPU=1",
    )


def pytest_configure(config):
    # pytest.ini registers the same markers; skip those already known to avoid duplicates.
    known = {line.split(":", 1)[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in known:
            config.addinivalue_line("markers", f"{name}: {text}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Under --require-gpu a skipped GPU test is a failure: a run that is meant to exercise the kernels must not
    # pass by skipping them. Tests that need more GPUs than a machine may have are marked multi_gpu and exempt.
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and item.config.getoption("--require-gpu")
        and item.get_closest_marker("gpu")
        and not item.get_closest_marker("multi_gpu")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under --require-gpu: {reason}"


def pytest_collection_modifyitems(config, items):
    # An explicit "-m ...exhaustive..." selection is honoured as is.
    if config.getoption("--exhaustive") or "exhaustive" in (config.getoption("markexpr") or ""):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("exhaustive") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def poison_allocator(device, nbytes=512 << 20):
    """Fill every free block of the CUDA caching allocator (current stream) with NaN.

    The op allocates its outputs itself, so they cannot be pre-filled; instead the memory they
    will be carved from is filled with NaN first, and any element the kernel forgets to write
    shows up as NaN. A single big NaN tensor is not enough: the allocator hands out the smallest
    cached block that fits, so the free remainders of segments holding live tensors (the inputs)
    would be picked first. Hence every free block is allocated at its exact size and filled,
    a fresh ``nbytes`` block and a few whole small-pool segments are added, and all of it is
    freed again. ``nbytes`` must exceed the total size of the outputs bigger than 1 MiB.
    """
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()  # drops wholly free segments: fewer blocks to fill
    stream = torch.cuda.current_stream(index).cuda_stream

    mib = 1 << 20  # requests up to 1 MiB use the small pool (2 MiB segments), larger ones not
    small, large = [], []
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) != index or segment["stream"] != stream:
            continue
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        (small if segment["segment_type"] == "small" else large).extend(free)
    # A small-pool block over 1 MiB can only be reached by requests of at most 1 MiB: cut it
    # into 1 MiB plus the remainder, requested after all exact-size requests so that each
    # request still lands on a block of exactly its size.
    over = [n for n in small if n > mib]
    sizes = large + [n for n in small if n <= mib] + [mib] * len(over) + [n - mib for n in over]
    # A new large segment with no leftover: requests over 10 MiB get a segment of their size
    # rounded up to 2 MiB (smaller ones share a 20 MiB segment).
    nbytes = max(nbytes, 16 * mib)
    sizes.append(-(-nbytes // (2 * mib)) * (2 * mib))
    sizes += [mib] * 16  # eight new small segments, each filled by two requests
    with torch.cuda.device(index):
        # All-ones bytes are NaN as float32, float16 and bfloat16 alike (a float32 NaN would
        # read as 0 in every other float16 slot). Block sizes are multiples of 512 bytes, so
        # int32 tensors can match them exactly.
        held = [torch.full((n // 4,), -1, dtype=torch.int32, device=device) for n in sizes]
    del held  # back to the cache, not the driver; stream order runs the fills first


def _max_abs_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def amax(t):
    return t.detach().abs().max().item() if t.numel() else 0.0


# ---------------------------------------------------------------- the correctness rule
#
# max|ours - ref| <= 2 * max|ref_lowp - ref| + atol, with ref the float32 reference on upcast inputs and ref_lowp the
# same computation in the input dtype. The 2 * max|ref_lowp - ref| stands for the rounding error of the input
# dtype. Each term added to it below is the size of an error the FlashAttention-2 arithmetic makes and ref_lowp
# does not, with the measurement that called for it; each applies only where its case holds, and no bound may
# stop discriminating (check_close asserts that at the reference's largest entry it is below half of it).
#
# - atol: 1e-5, relative where the reference is tiny (1e-5 * max|ref| below 1). An absolute 1e-5 exceeds the
#   whole of dq and dk when q, k and v are all scaled by 1e-3 (max|dq| about 4e-6), where it would pass zeros.
# - One ulp of the largest entry, for low-precision tensors of at most SMALL_TENSOR entries. ref_lowp can land
#   well under one rounding of the largest entry by luck when few entries decide the maximum, while the kernel
#   rounds P to the input dtype and its output once more. Measured on the CPU with the FlashAttention-2
#   arithmetic emulated in float64 (tools/checker_floors.py --draws 30 --seed 1, out and dv): without it, 26 of
#   13440 checks of tensors of at most 72 entries failed and 8 of 21840 larger ones, the largest of 1088 entries;
#   with it, none. The bound was 4096 entries until an H100 run failed test_bwd_gpu's
#   test_seqlens[sq17-sk17-64-causal-fp16] on dv (8704 entries) at 1.024 times the bound: emulated at that test's
#   shapes (--draws 2500 --seqlens 17 --head-dims 64,128 --batch 2 --heads 4, seeds 21 and 22), 1 of 40000 checks
#   of 8704 entries failed without it and none with it; at 17408 entries none of 40000 failed without it.
# - Rounded output (dq, dk; gradient_floors): D = rowsum(dO * O) reads the output rounded to the input dtype and
#   is computed apart from dP, so dS = P (dP - D) keeps that rounding where a few keys dominate a row. ref_lowp's
#   softmax backward forms dP and its row sum from the same rounded values, which cancel. Every
#   FlashAttention-2 backward computes D this way. Measured: on an H200, seqlen_q 1, seqlen_k 2, fp16, q and k
#   * 8.66, dq was 1.654e-2 off against a bound of 1.511e-2; a float32 emulation of the kernel's arithmetic
#   whose D reads the fp16 output gave the same error to 4 digits, and 7.8e-6 with D from the fp32 output. In a
#   second emulation (float64 with the kernel's roundings, on the CPU), test_bwd_gpu's
#   test_seqlens[sq1-sk17-256-causal-fp16] failed the plain rule in 0.09% of 20000 draws (0.01% with D from the
#   fp32 output), and seqlen_q 1 against seqlen_k 2 in 5.5% of 3000 (0.2%). The floor is sized from the
#   reference output rounded to the input dtype, never from the kernel's own output, so that a wrong forward
#   cannot widen it.
# - float32 rounding where the references give exact zeros (dq, dk; gradient_floors): when a row sees one key,
#   P = 1 and dP = D exactly, so both references give zeros there while the kernel's float32 dP and D differ by
#   their rounding. Applied only to rows whose reference is within that floor of zero.

SMALL_TENSOR = 16384


def one_ulp(ref, dtype):
    """The spacing of ``dtype`` at the largest finite |ref|: one rounding of a result of that size."""
    m = amax(ref[torch.isfinite(ref)])
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(m)) if m > 0 else 0.0


class Floor(NamedTuple):
    """What the bound of one tensor gains besides the plain rule: ``added`` (a number, or a tensor of the
    tensor's shape: per entry) everywhere, and ``zero_rows`` in the rows (all dims but the last) whose reference
    is within ``zero_rows`` of zero."""

    added: float | torch.Tensor = 0.0
    zero_rows: float = 0.0


def rule_bound(ref, ref_lowp, dtype=None):
    """The plain rule's bound, with the ulp term when ``dtype`` is a low-precision dtype and ``ref`` is small."""
    m = amax(ref)
    bound = 2 * _max_abs_diff(ref_lowp, ref) + 1e-5 * min(1.0, m)
    if dtype is not None and dtype != torch.float32 and ref.numel() <= SMALL_TENSOR:
        bound += one_ulp(ref, dtype)
    return bound


def check_close(name, ours, ref, ref_lowp, dtype=None, floor=None):
    """Assert the correctness rule (see above) on one tensor: max|ours - ref| <= rule_bound + floor, per entry.

    ``ref`` is the float32 reference, ``ref_lowp`` the same computation in the input dtype; ``dtype``, when
    ``ours`` has it, brings the ulp term of small tensors; ``floor`` a Floor. Entries where ``ref`` is +inf (the
    lse of rows that see no key) must be +inf in ``ours`` and are excluded from the numeric comparison. ``ours``
    must contain no NaN at all. The bound must discriminate: at the largest |ref| outside the zero rows, below
    half of it, unless the reference is zero there.
    """
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    n_nan = torch.isnan(ours).sum().item()
    assert n_nan == 0, f"{name}: {n_nan} NaN of {ours.numel()} entries"
    floor = floor or Floor()

    ref_inf = torch.isposinf(ref)
    if ref_inf.any():
        n_bad = (~torch.isposinf(ours[ref_inf])).sum().item()
        assert n_bad == 0, f"{name}: {n_bad} entries should be +inf (rows with no visible key)"
    finite = ~ref_inf
    ref64 = torch.where(finite, ref.double(), 0.0)
    lowp64 = torch.where(finite, ref_lowp.double(), 0.0)
    err = torch.where(finite, (ours.double() - ref64).abs(), 0.0)

    plain = rule_bound(ref64, lowp64, dtype if ours.dtype == dtype else None)
    bound = plain + (floor.added.double() if torch.is_tensor(floor.added) else floor.added) * torch.ones_like(err)
    zero = torch.zeros_like(err, dtype=torch.bool)
    if floor.zero_rows > 0 and ref.numel():
        zero = (ref64.abs().amax(-1, keepdim=True) <= floor.zero_rows).expand_as(err)
        bound = torch.where(zero, torch.clamp(bound, min=floor.zero_rows), bound)

    if err.numel():
        worst = (err - bound).argmax()
        assert bool((err <= bound).all()), (
            f"{name}: max|ours - ref| - bound is {(err - bound).flatten()[worst].item():.3e} at entry "
            f"{tuple(int(i) for i in torch.unravel_index(worst, err.shape))}: |ours - ref| = "
            f"{err.flatten()[worst].item():.3e} > bound {bound.flatten()[worst].item():.3e} "
            f"(max|ref_lowp - ref| = {_max_abs_diff(lowp64, ref64):.3e}, plain rule {plain:.3e})"
        )
    # The bound at the reference's largest entry (outside the zero rows) must be below half of it, so that zeros,
    # or a result off by the size of the reference, fail there. Per-entry terms are large only where the
    # reference makes them so, which is why the bound is taken at that entry rather than its maximum.
    live = (~zero & finite).flatten()
    if live.any():
        magnitude = torch.where(live, ref64.abs().flatten(), -1.0)
        top = magnitude.argmax()
        ref_top, bound_top = magnitude[top].item(), bound.flatten()[top].item()
        assert ref_top == 0 or bound_top < 0.5 * ref_top, (
            f"{name}: the check cannot discriminate: its bound {bound_top:.3e} at the largest |ref| = {ref_top:.3e} "
            f"is not below half of it, so even zeros would pass; choose inputs where the rule can fail"
        )


def fp32_cancellation_floor(q, k, v, dout, scale, rows):
    """{"dq": ..., "dk": ...}: the float32 rounding of dP and D, about 2^-24 sum_d |dO| |V| each, which leaves dq and
    dk nonzero where the references give exact zeros (every row sees one key). Scaled by softmax_scale and |K| into
    dq (a row that sees one key adds that key alone) or |Q| into dk (over up to ``rows`` query rows of random
    sign), with a factor 8 for the orders of summation."""
    if not q.numel() or not k.numel():
        return {"dq": 0.0, "dk": 0.0}
    group = q.shape[-2] // k.shape[-2]
    # max_i sum_d |dO_id| max_j |V_jd| bounds max_ij sum_d |dO_id V_jd| per query head.
    v_max = v.detach().float().abs().flatten(0, -3).amax(0).repeat_interleave(group, dim=0)
    dot = (dout.float().abs().flatten(0, -3) * v_max).sum(-1).max().item()
    base = 8 * 2.0**-24 * scale * dot
    return {"dq": base * amax(k), "dk": base * amax(q) * math.sqrt(max(rows, 1))}


def rounded_output_floors(attend, q, k, v, dout, scale, dropout=False):
    """(dq, dk) per-entry floors for D read from the output rounded to the input dtype.

    ``attend(q, k, v, upcast)`` is the reference, returning (out, lse); with ``dropout``, the call had dropout and
    ``attend(q, k, v, upcast, dropped=False)`` is the same reference without it. With the exact output O, D_i is
    off by delta_i = sum_d dO_id (round(O) - O)_id, so dS is off by -P_ij delta_i (the undropped P): dq_i by
    delta_i d lse_i / d q_i = delta_i scale sum_j P_ij k_j, and dk_j by scale sum_i delta_i P_ij q_i. The floors
    take delta_i at its size from the rounded reference output, sum_d |dO_id| |round(O) - O|_id, with |q_i| in dk
    (any signs), times 2 for what first order leaves.
    """
    if not q.numel() or not k.numel():
        return 0.0, 0.0
    undropped = functools.partial(attend, dropped=False) if dropout else attend
    dtype = q.dtype
    with torch.no_grad():
        ref_out, _ = attend(q.detach().float(), k.detach().float(), v.detach().float(), True)
        rounding = (ref_out.to(dtype).float() - ref_out).abs()
        # (..., rows, heads) to the LSE layout, (batch, heads, seqlen_q) or (heads, total_q).
        delta = (dout.float().abs() * rounding).sum(-1)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = undropped(qf, kf, vf, True)
    # Rows that see no key have no D.
    delta_lse = torch.where(torch.isfinite(lse), delta.transpose(-1, -2), 0.0)
    (dq,) = torch.autograd.grad(lse, qf, delta_lse, retain_graph=True)
    # dk_j = scale sum_i delta_i P_ij |q_i|: out is linear in V with weights P, so the gradient of
    # sum_i delta_i |q_i| . out_i by V is sum_i P_ij delta_i |q_i|. P does not depend on V, so where V's head dim
    # is not Q's, a stand-in V of Q's head dim carries the same weights.
    if vf.shape[-1] != qf.shape[-1]:
        vf = torch.zeros(*vf.shape[:-1], qf.shape[-1], device=vf.device).requires_grad_()
        out, _ = undropped(qf.detach(), kf.detach(), vf, True)
    weights = torch.where(torch.isfinite(lse).transpose(-1, -2)[..., None], delta[..., None] * qf.detach().abs(), 0.0)
    (dk,) = torch.autograd.grad(out, vf, weights)
    return 2 * dq.abs(), 2 * scale * dk


def gradient_floors(attend, q, k, v, dout, scale, rows, dropout_p=0.0):
    """{"dq": Floor, "dk": Floor} for a backward (see above). ``rows``: the most query rows that add into one
    key's dk (seqlen_q times the GQA group). With dropout, dP is dO V^T scaled by 1 / (1 - p), and the float32
    rounding floor grows by as much; ``attend`` then takes ``dropped=False`` for the reference without it."""
    fp32 = fp32_cancellation_floor(q, k, v, dout, scale, rows)
    dq, dk = rounded_output_floors(attend, q, k, v, dout, scale, dropout=dropout_p > 0)
    return {
        "dq": Floor(dq, fp32["dq"] * dropout_keep_scale(dropout_p)),
        "dk": Floor(dk, fp32["dk"] * dropout_keep_scale(dropout_p)),
    }


# The largest standard deviation of the logits (softmax_scale q k^T) at which the low-precision reference still
# judges the results: beyond it the rule's bound exceeds half of the result and check_close rejects the check as
# one that zeros would pass. Measured on the CPU with the reference rounded to the dtype standing in for the
# kernel: in bfloat16, logits of standard deviation 16 were judged and 25 and 36 were not; fp16, with three more
# mantissa bits, judged 36 (and 75 in an explicit example of the fuzz suite, on an H200).
LOGIT_STD = {torch.bfloat16: 12.0, torch.float16: 64.0}

# The fewest query rows, over a call's sequences and in expectation after dropout, that must see two keys or more
# for the rule to judge dq and dk (rows_on_two_keys). A varlen example of 459 causal queries on 2 keys (bfloat16,
# logits of standard deviation 0.5) has one such row, and its dk bound was 1.7x max|dk| on an H200: the
# low-precision reference's own error on one row's dP - D is as large as the result.
MIN_ROWS_ON_TWO_KEYS = 4


def rows_on_two_keys(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """How many query rows of one (sequence, head) see two keys or more (reference.visible_mask). dq and dk of a
    row that sees one key are zero, so with few such rows they are sums of a few terms each, about as small as the
    rounding of D = rowsum(dO O) that moves them, and the rule cannot judge them (see the design notes)."""
    return int((visible_mask(seqlen_q, seqlen_k, causal, window).sum(-1) >= 2).sum())


def check_results(names, ours, ref, lowp, dtype, floors=None):
    """check_close on each named tensor, with the ulp term of small tensors of ``dtype`` and ``floors[name]``
    (gradient_floors) where given."""
    floors = floors or {}
    for name, o, r, lp in zip(names, ours, ref, lowp):
        check_close(name, o, r, lp, dtype, floors.get(name))


# ---------------------------------------------------------------- inputs


@pytest.fixture
def seeded_exact_reference():
    """For GPU tests against the float32 reference (pytestmark's usefixtures): the same draws on every run, so that
    no test passes or fails by the luck of its inputs, and the reference's matmuls in float32, not silently TF32."""
    torch.manual_seed(0)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def rand(*shape, dtype, device="cuda"):
    """Standard-normal values of ``shape`` in ``dtype``."""
    return torch.randn(shape, dtype=dtype, device=device)


def cu_seqlens(lengths, device="cuda"):
    """int32 (len(lengths) + 1,) sequence offsets: sequence i owns rows [cu[i], cu[i + 1])."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_attention(q, k, v, lens_q, lens_k, causal, softmax_scale=None, upcast=True):
    """The varlen reference: attention_ref on each sequence separately, packed again.

    q (total_q, nheads, d), k and v (total_k, nheads_k, d); returns out (total_q, nheads, d) and
    lse (nheads, total_q), as flash_attn_varlen_func does.
    """
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(
        itertools.pairwise([0, *itertools.accumulate(lens_q)]), itertools.pairwise([0, *itertools.accumulate(lens_k)])
    ):
        out, lse = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal, upcast=upcast)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# ---------------------------------------------------------------- plans
#
# A test that forces a path (flash_attn_cuda.plan.force_plan, or the ops' num_splits and plan_override
# arguments) asserts through torch.ops.flash_attn2.plan that a call with its sizes takes that path on this GPU,
# and that a choice the GPU or the head dim does not have is reported off.


def _sizes(q, k, lens, max_seqlens):
    """(batch, seqlen_q, seqlen_k) of a call, as the plan takes them."""
    if lens is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return len(lens[0]), *(max_seqlens or (max(lens[0], default=0), max(lens[1], default=0)))


# FLASH_ATTN2_MAX_SMEM: a whole run planned for a GPU with that much shared memory per block (flash_attn_cuda.plan);
# None when unset.
MAX_SMEM = int(os.environ["FLASH_ATTN2_MAX_SMEM"]) if os.environ.get("FLASH_ATTN2_MAX_SMEM") else None
SMEM_227KIB = 232448  # the Hopper kernels' tile sets
SMEM_99KIB = 101376  # the mma.sync kernels' set for sm_86, sm_89 and sm_120 (A10, L4, L40S, RTX 30xx to 50xx)


def device_plan(
    pass_, q, k, causal, *, deterministic=False, lens=None, max_seqlens=None, num_splits=0, variants=None, **choices
):
    """The plan of one pass of a call with q and k on the current GPU and this build, under
    ``force_plan(num_splits, **choices)``. Dense q (batch, seqlen_q, nheads, head_dim); varlen q
    (total_q, nheads, head_dim) with ``lens`` = (lens_q, lens_k), and the call's (max_seqlen_q, max_seqlen_k)
    if not the maxima of the lengths. ``variants``: the call's window_size, alibi, dropout and softcap, as
    flash_attn_cuda.plan.plan takes them."""
    head_dim = -(-q.shape[-1] // 8) * 8  # as padded by the wrapper
    batch, seqlen_q, seqlen_k = _sizes(q, k, lens, max_seqlens)
    return plan(
        pass_,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=q.shape[-2],
        nheads_k=k.shape[-2],
        head_dim=head_dim,
        causal=causal,
        deterministic=deterministic,
        varlen=lens is not None,
        num_splits=num_splits,
        override=override_string(**choices),
        dtype=q.dtype,
        **(variants or {}),
    )


def variants_kernel(plain, deterministic):
    """The kernel family that a call with attention variants runs, from ``plain``, the plan of the same call
    without them: the same one, except that a deterministic backward on the Hopper warp-specialized kernel, which
    has no variants, runs the mma.sync one."""
    if deterministic and plain.pass_ == "bwd" and plain.warp_specialized:
        return "mma_sync"
    return plain.kernel


def check_forced_plans(
    q, k, causal, force, *, deterministic=False, lens=None, max_seqlens=None, passes=("fwd", "bwd"), variants=None
):
    """Asserts that calls with q and k (and ``lens``, ``max_seqlens`` and ``variants`` as in device_plan) under
    ``force_plan(**force)`` take each forced choice where it applies, and report it off where it does not
    (another head dim, a GPU without the Hopper kernels, deterministic mode, varlen). Returns {pass: plan}, or
    {} for a call with nothing to compute (no query or no key: no kernel runs)."""
    force = dict(force)
    sizes = _sizes(q, k, lens, max_seqlens)
    if 0 in (*sizes, q.shape[-2], k.shape[-2]):
        return {}
    num_splits = force.pop("num_splits", 0)
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    kernel_dim = kernel_head_dim(q.shape[-1])
    plans = {}
    for pass_ in passes:
        p = device_plan(
            pass_,
            q,
            k,
            causal,
            deterministic=deterministic and pass_ == "bwd",
            lens=lens,
            max_seqlens=max_seqlens,
            num_splits=num_splits,
            variants=variants,
            **force,
        )
        plans[pass_] = p
        assert p.pass_ == pass_, p
        # Under a shared-memory limit below the Hopper kernels' 227 KiB (max_smem, or FLASH_ATTN2_MAX_SMEM for the
        # whole run), the mma.sync kernels run whatever the forced family.
        limits = [x for x in (force.get("max_smem"), MAX_SMEM) if x]
        if "kernel" in force and not (deterministic and pass_ == "bwd"):
            hopper_fits = not limits or min(limits) >= SMEM_227KIB
            assert p.kernel == (force["kernel"] if hopper_fits else "mma_sync"), p
        if limits:
            assert p.smem <= min(limits) and p.tile_budget <= min(limits), p
        hopper = p.kernel == "wgmma"
        if pass_ == "fwd":
            if num_splits:
                assert p.num_splits == (num_splits if lens is None else 1), p
            # The short-key tiles (launch/tile_size.h): the other Hopper kernel's at head dim 128, and under a causal
            # mask at head dims 64 and 256 the warp-specialized kernel's own (ws_short_tile, by default up to 2048
            # and 1024 keys: plan.cpp, fwd_ws_short_keys_max_causal), which at head dim 256 also takes every
            # dropout call (the 80-key tile cannot drop).
            dropout_short = kernel_dim == 256 and bool((variants or {}).get("dropout"))
            own_short = kernel_dim in (64, 256) and p.causal or dropout_short
            own_short_keys = 2048 if kernel_dim == 64 else 1024
            if "short_keys" in force:
                expected = force["short_keys"] and hopper and (kernel_dim == 128 or (own_short and p.warp_specialized))
                assert p.short_key_tile == bool(expected), p
            if "ws" in force:
                short = force.get("short_keys")
                ws_short = own_short and (dropout_short or sizes[2] <= own_short_keys if short is None else bool(short))
                ws_rows = 128 if kernel_dim > 64 or ws_short else 192  # every head dim has one (ws_tile)
                serves = (
                    hopper
                    and lens is None
                    and q.shape[-3] > ws_rows - 64
                    and not p.variants
                    and p.num_splits == 1
                    and p.gqa_pack == 1
                    and (not short or own_short)
                    and (ws_short or not dropout_short)
                )
                assert p.warp_specialized == bool(force["ws"] and serves), p
            elif not hopper:
                assert not p.warp_specialized, p
            continue
        if "stagger" in force:
            # The wide kernel's plain non-causal form (head dims above 128); in deterministic mode only where every
            # key block of a sequence fits the SMs at once.
            staggers = hopper and kernel_dim > 128 and not p.causal and not p.variants
            if deterministic:
                sms = torch.cuda.get_device_properties(q.device).multi_processor_count
                staggers = staggers and math.ceil(sizes[2] / p.block_n) <= sms
            assert p.staggered == bool(force["stagger"] and staggers), p
        # A packed seqlen_q == 1 call has no GQA left.
        grouped = nheads != nheads_k and p.gqa_pack == 1
        if "gqa_walk" in force:
            walk = bool(force["gqa_walk"]) and hopper and grouped
            assert p.heads_per_cta == (nheads // nheads_k if walk else 1), p
            assert p.dkv_fp32_slices == (grouped and not walk), p
        if deterministic:
            # Deterministic mode runs the kernels whose key blocks add into dQ in a fixed order, whatever else is
            # forced: the mma.sync backward, or on Hopper the warp-specialized one (plain calls at head dims 64 and
            # 128) and the wide one (head dims 160 to 256).
            if hopper:
                assert p.warp_specialized == (kernel_dim <= 128), p
                assert kernel_dim in (64, 128) or kernel_dim >= 160, p
                assert p.key_blocks_per_cta == 1 and not p.short_query_tile and p.gqa_pack == 1, p
            continue
        if "ws" in force:
            # The warp-specialized backward: plain calls at head dims 64 and 128 (launch/tile_size.h: ws_tile), not on
            # the short-query tile; one key block per tile.
            serves = (
                hopper and kernel_dim in (64, 128) and not p.variants and p.gqa_pack == 1 and not p.short_query_tile
            )
            assert p.warp_specialized == bool(force["ws"] and serves), p
        elif "key_blocks" in force:
            assert not p.warp_specialized, p  # a forced key-block walk is the narrow kernel's
        if "key_blocks" in force:
            walks = hopper and kernel_dim <= 128 and not p.warp_specialized
            assert p.key_blocks_per_cta == (force["key_blocks"] if walks else 1), p
        if "short_queries" in force:
            assert p.short_query_tile == bool(force["short_queries"] and hopper and kernel_dim == 128), p
            if p.short_query_tile:
                assert p.block_m == 16, p
    return plans


# ---------------------------------------------------------------- attention variants
#
# Window, softcap, ALiBi and dropout, as flash_attn_func takes them. The reference is attention_ref with the same
# keyword arguments.


def varlen_attention_ref(
    q,
    k,
    v,
    lens_q,
    lens_k,
    softmax_scale=None,
    causal=False,
    upcast=True,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_masks=None,
    learnable_sink=None,
):
    """varlen_attention with the variant arguments of attention_ref: each sequence on its own, packed again.

    alibi_slopes: (nheads,) for every sequence, or (num_sequences, nheads), row b for sequence b.
    dropout_masks: None, or one bool keep mask (nheads, len_q, len_k) per sequence
    (flash_attn_cuda.dropout.varlen_keep_mask). learnable_sink: None, or the (nheads,) sink logits that every
    sequence shares. Returns out (total_q, nheads, d_v) and lse (nheads, total_q).
    """
    outs, lses = [], []
    bounds = zip(
        itertools.pairwise([0, *itertools.accumulate(lens_q)]), itertools.pairwise([0, *itertools.accumulate(lens_k)])
    )
    for b, ((q0, q1), (k0, k1)) in enumerate(bounds):
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b : b + 1]
        mask = dropout_masks[b][None] if dropout_masks is not None else None
        out, lse = attention_ref(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            softmax_scale,
            causal,
            upcast=upcast,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            dropout_p=dropout_p,
            dropout_mask=mask,
            learnable_sink=learnable_sink,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
