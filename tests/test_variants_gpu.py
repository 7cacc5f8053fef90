"""Attention variants on a CUDA device: sliding windows, softcap, ALiBi and dropout, forward and backward.

Every check runs a call on NaN-poisoned memory and applies the correctness rule of conftest.check_results to
out, lse, dq, dk and dv against attention_ref with the same variant arguments, in float32 on upcast inputs (ref)
and in the input dtype (ref_lowp); dq and dk get conftest's gradient floors. Dropout runs are compared with the
reference under the keep mask that flash_attn_cuda.dropout derives from the call's rng_state: either an
rng_state of our own passed to torch.ops.flash_attn2.* directly, or the one the public function draws, found
again by seeding torch's generator and drawing as it does (see draw_rng_state). Apart from that comparison,
which needs the kernels to drop what keep_mask drops, each pass's own keep decisions are read back from its
results (V the identity in the forward, a one-hot dO in the backward) and compared with keep_mask entry for entry.

The default run covers every variant family at every kernel head dim, odd and unequal lengths both ways, lengths
of 2 and 5, rows that see no key, GQA/MQA and seqlen_q == 1, both dtypes, and both kernel families (kernel=mma_sync
forced, and the default, which is the warpgroup-MMA kernel on Hopper), strided q, k, v and dout, plus the dropout
machinery (the kernels' masks, S_dmask, seeding, CUDA graphs, torch.compile, TorchScript, opcheck) and argument
validation. ``--exhaustive`` adds the cross products. Configurations whose kernels were not compiled are skipped.
"""

import dataclasses
import itertools
import math

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    KERNEL_HEAD_DIMS,
    MAX_SMEM,
    SMEM_99KIB,
    SMEM_227KIB,
    Floor,
    check_forced_plans,
    check_results,
    cu_seqlens,
    device_plan,
    gradient_floors,
    one_ulp,
    poison_allocator,
    rand,
    require_fwd_bwd_kernels,
    requires_gpu,
    variants_kernel,
    varlen_attention_ref,
)

import flash_attn_cuda
from flash_attn_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn_cuda.dropout import keep_mask, varlen_keep_mask
from flash_attn_cuda.plan import force_plan, override_string, plan
from flash_attn_cuda.reference import (
    attention_probs,
    attention_ref,
    dropout_keep_scale,
    effective_dropout_p,
    visible_mask,
)

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

ops = torch.ops.flash_attn2


# ---------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One combination of the variant arguments of flash_attn_func.

    alibi: None, "heads" (the paper's geometric (nheads,) slopes) or "batch_heads" (random (batch, nheads)
    slopes). gain: q and k are multiplied by it (a power of two, so exactly) for large-magnitude scores; in bf16 by
    at most BF16_MAX_GAIN (input_gain).
    """

    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None
    dropout_p: float = 0.0
    gain: float = 1.0


V = Variant
VARIANTS = {
    # Windows. With seqlen_q > seqlen_k, (0, 0) and right-bounded windows leave the first rows with no key.
    "win-0-0": V(window=(0, 0)),
    "win-left": V(window=(37, -1)),
    "win-right": V(window=(-1, 19)),
    "win-both": V(window=(50, 30)),
    "win-wide": V(window=(1000, 1000)),  # wider than every sequence: full attention through the masked kernel
    "causal-left": V(causal=True, window=(45, -1)),
    "causal-right-ignored": V(causal=True, window=(45, 10)),  # causal bounds the right side at 0
    # Softcap: a mild one, and a tight one on large scores (tanh saturates). The gain of 4 (score standard deviation
    # 16, 8 softcaps) rather than 8 (64): the rule cannot judge dq and dk at gain 8 with few keys, even in fp16
    # (H200: fp16 seqlens 2 x 2 and 2 x 5, head dim 128, bounds at 1.0 and 0.7 of max|ref|), because the
    # low-precision reference's tanh' (1 - y^2 of a y rounded next to +-1) is rounding noise for nearly every
    # score while the true dq and dk come from the few scores near zero. bf16 takes less (input_gain).
    "softcap30": V(softcap=30.0),
    "softcap2-big": V(softcap=2.0, gain=4.0),
    # ALiBi: per-head slopes, and per-sequence-and-head slopes under causal.
    "alibi-h": V(alibi="heads"),
    "alibi-bh-causal": V(causal=True, alibi="batch_heads"),
    # Everything together.
    "combo": V(window=(64, 16), softcap=20.0, alibi="batch_heads"),
    "combo-causal": V(causal=True, window=(48, -1), softcap=10.0, alibi="heads"),
    "dropout": V(dropout_p=0.17),
    "dropout-combo": V(causal=True, window=(48, -1), softcap=10.0, alibi="batch_heads", dropout_p=0.3),
}

# One representative of each family for the head-dim sweep.
FAMILIES = {
    "window": V(window=(32, 8)),
    "softcap": V(softcap=5.0, gain=2.0),
    "alibi": V(alibi="batch_heads"),
    "combo": V(causal=True, window=(40, -1), softcap=15.0, alibi="heads"),
    "dropout": V(dropout_p=0.2),
    "dropout-combo": V(window=(24, 40), softcap=8.0, alibi="batch_heads", dropout_p=0.25),
}

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim): odd, unequal lengths both ways, one query row
# (the decode path, which packs the query heads of a group as rows of one head) and one key; MHA, GQA and MQA.
SHAPES = [
    (2, 113, 203, 6, 2, 64),
    (2, 203, 113, 4, 1, 128),
    (3, 1, 257, 8, 2, 256),
    (2, 257, 1, 4, 4, 96),
]

# (dtype, kernel) pairs: each test matrix takes one pair per dtype, and the head-dim sweep takes the other two, so
# both dtypes meet both kernel families. "default" is what the plan picks (the warpgroup-MMA kernels on Hopper),
# "mma_sync" forces the kernels that Ampere runs.
PAIRS = [(torch.float16, "default"), (torch.bfloat16, "mma_sync")]
OTHER_PAIRS = [(torch.bfloat16, "default"), (torch.float16, "mma_sync")]
ALL_PAIRS = PAIRS + OTHER_PAIRS


def pair_id(pair):
    dtype, kernel = pair
    return f"{dict(zip(DTYPES, DTYPE_IDS)).get(dtype, str(dtype))}-{kernel}"


def kernel_force(kernel):
    return {} if kernel == "default" else {"kernel": kernel}


def shape_id(shape):
    b, sq, sk, h, hk, d = shape
    return f"b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}"


def require_kernels(head_dim, dtype):
    """Skips unless every mask is compiled: calls with variants run the variants kernels, plain ones (a window of
    (-1, 0), say, which is causal) the plain masked or unmasked kernels."""
    require_fwd_bwd_kernels(head_dim, dtype, False)
    require_fwd_bwd_kernels(head_dim, dtype, True)
    if not flash_attn_cuda.kernel_available(head_dim, dtype, True, backward=True, variants=True):
        pytest.skip(f"variants kernels for head_dim={head_dim} {dtype} not compiled")


def alibi_slopes(kind, batch, nheads, device="cuda"):
    """fp32 ALiBi slopes: None, the geometric 2^(-8 i / nheads) (i = 1..nheads) of the ALiBi paper, or random
    per-(batch, head) slopes in [0, 0.5)."""
    if kind is None:
        return None
    if kind == "heads":
        return torch.tensor(
            [2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)], dtype=torch.float32, device=device
        )
    assert kind == "batch_heads", kind
    return torch.rand(batch, nheads, dtype=torch.float32, device=device) * 0.5


def draw_rng_state(device):
    """An rng_state drawn exactly as the public functions draw theirs (SPEC): after torch.manual_seed(s), this
    returns the rng_state that their next call uses."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=device)


def op_variant_args(variant, slopes, rng_state):
    """The six trailing variant arguments of the ops."""
    left, right = variant.window
    return (left, right, variant.softcap, slopes, variant.dropout_p, rng_state if variant.dropout_p else None)


def func_variant_kwargs(variant, slopes):
    return dict(
        dropout_p=variant.dropout_p,
        causal=variant.causal,
        window_size=variant.window,
        softcap=variant.softcap,
        alibi_slopes=slopes,
    )


def ref_variant_kwargs(variant, slopes):
    return dict(window_size=variant.window, softcap=variant.softcap, alibi_slopes=slopes)


def reference_with_grads(attend, q, k, v, dout, upcast):
    """(out, lse, dq, dk, dv) of the reference ``attend(q, k, v, upcast)`` and autograd through it."""
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, upcast)
    grads = torch.autograd.grad(out, leaves, dout.float() if upcast else dout)
    return (out.detach(), lse.detach(), *grads)


# The largest gain of bf16 inputs: q and k * 2 give scores of standard deviation 4 (2 softcaps of softcap2-big, whose
# tanh still saturates). The rule cannot judge larger bf16 scores under a tight softcap: at gain 4 (deviation 16),
# seqlen_q 1023 against seqlen_k 17 and head dim 256, dk's rounded-output floor, which sums |q_i| over all 1023 rows
# without the tanh' that shrinks the true dk, was 0.75 of max|ref| on the CPU (0.51 at head dim 128), and lengths
# 5 x 2 at head dim 256 were at 0.29; at gain 2 the worst of the exhaustive bf16 softcap2-big cases is 0.30.
BF16_MAX_GAIN = 2.0


def input_gain(variant, dtype):
    """The gain of q and k for ``variant`` in ``dtype``: variant.gain, at most BF16_MAX_GAIN in bf16."""
    return min(variant.gain, BF16_MAX_GAIN) if dtype == torch.bfloat16 else variant.gain


def make_inputs(b, sq, sk, h, hk, d, dtype, gain=1.0):
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)
    if gain != 1.0:
        q, k = q * gain, k * gain
    return q, k, v


# ---------------------------------------------------------------- plans


def check_variant_plans(q, k, variant, slopes, force, *, deterministic=False, lens=None):
    """conftest.check_forced_plans for the call's sizes, then the plans of the call itself (flash_attn_cuda.plan.plan
    with its window, ALiBi and dropout): each pass keeps the kernel family of the plain call, forced or default, so
    that the default runs cover the warpgroup-MMA kernels on Hopper; forced key splits hold unless dropout rules
    them out. Returns {pass: plan of the call}, or {} for a call with nothing to compute."""
    plain = check_forced_plans(q, k, variant.causal, force, deterministic=deterministic, lens=lens)
    if not plain:
        return {}
    choices = dict(force)
    num_splits = choices.pop("num_splits", 0)
    variants = dict(
        window_size=variant.window, alibi=slopes is not None, dropout=variant.dropout_p > 0, softcap=variant.softcap
    )
    plans = {}
    for pass_ in ("fwd", "bwd"):
        p = device_plan(
            pass_,
            q,
            k,
            variant.causal,
            deterministic=deterministic and pass_ == "bwd",
            lens=lens,
            num_splits=num_splits,
            variants=variants,
            **choices,
        )
        assert p.kernel == variants_kernel(plain[pass_], deterministic), (p, plain[pass_])
        plans[pass_] = p
    if num_splits and lens is None and not variant.dropout_p:
        assert plans["fwd"].num_splits == num_splits, plans["fwd"]
    return plans


# ---------------------------------------------------------------- dense runner


def run_dense(
    q,
    k,
    v,
    variant,
    *,
    slopes=None,
    force=None,
    deterministic=False,
    softmax_scale=None,
    via=None,
    seed=1234,
    rng_state=None,
    dout=None,
):
    """Forward and backward of one dense call, checked against the reference. Returns a dict of the results.

    via="op": torch.ops.flash_attn2.fwd / bwd with the forced choices as num_splits and plan_override, and for
    dropout an rng_state of our own (``rng_state``, or one drawn here). via="func": flash_attn_func under
    force_plan, gradients by autograd; with dropout the call runs right after torch.manual_seed(seed), and the
    reference uses the rng_state that seed gives (draw_rng_state). Default: "op" with dropout, else "func".
    dout: the gradient of out (any layout); default fresh random values shaped like q.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    via = via or ("op" if variant.dropout_p else "func")
    force = dict(force or {})
    plans = check_variant_plans(q, k, variant, slopes, force, deterministic=deterministic)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    dout = torch.randn_like(q) if dout is None else dout
    s_dmask = None
    if via == "op":
        if variant.dropout_p and rng_state is None:
            rng_state = draw_rng_state(q.device)
        override = override_string(**{n: x for n, x in force.items() if n != "num_splits"})
        extra = op_variant_args(variant, slopes, rng_state)
        poison_allocator(q.device)
        out, lse = ops.fwd(q, k, v, scale, variant.causal, deterministic, force.get("num_splits", 0), override, *extra)
        poison_allocator(q.device)
        dq, dk, dv, _ = ops.bwd(dout, q, k, v, out, lse, scale, variant.causal, deterministic, override, *extra)
    else:
        if variant.dropout_p:
            torch.manual_seed(seed)
            rng_state = draw_rng_state(q.device)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        poison_allocator(q.device)
        torch.manual_seed(seed)
        with force_plan(**force):
            out, lse, s_dmask = flash_attn_func(
                *leaves,
                softmax_scale=softmax_scale,
                deterministic=deterministic,
                return_attn_probs=True,
                **func_variant_kwargs(variant, slopes),
            )
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        assert (s_dmask is None) == (variant.dropout_p == 0.0)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    mask = None
    if variant.dropout_p:
        mask = keep_mask(rng_state, variant.dropout_p, b, h, sq, sk).to(q.device)
        assert mask.shape == (b, h, sq, sk) and mask.dtype == torch.bool

    def attend(q, k, v, upcast, dropped=True):
        return attention_ref(
            q,
            k,
            v,
            softmax_scale,
            variant.causal,
            upcast=upcast,
            dropout_p=variant.dropout_p if dropped else 0.0,
            dropout_mask=mask if dropped else None,
            **ref_variant_kwargs(variant, slopes),
        )

    ref = reference_with_grads(attend, q, k, v, dout, upcast=True)
    lowp = reference_with_grads(attend, q, k, v, dout, upcast=False)
    floors = gradient_floors(attend, q, k, v, dout, abs(scale), sq * (h // hk), variant.dropout_p)
    check_results(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, lowp, q.dtype, floors)
    return {
        "out": out,
        "lse": lse,
        "grads": (dq, dk, dv),
        "plans": plans,
        "rng_state": rng_state,
        "mask": mask,
        "s_dmask": s_dmask,
    }


def check_shape_variant(shape, variant, dtype, kernel, force=None, **kwargs):
    """run_dense on fresh inputs of ``shape`` (b, sq, sk, h, hk, d), with the kernel family forced (or not) on top
    of ``force``."""
    b, sq, sk, h, hk, d = shape
    require_kernels(d, dtype)
    q, k, v = make_inputs(b, sq, sk, h, hk, d, dtype, input_gain(variant, dtype))
    return run_dense(
        q,
        k,
        v,
        variant,
        slopes=alibi_slopes(variant.alibi, b, h),
        force={**(force or {}), **kernel_force(kernel)},
        **kwargs,
    )


# ---------------------------------------------------------------- dense: default matrix


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants(name, shape, pair):
    """Every variant on odd and unequal lengths both ways, a single query row (GQA decode packing) and a single
    key, with MHA, GQA and MQA."""
    check_shape_variant(shape, VARIANTS[name], *pair)


@pytest.mark.parametrize("pair", OTHER_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_variant_head_dims(family, head_dim, pair):
    """Each variant family at every kernel head dim, on lengths that cross key and query blocks."""
    dtype, kernel = pair
    shape = (2, 97, 161, 6, 2, head_dim) if kernel == "default" else (2, 161, 97, 4, 1, head_dim)
    check_shape_variant(shape, FAMILIES[family], dtype, kernel)


# Lengths shorter than any tile, each way round: every row and key of the call sits in one partial block.
SHORT_SEQLENS = [(2, 5), (5, 2)]


def short_seqlen_cases():
    """One case per kernel head dim and pair of SHORT_SEQLENS: the variant, (dtype, kernel) and heads rotate so that
    the cases meet every variant, and each head dim both kernel families, at the cost of one small call each."""
    names = list(VARIANTS)
    heads = [(4, 4), (6, 2), (4, 1)]
    cases = []
    for i, (head_dim, (sq, sk)) in enumerate(itertools.product(KERNEL_HEAD_DIMS, SHORT_SEQLENS)):
        name, pair = names[i % len(names)], ALL_PAIRS[i % len(ALL_PAIRS)]
        h, hk = heads[i % len(heads)]
        case_id = f"d{head_dim}-sq{sq}-sk{sk}-{name}-{pair_id(pair)}"
        cases.append(pytest.param((2, sq, sk, h, hk, head_dim), name, pair, id=case_id))
    return cases


@pytest.mark.parametrize("shape, name, pair", short_seqlen_cases())
def test_short_seqlens_every_head_dim(shape, name, pair):
    """Two and five rows and keys, both ways round, at every kernel head dim."""
    check_shape_variant(shape, VARIANTS[name], *pair)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("scale", [0.05, -0.3])
def test_explicit_softmax_scale(scale, pair):
    """softcap and ALiBi apply after the scale; a negative scale (run as -q with |scale|) changes nothing."""
    check_shape_variant((2, 150, 201, 4, 2, 64), VARIANTS["combo"], *pair, softmax_scale=scale)


@pytest.mark.parametrize("kernel", ["default", "mma_sync"])
@pytest.mark.parametrize("gain", [8.0, 16.0])
@pytest.mark.parametrize(
    "variant",
    [
        V(softcap=2.0),
        V(softcap=30.0),
        V(alibi="heads"),
        V(causal=True, window=(70, -1), softcap=5.0, alibi="batch_heads"),
    ],
    ids=["softcap2", "softcap30", "alibi", "combo"],
)
def test_large_magnitude_inputs(variant, gain, kernel):
    """fp16 q and k scaled by 8 or 16: scores in the thousands before the softcap, no NaN or overflow anywhere
    (check_close rejects any NaN)."""
    variant = dataclasses.replace(variant, gain=gain)
    check_shape_variant((2, 129, 260, 4, 2, 128), variant, torch.float16, kernel)


# Plan choices that the Hopper kernels have (conftest.check_forced_plans asserts each where it applies and that it
# is off elsewhere), each with the variants together: split-KV forward (splits that see no visible key at all),
# short-key forward tile, short-query backward tile, GQA group walks and several key blocks per backward CTA.
HOPPER_PATHS = {
    "split3": ({"num_splits": 3}, (2, 17, 1023, 8, 2)),
    "short-keys": ({"short_keys": True}, (2, 113, 1023, 4, 4)),
    "regular-keys": ({"short_keys": False}, (2, 113, 300, 4, 4)),
    "short-queries": ({"short_queries": True, "key_blocks": 3, "gqa_walk": True}, (2, 113, 777, 6, 2)),
    "gqa-walk": ({"gqa_walk": True}, (2, 113, 777, 8, 2)),
    "no-gqa-walk": ({"gqa_walk": False}, (2, 257, 300, 8, 1)),
    "key-blocks2": ({"key_blocks": 2}, (1, 300, 200, 3, 3)),
}


# Each path with and without dropout, but for forced key splits: dropout never splits the keys (the plan keeps one
# split; test_plan_cpu checks it), so that pair would run the path it means to test only without dropout;
# test_dropout_decode_split runs a shape whose plain call splits.
FORCED_PATH_CASES = [
    pytest.param(path, dropout, id=f"{path}-{'dropout' if dropout else 'no-dropout'}")
    for path, (force, _) in HOPPER_PATHS.items()
    for dropout in (False, True)
    if not (dropout and "num_splits" in force)
]


@pytest.mark.parametrize("path, dropout", FORCED_PATH_CASES)
def test_forced_paths(path, dropout):
    force, (b, sq, sk, h, hk) = HOPPER_PATHS[path]
    require_kernels(128, torch.bfloat16)
    # No left window edge: under one, the Hopper backward keeps one key block per CTA whatever key_blocks says.
    variant = V(window=(-1, 50), softcap=20.0, alibi="batch_heads", dropout_p=0.2 if dropout else 0.0)
    q, k, v = make_inputs(b, sq, sk, h, hk, 128, torch.bfloat16)
    plans = run_dense(q, k, v, variant, slopes=alibi_slopes(variant.alibi, b, h), force=force)["plans"]
    bwd_plan = plans["bwd"]
    if "key_blocks" in force and bwd_plan.kernel == "wgmma":
        assert bwd_plan.key_blocks_per_cta == force["key_blocks"], bwd_plan


@pytest.mark.parametrize("head_dim", [*KERNEL_HEAD_DIMS, 200])
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("h, hk", [(6, 2), (3, 3)], ids=["gqa", "mha"])
def test_99kib_tile_set(h, hk, head_dim, dropout):
    # The variants kernels of the mma.sync tile set for 99 KiB GPUs, planned as on such a GPU (max_smem): head dim
    # 224's (and 200's) backward runs head dim 256's kernel there. GQA sums dK and dV in fp32 slices; equal heads
    # write them from the kernel, through K's and V's shared memory.
    require_kernels(-(-head_dim // 32) * 32, torch.bfloat16)
    if head_dim > 192:
        require_kernels(256, torch.bfloat16)
    b, sq, sk = 2, 113, 301
    variant = V(causal=True, window=(40, -1), softcap=20.0, alibi="batch_heads", dropout_p=0.2 if dropout else 0.0)
    q, k, v = make_inputs(b, sq, sk, h, hk, head_dim, torch.bfloat16)
    plans = run_dense(q, k, v, variant, slopes=alibi_slopes(variant.alibi, b, h), force={"max_smem": SMEM_99KIB})
    for p in plans["plans"].values():
        assert p.kernel == "mma_sync" and p.tile_budget == SMEM_99KIB and 0 < p.smem <= SMEM_99KIB, p


# The variants that the plain forward kernels take in a form of their own, when one is a call's only variant.
PLAIN_MODS = {"softcap": V(softcap=5.0, gain=2.0), "dropout": V(dropout_p=0.2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize(
    "mod, force",
    [
        pytest.param(mod, force, id=f"{mod}-{force_id}")
        for mod in PLAIN_MODS
        for force_id, force in (
            ("default", {}),
            ("mma_sync", {"kernel": "mma_sync"}),
            ("mma_sync-split3", {"kernel": "mma_sync", "num_splits": 3}),
            ("99kib", {"max_smem": SMEM_99KIB}),
        )
        if not (mod == "dropout" and "num_splits" in force)  # dropout never splits the keys (test_plan_cpu)
    ],
)
def test_softcap_or_dropout_alone_runs_a_plain_forward(mod, force, head_dim, causal, dtype):
    # A call whose one variant is softcap, or dropout, runs the plain forward kernels' form for it, with the call's
    # own mask: the mma.sync ones (both tile sets, split keys too for softcap), and by default on Hopper the
    # warp-specialized one where it serves the call, else the variants kernel. Its backward runs the variants
    # kernel, from that forward's output and LSE. GQA, odd lengths, seqlen_q below and above seqlen_k; on Hopper the
    # second shape has the query rows, keys (causal) and heads (no key splits) that the warp-specialized kernel
    # takes at every head dim (dropout at head dim 256 on its 64-key short-key tile: plan.cpp).
    variant = dataclasses.replace(PLAIN_MODS[mod], causal=causal)
    require_kernels(head_dim, dtype)
    warp_specialized = 0
    second = (2, 257, 2100, 28, 4) if force == {} else (1, 257, 130, 4, 4)
    for b, sq, sk, h, hk in ((2, 113, 301, 6, 2), second):
        q, k, v = make_inputs(b, sq, sk, h, hk, head_dim, dtype, gain=variant.gain)
        plans = run_dense(q, k, v, variant, force=force)["plans"]
        fwd = plans["fwd"]
        if fwd.kernel == "mma_sync":
            assert not fwd.variants and fwd.causal == causal, fwd
        else:
            assert fwd.variants != fwd.warp_specialized, fwd
            assert fwd.variants or fwd.causal == causal, fwd
            warp_specialized += fwd.warp_specialized
        if "num_splits" in force:
            assert fwd.num_splits == force["num_splits"], fwd
        assert plans["bwd"].variants, plans["bwd"]
    if fwd.kernel == "wgmma":
        assert warp_specialized > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [96, 160, 192, 224])
def test_dropout_alone_warp_specialized_head_dims(head_dim, causal):
    # The warp-specialized forward's dropout form at the head dims the test above leaves out: 96 (the 64 B
    # swizzle), 160 and 192 (96-key blocks, which need the draw's key offsets past 32) and 224 (64-key blocks). 257
    # query rows make three query blocks, the last one partial, over 2100 keys.
    require_kernels(head_dim, torch.bfloat16)
    variant = dataclasses.replace(PLAIN_MODS["dropout"], causal=causal)
    q, k, v = make_inputs(2, 257, 2100, 28, 4, head_dim, torch.bfloat16)
    fwd = run_dense(q, k, v, variant)["plans"]["fwd"]
    assert not fwd.variants and fwd.causal == causal, fwd
    if fwd.kernel == "wgmma":
        assert fwd.warp_specialized, fwd


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dropout_warp_specialized_tiles_without_keys(head_dim):
    # The warp-specialized forward's dropout form over tiles with no key block: under a causal mask with 700 query
    # rows over 130 keys (bottom-right aligned) the first query blocks see no key at all, and their rows give 0.
    # 24 heads give more tiles than a GPU has SMs, so a persistent CTA runs such tiles between others, whose
    # buffer rings (and draws) must carry on past them.
    require_kernels(head_dim, torch.bfloat16)
    variant = dataclasses.replace(PLAIN_MODS["dropout"], causal=True)
    q, k, v = make_inputs(2, 700, 130, 24, 8, head_dim, torch.bfloat16)
    fwd = run_dense(q, k, v, variant)["plans"]["fwd"]
    assert not fwd.variants, fwd
    if fwd.kernel == "wgmma":
        assert fwd.warp_specialized, fwd


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_split_kv_with_empty_splits(causal):
    """A narrow window over 4097 keys split 7 ways: most splits see no key of some rows, or of any row."""
    require_kernels(64, torch.bfloat16)
    q, k, v = make_inputs(2, 17, 4097, 4, 1, 64, torch.bfloat16)
    variant = V(causal=causal, window=(100, -1 if causal else 30), softcap=10.0, alibi="heads")
    plans = run_dense(q, k, v, variant, slopes=alibi_slopes("heads", 2, 4), force={"num_splits": 7})["plans"]
    assert plans["fwd"].num_splits == 7, plans["fwd"]


# ---------------------------------------------------------------- strided inputs and gradients


def strided(shape, dtype, layout, device="cuda"):
    """Fresh random values of ``shape`` (batch, seqlen, heads, head_dim) as a non-contiguous view that the ops take
    as it is (last dim contiguous, the other strides multiples of 8 elements, a 16-byte aligned start):

    - seq_major: (seqlen, batch, heads, head_dim) storage;
    - heads_major: (batch, heads, seqlen, head_dim) storage, the layout of scaled_dot_product_attention;
    - guard_bands: a slice of a NaN-filled buffer with rows before and after the sequence, an extra head and 24
      elements past head_dim;
    - every_other_row: the odd rows of a NaN-filled buffer of twice the length.

    In the NaN-filled layouts, a kernel that reads outside the view meets NaN, which no result may hold (0 * NaN is
    NaN too).
    """
    b, s, h, d = shape
    nan = float("nan")
    if layout == "seq_major":
        view = torch.empty(s, b, h, d, dtype=dtype, device=device).transpose(0, 1)
    elif layout == "heads_major":
        view = torch.empty(b, h, s, d, dtype=dtype, device=device).transpose(1, 2)
    elif layout == "guard_bands":
        view = torch.full((b, s + 8, h + 1, d + 24), nan, dtype=dtype, device=device)[:, 3 : 3 + s, :h, :d]
    elif layout == "every_other_row":
        view = torch.full((b, 2 * s, h, d), nan, dtype=dtype, device=device)[:, 1::2]
    else:
        raise ValueError(layout)
    view.copy_(torch.randn(shape, dtype=dtype, device=device))
    assert view.shape == shape and not view.is_contiguous(), layout
    return view


# (layout, via, variant, (dtype, kernel), shape): each layout through the ops (which read the views in place) and
# through flash_attn_func (which passes aligned views on uncopied, and whose backward gets the same views back from
# autograd), with the variants, dtypes and kernel families rotating. No heads_major case has a single key/value
# head, whose heads_major view would be contiguous.
STRIDED_INPUT_CASES = [
    ("seq_major", "op", "dropout-combo", PAIRS[0], (2, 113, 203, 6, 2, 64)),
    ("seq_major", "func", "combo-causal", PAIRS[1], (2, 203, 113, 4, 1, 128)),
    ("heads_major", "op", "combo", OTHER_PAIRS[0], (2, 203, 113, 4, 2, 128)),
    ("heads_major", "func", "dropout-combo", OTHER_PAIRS[1], (2, 113, 203, 6, 2, 64)),
    ("guard_bands", "op", "dropout", PAIRS[1], (2, 113, 203, 6, 2, 128)),
    ("guard_bands", "func", "alibi-bh-causal", PAIRS[0], (2, 203, 113, 4, 2, 64)),
]


@pytest.mark.parametrize(
    "layout, via, name, pair, shape",
    [pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}-{pair_id(case[3])}") for case in STRIDED_INPUT_CASES],
)
def test_strided_inputs(layout, via, name, pair, shape):
    """q, k and v as strided views in both passes."""
    dtype, kernel = pair
    b, sq, sk, h, hk, d = shape
    variant = VARIANTS[name]
    assert variant.gain == 1.0  # a gain would multiply the views into contiguous copies
    require_kernels(d, dtype)
    q = strided((b, sq, h, d), dtype, layout)
    k, v = strided((b, sk, hk, d), dtype, layout), strided((b, sk, hk, d), dtype, layout)
    run_dense(q, k, v, variant, slopes=alibi_slopes(variant.alibi, b, h), force=kernel_force(kernel), via=via)


# (layout, via, variant, (dtype, kernel), shape), rotating as STRIDED_INPUT_CASES.
STRIDED_DOUT_CASES = [
    ("heads_major", "op", "dropout-combo", PAIRS[0], (2, 113, 203, 6, 2, 64)),
    ("heads_major", "func", "combo", PAIRS[1], (2, 203, 113, 4, 1, 128)),
    ("guard_bands", "op", "combo-causal", OTHER_PAIRS[0], (2, 203, 113, 4, 1, 128)),
    ("guard_bands", "func", "dropout-combo", OTHER_PAIRS[1], (2, 113, 203, 6, 2, 64)),
    ("every_other_row", "op", "win-both", PAIRS[1], (2, 113, 203, 6, 2, 128)),
    ("every_other_row", "func", "dropout", PAIRS[0], (2, 203, 113, 4, 2, 64)),
]


@pytest.mark.parametrize(
    "layout, via, name, pair, shape",
    [pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}-{pair_id(case[3])}") for case in STRIDED_DOUT_CASES],
)
def test_noncontiguous_dout(layout, via, name, pair, shape):
    """dout a strided view: the backward op reads it in place, and the backward of flash_attn_func gets it from
    autograd."""
    dtype, kernel = pair
    b, sq, sk, h, hk, d = shape
    require_kernels(d, dtype)
    dout = strided((b, sq, h, d), dtype, layout)
    check_shape_variant(shape, VARIANTS[name], dtype, kernel, via=via, dout=dout)


# ---------------------------------------------------------------- deterministic backward


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["window", "window-dropout"])
def test_deterministic_backward_is_bitwise(dropout_p, head_dim):
    """deterministic=True: three runs (same seed) give bitwise-identical outputs and gradients, and they are
    right; the lengths are long enough for the default mode's dq atomics to land in varying orders. On Hopper,
    head dim 128 runs the mma.sync backward (the warp-specialized kernel has no variants), 256 the wide kernel."""
    require_kernels(head_dim, torch.bfloat16)
    variant = V(window=(256, 64), softcap=20.0, alibi="heads", dropout_p=dropout_p)
    q, k, v = make_inputs(2, 300, 1023, 8, 2, head_dim, torch.bfloat16)
    slopes = alibi_slopes("heads", 2, 8)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        torch.manual_seed(7)
        out = flash_attn_func(*leaves, deterministic=True, **func_variant_kwargs(variant, slopes))
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for other in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), name
    run_dense(q, k, v, variant, slopes=slopes, deterministic=True, via="func", seed=7)
    if dropout_p:
        run_dense(q, k, v, variant, slopes=slopes, deterministic=True, via="op")


# ---------------------------------------------------------------- varlen

# Lengths with empty, single-token and odd sequences, seqlen_q > seqlen_k and the reverse.
LENS_Q = [0, 1, 17, 113, 64, 300, 5]
LENS_K = [7, 0, 17, 200, 64, 129, 1]


def run_varlen(lens_q, lens_k, h, hk, d, dtype, variant, *, force=None, deterministic=False, via=None, seed=1234):
    """Forward and backward of one flash_attn_varlen_func / varlen op call against the reference run on each
    sequence (conftest.varlen_attention_ref); ALiBi (batch, nheads) slopes are per sequence. via as in
    run_dense. Returns a dict of the results."""
    q = rand(sum(lens_q), h, d, dtype=dtype)
    k, v = rand(sum(lens_k), hk, d, dtype=dtype), rand(sum(lens_k), hk, d, dtype=dtype)
    gain = input_gain(variant, dtype)
    if gain != 1.0:
        q, k = q * gain, k * gain
    slopes = alibi_slopes(variant.alibi, len(lens_q), h)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    max_q, max_k = max(lens_q), max(lens_k)
    via = via or ("op" if variant.dropout_p else "func")
    force = dict(force or {})
    check_variant_plans(q, k, variant, slopes, force, deterministic=deterministic, lens=(lens_q, lens_k))
    scale = d**-0.5
    dout = torch.randn_like(q)
    rng_state, s_dmask = None, None
    if via == "op":
        if variant.dropout_p:
            rng_state = draw_rng_state(q.device)
        override = override_string(**force)
        extra = op_variant_args(variant, slopes, rng_state)
        poison_allocator(q.device)
        out, lse = ops.varlen_fwd(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, variant.causal, deterministic, override, *extra
        )
        poison_allocator(q.device)
        dq, dk, dv, _ = ops.varlen_bwd(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, variant.causal, deterministic, override, *extra
        )
    else:
        if variant.dropout_p:
            torch.manual_seed(seed)
            rng_state = draw_rng_state(q.device)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        poison_allocator(q.device)
        torch.manual_seed(seed)
        with force_plan(**force):
            out, lse, s_dmask = flash_attn_varlen_func(
                *leaves,
                cu_q,
                cu_k,
                max_q,
                max_k,
                deterministic=deterministic,
                return_attn_probs=True,
                **func_variant_kwargs(variant, slopes),
            )
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        assert (s_dmask is None) == (variant.dropout_p == 0.0)
    assert lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32

    masks = None
    if variant.dropout_p:
        masks = [m.to(q.device) for m in varlen_keep_mask(rng_state, variant.dropout_p, h, lens_q, lens_k)]
        assert [tuple(m.shape) for m in masks] == [(h, lq, lk) for lq, lk in zip(lens_q, lens_k)]

    def attend(q, k, v, upcast, dropped=True):
        return varlen_attention_ref(
            q,
            k,
            v,
            lens_q,
            lens_k,
            scale,
            variant.causal,
            upcast,
            dropout_p=variant.dropout_p if dropped else 0.0,
            dropout_masks=masks if dropped else None,
            **ref_variant_kwargs(variant, slopes),
        )

    ref = reference_with_grads(attend, q, k, v, dout, upcast=True)
    lowp = reference_with_grads(attend, q, k, v, dout, upcast=False)
    floors = gradient_floors(attend, q, k, v, dout, scale, max(lens_q) * (h // hk), variant.dropout_p)
    check_results(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, lowp, dtype, floors)
    return {
        "q": q,
        "k": k,
        "slopes": slopes,
        "rng_state": rng_state,
        "masks": masks,
        "s_dmask": s_dmask,
        "grads": (dq, dk, dv),
    }


VARLEN_VARIANTS = [
    "win-0-0",
    "win-left",
    "win-right",
    "causal-left",
    "softcap2-big",
    "alibi-bh-causal",
    "combo",
    "combo-causal",
    "dropout",
    "dropout-combo",
]


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("name", VARLEN_VARIANTS)
def test_varlen_variants(name, pair):
    dtype, kernel = pair
    d = 64 if kernel == "default" else 128
    require_kernels(d, dtype)
    run_varlen(LENS_Q, LENS_K, 6, 2, d, dtype, VARIANTS[name], force=kernel_force(kernel))


@pytest.mark.parametrize("h, hk", [(4, 4), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize(
    "lens", [([1, 1, 1], [300, 1, 77]), ([1023, 1, 0], [0, 1, 1023])], ids=["decode", "long-short-empty"]
)
def test_varlen_variant_lengths(lens, h, hk):
    require_kernels(128, torch.bfloat16)
    run_varlen(*lens, h, hk, 128, torch.bfloat16, V(causal=True, window=(64, -1), softcap=10.0, alibi="batch_heads"))


# ---------------------------------------------------------------- packed functions


# The packed/unpacked comparisons are bitwise: deterministic backward, and the same seed for the dropout draw.
PACKED_VARIANT = V(window=(20, 5), softcap=15.0, alibi="batch_heads", dropout_p=0.2)


def packed_kwargs(slopes):
    return dict(deterministic=True, **func_variant_kwargs(PACKED_VARIANT, slopes))


def seeded(fn, *args, **kwargs):
    torch.manual_seed(99)
    return fn(*args, **kwargs)


def test_qkvpacked_passes_variants():
    require_kernels(64, torch.bfloat16)
    qkv = rand(2, 97, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    slopes = alibi_slopes("batch_heads", 2, 4)
    out_packed = seeded(flash_attn_qkvpacked_func, qkv, **packed_kwargs(slopes))
    out = seeded(flash_attn_func, q, k, v, **packed_kwargs(slopes))
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out_packed, (qkv,), dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(out, (q, k, v), dout), dim=2))
    # And the variants did take effect: not the plain attention.
    assert not torch.equal(out, flash_attn_func(q, k, v, deterministic=True))


def test_kvpacked_passes_variants():
    require_kernels(64, torch.bfloat16)
    q = rand(2, 61, 4, 64, dtype=torch.bfloat16).requires_grad_()
    kv = rand(2, 97, 2, 2, 64, dtype=torch.bfloat16).requires_grad_()
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    slopes = alibi_slopes("batch_heads", 2, 4)
    out_packed = seeded(flash_attn_kvpacked_func, q, kv, **packed_kwargs(slopes))
    out = seeded(flash_attn_func, q, k, v, **packed_kwargs(slopes))
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    dq_packed, dkv = torch.autograd.grad(out_packed, (q, kv), dout)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(dq_packed, dq) and torch.equal(dkv, torch.stack((dk, dv), dim=2))
    assert not torch.equal(out, flash_attn_func(q, k, v, deterministic=True))


def test_varlen_qkvpacked_passes_variants():
    require_kernels(64, torch.bfloat16)
    lens = [5, 0, 130, 64, 1]
    cu, total, max_len = cu_seqlens(lens), sum(lens), max(lens)
    qkv = rand(total, 3, 4, 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    slopes = alibi_slopes("batch_heads", len(lens), 4)
    out_packed = seeded(flash_attn_varlen_qkvpacked_func, qkv, cu, max_len, **packed_kwargs(slopes))
    out = seeded(flash_attn_varlen_func, q, k, v, cu, cu, max_len, max_len, **packed_kwargs(slopes))
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out_packed, (qkv,), dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(out, (q, k, v), dout), dim=1))


def test_varlen_kvpacked_passes_variants():
    require_kernels(64, torch.bfloat16)
    lens_q, lens_k = [5, 0, 130, 64, 1], [9, 3, 64, 130, 0]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = rand(sum(lens_q), 4, 64, dtype=torch.bfloat16).requires_grad_()
    kv = rand(sum(lens_k), 2, 2, 64, dtype=torch.bfloat16).requires_grad_()
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    slopes = alibi_slopes("batch_heads", len(lens_q), 4)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out_packed = seeded(flash_attn_varlen_kvpacked_func, q, kv, *args, **packed_kwargs(slopes))
    out = seeded(flash_attn_varlen_func, q, k, v, *args, **packed_kwargs(slopes))
    assert torch.equal(out_packed, out)
    dout = torch.randn_like(out)
    dq_packed, dkv = torch.autograd.grad(out_packed, (q, kv), dout)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(dq_packed, dq) and torch.equal(dkv, torch.stack((dk, dv), dim=1))


# ---------------------------------------------------------------- dropout: masks, seeds, graphs, compile


def round_up(n, m=128):
    return -(-n // m) * m


def keep_fraction_bound(n, p):
    """Six standard deviations of the kept fraction of n independent entries (and a floor for tiny n), p the
    dropout_p of the call (the kernels drop with effective_dropout_p(p))."""
    p = effective_dropout_p(p)
    return 6.0 * math.sqrt(p * (1.0 - p) / max(n, 1)) + 1e-3


def kept_fraction(p):
    """The fraction of entries a call of dropout_p keeps, in expectation."""
    return 1.0 - effective_dropout_p(p)


def reference_probs(q, k, causal, window, softcap, slopes, softmax_scale=None):
    """The undropped float32 softmax probabilities P (b, h, sq, sk) of the reference."""
    return attention_probs(q, k, softmax_scale, causal, window_size=window, softcap=softcap, alibi_slopes=slopes)


def check_s_dmask(region, pad, probs, keep, visible, dtype):
    """One sequence's S_dmask: ``region`` (h, sq, sk) its unpadded part, ``pad`` the rest of its padded slice,
    probs (float32) and keep (h, sq, sk), visible (sq, sk). Returns (kept, counted) for the keep fraction.

    The sign is checked where the float32 P is positive: an exact 0 (a score so far below the row's maximum that
    exp underflows) may carry either sign. A P that only rounds to zero in the dtype is negated before rounding,
    hence torch.signbit rather than < 0.
    """
    assert region.dtype == dtype
    assert (pad == 0).all(), "S_dmask padding must be zero"
    vis = visible.expand_as(keep)
    assert (region[~vis] == 0).all(), "S_dmask must be zero outside the attention mask"
    torch.testing.assert_close(region.abs().float()[vis], probs[vis], rtol=torch.finfo(dtype).eps, atol=1e-6)
    counted = vis & (probs > 0)
    dropped = torch.signbit(region)
    assert torch.equal(dropped[counted], ~keep[counted]), "S_dmask's dropped entries differ from dropout.keep_mask"
    return (~dropped[counted]).sum().item(), counted.sum().item()


DMASK_CASES = {
    "plain-p50": (V(dropout_p=0.5), (2, 129, 200, 4, 4, 64), torch.bfloat16),
    "combo-p17": (
        V(window=(64, 16), softcap=20.0, alibi="batch_heads", dropout_p=0.17),
        (2, 257, 300, 6, 2, 128),
        torch.float16,
    ),
    "causal-empty-rows-p30": (
        V(causal=True, window=(30, -1), alibi="heads", dropout_p=0.3),
        (2, 300, 129, 4, 1, 64),
        torch.bfloat16,
    ),
}


@pytest.mark.parametrize("case", list(DMASK_CASES))
def test_dropout_s_dmask_and_seed(case):
    """flash_attn_func with dropout: out, lse and gradients match the reference under the keep mask of the
    rng_state that torch.manual_seed(s) makes it draw; S_dmask carries P with exactly that mask's dropped entries
    negated, zeros elsewhere, and keeps 1 - p of the visible entries.

    S_dmask is computed on the host from that same keep mask, so this checks the wrapper (the rng_state it hands
    on, S_dmask's layout, padding and signs), not the kernels' decisions: test_kernel_dropout_mask reads those."""
    variant, (b, sq, sk, h, hk, d), dtype = DMASK_CASES[case]
    require_kernels(d, dtype)
    q, k, v = make_inputs(b, sq, sk, h, hk, d, dtype)
    slopes = alibi_slopes(variant.alibi, b, h)
    result = run_dense(q, k, v, variant, slopes=slopes, via="func", seed=31)
    s_dmask = result["s_dmask"]
    assert s_dmask.shape == (b, h, round_up(sq), round_up(sk))
    probs = reference_probs(q, k, variant.causal, variant.window, variant.softcap, slopes)
    visible = visible_mask(sq, sk, variant.causal, variant.window, q.device)
    kept = counted = 0
    for i in range(b):
        pad = s_dmask[i].clone()
        pad[:, :sq, :sk] = 0
        n_kept, n = check_s_dmask(s_dmask[i, :, :sq, :sk], pad, probs[i], result["mask"][i], visible, dtype)
        kept, counted = kept + n_kept, counted + n
    assert abs(kept / counted - kept_fraction(variant.dropout_p)) <= keep_fraction_bound(counted, variant.dropout_p)


def test_varlen_dropout_s_dmask_and_seed():
    """As test_dropout_s_dmask_and_seed, through flash_attn_varlen_func: the mask element of a sequence uses its
    index as the batch index and positions within the sequence."""
    require_kernels(64, torch.bfloat16)
    variant = V(window=(40, 10), softcap=10.0, alibi="batch_heads", dropout_p=0.3)
    h = 4
    result = run_varlen(LENS_Q, LENS_K, h, 2, 64, torch.bfloat16, variant, via="func", seed=77)
    s_dmask = result["s_dmask"]
    assert s_dmask.shape == (len(LENS_Q), h, round_up(max(LENS_Q)), round_up(max(LENS_K)))
    kept = counted = 0
    q0 = k0 = 0
    for i, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        slopes = result["slopes"][i : i + 1]
        probs = reference_probs(
            result["q"][None, q0 : q0 + lq],
            result["k"][None, k0 : k0 + lk],
            variant.causal,
            variant.window,
            variant.softcap,
            slopes,
        )[0]
        pad = s_dmask[i].clone()
        pad[:, :lq, :lk] = 0
        n_kept, n = check_s_dmask(
            s_dmask[i, :, :lq, :lk],
            pad,
            probs,
            result["masks"][i],
            visible_mask(lq, lk, variant.causal, variant.window, "cuda"),
            torch.bfloat16,
        )
        kept, counted = kept + n_kept, counted + n
        q0, k0 = q0 + lq, k0 + lk
    assert abs(kept / counted - kept_fraction(variant.dropout_p)) <= keep_fraction_bound(counted, variant.dropout_p)


# ---------------------------------------------------------------- dropout: the kernels' own keep decisions
#
# S_dmask is computed on the host from flash_attn_cuda.dropout.keep_mask, so it cannot show what the kernels drop.
# These tests read each pass's keep decisions back from its results and compare them, entry for entry, with
# keep_mask (varlen_keep_mask). s below is dropout_keep_scale(p) = 1 / (1 - p), the factor kept entries scale by:
#
# - forward: V is the identity on a block of head_dim keys of each sequence (its other rows zero), so column c of
#   out is P[:, c0 + c] * keep * s for the block's first key c0: exactly zero where the forward dropped the
#   entry, and nonzero where it kept it;
# - backward: dV = (P * keep * s)^T dO, so a one-hot dO whose column i * group + g picks query row r0 + i of
#   the g-th query head of each key/value head (group query heads per key/value head) makes column i * group + g of
#   dV that row as the backward regenerated it, read key-major.
#
# Blocks of keys (forward) and of query rows (backward) are observed one call at a time, with the same rng_state.
# q is halved, which keeps every visible probability of these shapes far above MASK_MIN_PROB; a kept entry then
# stays nonzero through every rounding, fp16's smallest subnormal being 2^-24.
MASK_Q_GAIN = 0.5
MASK_MIN_PROB = 2.0**-20


class MaskProbe:
    """One dropout call, dense or varlen, whose keep decisions are read back from the kernels.

    q, k: dense (batch, seqlen, heads, head_dim), or packed (total, heads, head_dim) with ``lens`` = (lens_q, lens_k).
    force: force_plan keywords. via: "op", the ops with an rng_state of our own, or "func", flash_attn_func and
    flash_attn_varlen_func under force_plan right after torch.manual_seed(seed), which makes them draw that same
    rng_state. Variants: window, causal and softcap (no ALiBi, whose biases would push far keys' probabilities
    below MASK_MIN_PROB).
    """

    def __init__(self, q, k, variant, force, lens=None, via="op", seed=2024):
        assert variant.dropout_p > 0 and variant.alibi is None and variant.gain == 1.0, variant
        self.q, self.k, self.variant, self.lens, self.via, self.seed = q, k, variant, lens, via, seed
        self.force = dict(force)
        self.scale = q.shape[-1] ** -0.5
        nheads = q.shape[-2]
        if lens is None:
            b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            self.lens_q, self.lens_k = [sq] * b, [sk] * b
        else:
            self.lens_q, self.lens_k = list(lens[0]), list(lens[1])
            self.cu_q, self.cu_k = cu_seqlens(self.lens_q, q.device), cu_seqlens(self.lens_k, q.device)
        # (first packed query row, seqlen_q, first packed key row, seqlen_k) of each sequence (dense: batch row).
        self.seqs = list(
            zip(
                itertools.accumulate([0, *self.lens_q]),
                self.lens_q,
                itertools.accumulate([0, *self.lens_k]),
                self.lens_k,
            )
        )
        torch.manual_seed(seed)
        self.rng_state = draw_rng_state(q.device)
        p = variant.dropout_p
        if lens is None:
            self.dense_mask = keep_mask(self.rng_state, p, b, nheads, sq, sk).to(q.device)
            self.keep = list(self.dense_mask.unbind(0))
        else:
            self.dense_mask = None
            self.keep = [m.to(q.device) for m in varlen_keep_mask(self.rng_state, p, nheads, self.lens_q, self.lens_k)]

    def packed(self, x):
        """A dense (batch, seqlen, ...) tensor as the packed rows (batch * seqlen, ...); packed ones as they are."""
        return x.flatten(0, 1) if self.lens is None else x

    def check_plans(self):
        check_variant_plans(self.q, self.k, self.variant, None, self.force, lens=self.lens)

    def _op_args(self):
        choices = {name: value for name, value in self.force.items() if name != "num_splits"}
        return override_string(**choices), op_variant_args(self.variant, None, self.rng_state)

    def forward(self, v, grad=False):
        """(out, lse, graph) of the call with values v, run on poisoned memory. graph: (out, leaves) to differentiate
        with via="func" and ``grad``, else None."""
        q, k, causal = self.q, self.k, self.variant.causal
        poison_allocator(q.device)
        if self.via == "op":
            override, extra = self._op_args()
            if self.lens is None:
                splits = self.force.get("num_splits", 0)
                out, lse = ops.fwd(q, k, v, self.scale, causal, False, splits, override, *extra)
            else:
                max_q, max_k = max(self.lens_q), max(self.lens_k)
                out, lse = ops.varlen_fwd(
                    q, k, v, self.cu_q, self.cu_k, max_q, max_k, self.scale, causal, False, override, *extra
                )
            return out, lse, None
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        kwargs = dict(softmax_scale=self.scale, return_attn_probs=True, **func_variant_kwargs(self.variant, None))
        torch.manual_seed(self.seed)
        with force_plan(**self.force):
            if self.lens is None:
                out, lse, _ = flash_attn_func(*leaves, **kwargs)
            else:
                sizes = (self.cu_q, self.cu_k, max(self.lens_q), max(self.lens_k))
                out, lse, _ = flash_attn_varlen_func(*leaves, *sizes, **kwargs)
        return out.detach(), lse.detach(), ((out, leaves) if grad else None)

    def backward(self, dout, v, out, lse, graph):
        """(dq, dk, dv) of the call with values v for the gradient dout, run on poisoned memory."""
        q, k, causal = self.q, self.k, self.variant.causal
        poison_allocator(q.device)
        if self.via == "op":
            override, extra = self._op_args()
            if self.lens is None:
                return ops.bwd(dout, q, k, v, out, lse, self.scale, causal, False, override, *extra)[:3]
            max_q, max_k = max(self.lens_q), max(self.lens_k)
            return ops.varlen_bwd(
                dout, q, k, v, out, lse, self.cu_q, self.cu_k, max_q, max_k, self.scale, causal, False, override, *extra
            )[:3]
        graph_out, leaves = graph
        with force_plan(**self.force):
            return torch.autograd.grad(graph_out, leaves, dout, retain_graph=True)

    def attend(self, q, k, v, upcast):
        """The reference (out, lse) of the call under keep_mask's decisions."""
        variant = self.variant
        kwargs = dict(window_size=variant.window, softcap=variant.softcap, dropout_p=variant.dropout_p)
        if self.lens is None:
            return attention_ref(
                q, k, v, self.scale, variant.causal, upcast=upcast, dropout_mask=self.dense_mask, **kwargs
            )
        return varlen_attention_ref(
            q, k, v, self.lens_q, self.lens_k, self.scale, variant.causal, upcast, dropout_masks=self.keep, **kwargs
        )

    def visible(self, seq):
        """bool (seqlen_q, seqlen_k) of sequence ``seq``: the keys each row sees."""
        _, len_q, _, len_k = self.seqs[seq]
        return visible_mask(len_q, len_k, self.variant.causal, self.variant.window, self.q.device)

    def probs(self, seq):
        """float32 (nheads, seqlen_q, seqlen_k) of sequence ``seq``: the reference probabilities before dropout."""
        q0, len_q, k0, len_k = self.seqs[seq]
        q, k = self.packed(self.q)[None, q0 : q0 + len_q], self.packed(self.k)[None, k0 : k0 + len_k]
        variant = self.variant
        return attention_probs(q, k, self.scale, variant.causal, window_size=variant.window, softcap=variant.softcap)[0]

    def unobserved(self):
        """Per sequence, float32 (nheads, seqlen_q, seqlen_k) NaN, to be overwritten by what the kernels show."""
        nheads = self.q.shape[-2]
        return [torch.full((nheads, lq, lk), float("nan"), device=self.q.device) for _, lq, _, lk in self.seqs]


def observe_forward_mask(probe):
    """Per sequence, float32 (nheads, seqlen_q, seqlen_k): P * keep * dropout_keep_scale(p) as the forward applied
    it, read from out with V the identity on one block of head_dim keys per call. Each call's out and lse meet the
    correctness rule, and the columns of out past a sequence's keys are exactly zero."""
    q, k = probe.q, probe.k
    d = q.shape[-1]
    packed_k = probe.packed(k)
    observed = probe.unobserved()
    for c0 in range(0, max(probe.lens_k), d):
        v = torch.zeros(packed_k.shape, dtype=k.dtype, device=k.device)
        for _, _, k0, len_k in probe.seqs:
            n = min(d, len_k - c0)
            if n > 0:
                # Row k0 + c0 + c of V (key c0 + c of the sequence) is the unit vector e_c, for every key/value head.
                v[k0 + c0 : k0 + c0 + n, :, :n] = torch.eye(n, dtype=k.dtype, device=k.device)[:, None, :]
        v = v.view(k.shape)
        out, lse, _ = probe.forward(v)
        ref = probe.attend(q, k, v, upcast=True)
        lowp = probe.attend(q, k, v, upcast=False)
        # One value of V decides each entry of out (a single P_ij / (1 - p)), which the kernel rounds twice (P to the
        # input dtype for the product, then out) while ref_lowp's softmax may land closer: the one-ulp term of
        # conftest's small tensors, given explicitly since these tensors can be larger (H200: dv of the same
        # observation in fp16 was 2.5x the low-precision error off). One ulp of max|ref| stays far below max|ref|.
        check_results(("out", "lse"), (out, lse), ref, lowp, q.dtype, {"out": Floor(one_ulp(ref[0], q.dtype))})
        out = probe.packed(out)
        for (q0, len_q, _, len_k), seen in zip(probe.seqs, observed):
            n = max(0, min(d, len_k - c0))
            rows = out[q0 : q0 + len_q]  # (seqlen_q, nheads, head_dim)
            seen[:, :, c0 : c0 + n] = rows[:, :, :n].permute(1, 0, 2).float()
            assert (rows[:, :, n:] == 0).all(), "out must be zero in the columns where every row of V is zero"
    return observed


def observe_backward_mask(probe):
    """Per sequence, float32 (nheads, seqlen_q, seqlen_k): P * keep * dropout_keep_scale(p) as the backward
    regenerated it, read from dV with a one-hot dO that picks head_dim // group query rows per query head and call
    (V random). Each call's dv meets the correctness rule, and the columns of dV past the picked rows are exactly
    zero."""
    q, k = probe.q, probe.k
    nheads, nheads_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    group = nheads // nheads_k
    rows_per_call = d // group
    v = rand(*k.shape, dtype=k.dtype, device=k.device)
    out, lse, graph = probe.forward(v, grad=True)
    heads = torch.arange(nheads, device=q.device)
    packed_q = probe.packed(q)
    observed = probe.unobserved()
    for r0 in range(0, max(probe.lens_q), rows_per_call):
        dout = torch.zeros(packed_q.shape, dtype=q.dtype, device=q.device)
        for q0, len_q, _, _ in probe.seqs:
            n = min(rows_per_call, len_q - r0)
            if n > 0:
                # Row r0 + i of query head hh (hh % group of its key/value head) is the unit vector
                # e_(i * group + hh % group).
                i = torch.arange(n, device=q.device)[:, None]
                dout[q0 + r0 + i, heads, i * group + heads % group] = 1
        dout = dout.view(q.shape)
        dq, dk, dv = probe.backward(dout, v, out, lse, graph)
        # dq and dk are checked with random dO elsewhere; dv is what this test reads.
        ref = reference_with_grads(probe.attend, q, k, v, dout, upcast=True)
        lowp = reference_with_grads(probe.attend, q, k, v, dout, upcast=False)
        # With the one-hot dO each entry of dv is a single P_ij / (1 - p), which the kernel rounds twice (P to the
        # input dtype for the product, then dv) while ref_lowp's softmax may land closer: exactly the case of
        # conftest's one-ulp term (few values decide each entry), which it applies by itself only to tensors of at
        # most SMALL_TENSOR entries, so it is passed here (H200, test_kernel_dropout_mask_varlen[causal-left-wgmma-
        # fp16]: |ours - ref| 7.1e-4 against a bound of 5.8e-4). One ulp of max|ref| stays far below max|ref|.
        check_results(("dv",), (dv,), ref[4:], lowp[4:], q.dtype, {"dv": Floor(one_ulp(ref[4], q.dtype))})
        dv = probe.packed(dv)
        for (_, len_q, k0, len_k), seen in zip(probe.seqs, observed):
            n = max(0, min(rows_per_call, len_q - r0))
            cols = dv[k0 : k0 + len_k]  # (seqlen_k, nheads_k, head_dim)
            if n > 0:
                # Column i * group + g of key/value head kh is row r0 + i of query head kh * group + g.
                block = cols[:, :, : n * group].unflatten(-1, (n, group))  # (seqlen_k, nheads_k, n, group)
                seen[:, r0 : r0 + n, :] = block.permute(1, 3, 2, 0).reshape(nheads, n, len_k).float()
            assert (cols[:, :, n * group :] == 0).all(), "dV must be zero in the columns where every row of dO is zero"
    return observed


def check_kernel_keep(pass_, probe, observed):
    """Asserts that ``observed`` (observe_forward_mask or observe_backward_mask) is NaN-free, nonnegative, zero
    outside the attention mask, and nonzero exactly where keep_mask (varlen_keep_mask) keeps the entry."""
    compared = dropped = 0
    for seq, (seen, keep) in enumerate(zip(observed, probe.keep)):
        if seen.numel() == 0:
            continue
        where = f"{pass_}, sequence {seq}"
        assert not torch.isnan(seen).any(), f"{where}: NaN, or entries left unobserved"
        assert (seen >= 0).all(), f"{where}: negative entries"
        visible = probe.visible(seq).expand_as(keep)
        assert (seen[~visible] == 0).all(), f"{where}: nonzero entries outside the attention mask"
        if not visible.any():
            continue
        smallest = probe.probs(seq)[visible].min().item()
        assert smallest > MASK_MIN_PROB, f"{where}: a visible P of {smallest:.3e} could round to zero"
        wrong = visible & ((seen != 0) != keep)
        if wrong.any():
            head, row, key = wrong.nonzero()[0].tolist()
            pytest.fail(
                f"{where}: {wrong.sum().item()} of {visible.sum().item()} visible entries differ from the keep mask, "
                f"the first at head {head}, query row {row}, key {key}, which keep_mask "
                f"{'keeps' if keep[head, row, key] else 'drops'}"
            )
        compared += visible.sum().item()
        dropped += (visible & ~keep).sum().item()
    assert 0 < dropped < compared, f"{pass_}: {dropped} of {compared} compared entries dropped; need both kinds"


def check_kernel_masks(q, k, variant, force, lens=None, via="op"):
    """Both passes' keep decisions of one call against keep_mask (varlen_keep_mask)."""
    probe = MaskProbe(q, k, variant, force, lens=lens, via=via)
    probe.check_plans()
    check_kernel_keep("forward", probe, observe_forward_mask(probe))
    check_kernel_keep("backward", probe, observe_backward_mask(probe))


def forced_family(kernel, head_dim, dtype):
    """force_plan keywords that run ``kernel`` ("mma_sync" or "wgmma"). The warpgroup-MMA kernels run only on sm_90
    with a build that holds them; elsewhere the plan reports a forced kernel=wgmma off (it runs mma_sync, as
    test_plan_cpu checks), so such a test is skipped there, its mma_sync twin covering that GPU. Where they do run,
    check_forced_plans asserts that each call takes them. Under FLASH_ATTN2_MAX_SMEM below their tiles the whole
    run plans as on a smaller GPU: such a test runs the mma.sync kernels, as check_forced_plans expects there."""
    if kernel == "wgmma" and (MAX_SMEM is None or MAX_SMEM >= SMEM_227KIB):
        for pass_ in ("fwd", "bwd"):
            sizes = dict(batch=1, seqlen_q=128, seqlen_k=128, nheads=1, nheads_k=1, head_dim=head_dim, dtype=dtype)
            try:
                runs = plan(pass_, override="kernel=wgmma", **sizes).kernel == "wgmma"
            except (ValueError, RuntimeError):  # refused outright rather than reported off
                runs = False
            if not runs:
                pytest.skip("the warpgroup-MMA kernels do not run on this GPU or build")
    return {"kernel": kernel}


def dense_mask_inputs(shape, dtype):
    b, sq, sk, h, hk, d = shape
    return rand(b, sq, h, d, dtype=dtype) * MASK_Q_GAIN, rand(b, sk, hk, d, dtype=dtype)


def varlen_mask_inputs(lens_q, lens_k, h, hk, d, dtype):
    return rand(sum(lens_q), h, d, dtype=dtype) * MASK_Q_GAIN, rand(sum(lens_k), hk, d, dtype=dtype)


# name: ((batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim), variant). Lengths off the tile sizes and in both
# orders, one query row, one key; MHA, GQA and MQA; windows on both sides, causal with and without a left edge, rows
# that see no key (causal with seqlen_q > seqlen_k). Each case has a head dim of its own, so that the default run
# meets several tile shapes, and as many keys per forward call and query rows per backward call.
MASK_CASES = {
    "sq17-sk200-mha-window": ((2, 17, 200, 4, 4, 64), V(window=(37, 19), dropout_p=0.3)),
    "sq300-sk257-mha": ((2, 300, 257, 4, 4, 64), V(dropout_p=0.3)),
    "sq200-sk113-gqa-causal": ((2, 200, 113, 6, 2, 128), V(causal=True, dropout_p=0.25)),
    "sq113-sk17-gqa-causal-left": ((2, 113, 17, 8, 2, 32), V(causal=True, window=(5, -1), dropout_p=0.4)),
    "sq1-sk200-mqa-softcap": ((3, 1, 200, 4, 1, 256), V(softcap=5.0, dropout_p=0.2)),
    "sq5-sk1-gqa": ((2, 5, 1, 4, 2, 96), V(dropout_p=0.5)),
    "sq113-sk113-window-right": ((2, 113, 113, 2, 2, 224), V(window=(0, 10), softcap=20.0, dropout_p=0.15)),
}

# Sequences: empty ones each way, one row, one key, lengths off the tile sizes, seqlen_q above and below seqlen_k.
MASK_LENS_Q = [0, 1, 17, 113, 200, 5, 2, 17]
MASK_LENS_K = [7, 17, 0, 200, 113, 5, 1, 0]
VARLEN_MASK_VARIANTS = {
    "causal-left": V(causal=True, window=(50, -1), dropout_p=0.3),
    "window-softcap": V(window=(20, 40), softcap=8.0, dropout_p=0.15),
}

# (kernel family, dtype): the mma.sync kernels in bf16 and the warpgroup-MMA ones in fp16 (--exhaustive: every pair).
MASK_FAMILIES = [("mma_sync", torch.bfloat16), ("wgmma", torch.float16)]


def family_id(family):
    kernel, dtype = family
    return f"{kernel}-{dict(zip(DTYPES, DTYPE_IDS)).get(dtype, str(dtype))}"


@pytest.mark.parametrize("family", MASK_FAMILIES, ids=family_id)
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_kernel_dropout_mask(case, family):
    """The forward's and the backward's own keep decisions, entry for entry, against keep_mask."""
    shape, variant = MASK_CASES[case]
    kernel, dtype = family
    d = shape[-1]
    require_kernels(d, dtype)
    force = forced_family(kernel, d, dtype)
    check_kernel_masks(*dense_mask_inputs(shape, dtype), variant, force)


@pytest.mark.parametrize("family", MASK_FAMILIES, ids=family_id)
@pytest.mark.parametrize("name", list(VARLEN_MASK_VARIANTS))
def test_kernel_dropout_mask_varlen(name, family):
    """As test_kernel_dropout_mask through the varlen ops: each sequence draws as batch row b of a dense call, with
    positions counted from its start (varlen_keep_mask)."""
    kernel, dtype = family
    require_kernels(64, dtype)
    force = forced_family(kernel, 64, dtype)
    q, k = varlen_mask_inputs(MASK_LENS_Q, MASK_LENS_K, 6, 2, 64, dtype)
    check_kernel_masks(q, k, VARLEN_MASK_VARIANTS[name], force, lens=(MASK_LENS_Q, MASK_LENS_K))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_kernel_dropout_mask_public_functions(varlen):
    """flash_attn_func and flash_attn_varlen_func, forward and autograd backward, on the plan's own kernels: the
    rng_state they draw after torch.manual_seed reaches both passes' kernels, which drop what keep_mask drops."""
    require_kernels(128, torch.bfloat16)
    if varlen:
        q, k = varlen_mask_inputs(MASK_LENS_Q, MASK_LENS_K, 8, 2, 128, torch.bfloat16)
        lens, variant = (MASK_LENS_Q, MASK_LENS_K), VARLEN_MASK_VARIANTS["window-softcap"]
    else:
        q, k = dense_mask_inputs((2, 200, 113, 4, 1, 128), torch.bfloat16)
        lens, variant = None, V(causal=True, window=(60, -1), dropout_p=0.35)
    check_kernel_masks(q, k, variant, {}, lens=lens, via="func")


# HOPPER_PATHS but the forced key splits, which dropout rules out.
MASK_PATHS = {path: value for path, value in HOPPER_PATHS.items() if "num_splits" not in value[0]}


@pytest.mark.parametrize("path", list(MASK_PATHS))
def test_kernel_dropout_mask_forced_paths(path):
    """The keep decisions under each forced Hopper tile and work split (reported off and run as planned on other
    GPUs): a different tile or walk over the heads and keys must not change which entries are dropped."""
    force, (b, sq, sk, h, hk) = MASK_PATHS[path]
    require_kernels(128, torch.bfloat16)
    # No left window edge: under one, the Hopper backward keeps one key block per CTA whatever key_blocks says.
    variant = V(window=(-1, 50), softcap=20.0, dropout_p=0.2)
    check_kernel_masks(*dense_mask_inputs((b, sq, sk, h, hk, 128), torch.bfloat16), variant, force)


def test_dropout_seeding():
    """The public function draws rng_state from torch's CUDA generator and nothing else: the same seed gives the
    same output, gradients and generator state afterwards, another seed another mask; the backward draws
    nothing; and the output equals the op's under the rng_state the seed gives."""
    require_kernels(64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in make_inputs(2, 200, 300, 4, 2, 64, torch.bfloat16))
    slopes = alibi_slopes("heads", 2, 4)
    kwargs = dict(dropout_p=0.25, window_size=(100, 20), softcap=30.0, alibi_slopes=slopes, deterministic=True)
    dout = torch.randn_like(q)

    def call(seed):
        torch.manual_seed(seed)
        out = flash_attn_func(q, k, v, **kwargs)
        state = torch.cuda.get_rng_state()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert torch.equal(torch.cuda.get_rng_state(), state), "the backward must not draw random numbers"
        return out, grads, state

    out1, grads1, state1 = call(5)
    out2, grads2, state2 = call(5)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2))
    out3, _, _ = call(6)
    assert not torch.equal(out1, out3)

    torch.manual_seed(5)
    rng_state = draw_rng_state(q.device)
    assert torch.equal(torch.cuda.get_rng_state(), state1), "the call must draw exactly one rng_state"
    out_op, _ = ops.fwd(
        q.detach(), k.detach(), v.detach(), 64**-0.5, False, True, 0, "", 100, 20, 30.0, slopes, 0.25, rng_state
    )
    assert torch.equal(out_op, out1)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("dropout_p", [0.05, 0.5, 0.9])
def test_dropout_rates(dropout_p, pair):
    """Low and high rates; rng_states with all 64 bits of seed and offset in use."""
    dtype, kernel = pair
    require_kernels(64, dtype)
    q, k, v = make_inputs(2, 140, 333, 4, 2, 64, dtype)
    # [seed, offset] as unsigned 64-bit values: all ones, and high and low halves that differ.
    for words in ((2**64 - 1, 2**64 - 1), (0xDEADBEEF_CAFEF00D, 0x7FFFFFFF_0000ABCD)):
        rng = torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64, device="cuda")
        run_dense(q, k, v, V(window=(80, 80), dropout_p=dropout_p), force=kernel_force(kernel), rng_state=rng)


@pytest.mark.parametrize("h, hk", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_dropout_decode_split(h, hk):
    """One query row against long keys, a shape whose plain call splits the keys (on large GPUs) and runs the query
    heads of a group as rows of one head: with dropout and ALiBi, which read each element's own head and key
    index, it must come out right all the same."""
    require_kernels(128, torch.bfloat16)
    q, k, v = make_inputs(2, 1, 4097, h, hk, 128, torch.bfloat16)
    run_dense(
        q,
        k,
        v,
        V(window=(3000, -1), softcap=20.0, alibi="batch_heads", dropout_p=0.2),
        slopes=alibi_slopes("batch_heads", 2, h),
    )


def test_dropout_cuda_graph_replays_draw_fresh_masks():
    """flash_attn_func with dropout captured in a CUDA graph: each replay draws a new rng_state (torch's
    generator is graph-safe), so replays differ; each keeps 1 - effective_dropout_p(p) of the entries, and what it
    keeps is P / (1 - p), flash-attn 2.x's scale: at p = 0.17 the kernels drop with p' = 44/256, and a scale of
    1 / (1 - p') would be 0.23% larger, which the median ratio of kept values to P resolves.

    V is the identity (head_dim == seqlen_k), so out[b, i, h, j] = P[b, h, i, j] * keep / (1 - p) shows the mask.
    """
    require_kernels(64, torch.bfloat16)
    b, sq, sk, h, p = 4, 256, 64, 8, 0.17
    q, k = rand(b, sq, h, 64, dtype=torch.bfloat16), rand(b, sk, h, 64, dtype=torch.bfloat16)
    v = torch.eye(sk, dtype=torch.bfloat16, device="cuda")[None, :, None, :].expand(b, sk, h, sk).contiguous()
    slopes = torch.full((h,), 0.01, dtype=torch.float32, device="cuda")  # biases down to -0.64: no P underflows
    kwargs = dict(dropout_p=p, softcap=20.0, alibi_slopes=slopes)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, **kwargs)

    probs = reference_probs(q, k, False, (-1, -1), 20.0, slopes).permute(0, 2, 1, 3)  # (b, sq, h, sk) as out
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        replays.append(out.clone())
        kept = out != 0
        n = kept.numel()
        assert abs(kept.float().mean().item() - kept_fraction(p)) <= keep_fraction_bound(n, p)
        torch.testing.assert_close(out.float()[kept] / dropout_keep_scale(p), probs[kept], rtol=2**-6, atol=1e-6)
        # bf16 rounds each kept value by up to 2^-9 relative, symmetrically; the median of 100k ratios is far
        # tighter than the 2.3e-3 that separates the two scales.
        ratio = (out.float()[kept] / probs[kept]).median().item()
        assert abs(ratio / dropout_keep_scale(p) - 1.0) < 5e-4, ratio
    assert not torch.equal(replays[0], replays[1]), "two replays drew the same dropout mask"


def test_dropout_compiled_training_matches_eager():
    """torch.compile(fullgraph=True) of flash_attn_func with dropout, window, softcap and ALiBi, default Inductor
    settings: forward and backward bitwise equal to eager under the same torch.manual_seed (deterministic
    backward). The rng_state must come from torch's generator as in eager mode, not from Inductor's own lowering
    of random ops, and must not be drawn again for the backward."""
    require_kernels(64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in make_inputs(2, 150, 230, 4, 2, 64, torch.bfloat16))
    slopes = alibi_slopes("batch_heads", 2, 4)
    dout = torch.randn_like(q)

    def attend(q, k, v, slopes):
        return flash_attn_func(
            q, k, v, dropout_p=0.2, window_size=(48, 16), softcap=20.0, alibi_slopes=slopes, deterministic=True
        )

    compiled = torch.compile(attend, fullgraph=True)

    def step(fn, seed):
        torch.manual_seed(seed)
        out = fn(q, k, v, slopes)
        loss = (out.float() * dout.float()).sum()
        return (out.detach(), *torch.autograd.grad(loss, (q, k, v)))

    step(compiled, 0)  # compiles
    results = {}
    for seed in (1, 2):
        eager, comp = step(attend, seed), step(compiled, seed)
        for name, a, b in zip(("out", "dq", "dk", "dv"), eager, comp):
            assert torch.equal(a, b), (seed, name)
        results[seed] = comp
    assert not torch.equal(results[1][0], results[2][0])


# ---------------------------------------------------------------- opcheck and TorchScript


def test_opcheck_fwd_bwd_variants():
    require_kernels(64, torch.bfloat16)
    q, k, v = (rand(2, 65, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    slopes = alibi_slopes("batch_heads", 2, 4)
    rng_state = draw_rng_state("cuda")
    extra = (24, 8, 15.0, slopes, 0.1, rng_state)
    torch.library.opcheck(ops.fwd.default, (q, k, v, 0.125, False, False, 0, "", *extra))
    out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), 0.125, False, False, 0, "", *extra)
    torch.library.opcheck(
        ops.bwd.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.125, False, False, "", *extra),
    )


def test_opcheck_varlen_variants():
    require_kernels(64, torch.bfloat16)
    lens = [5, 0, 70]
    q, k, v = (rand(sum(lens), 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    cu = cu_seqlens(lens)
    slopes = alibi_slopes("batch_heads", len(lens), 4)
    extra = (24, -1, 15.0, slopes, 0.1, draw_rng_state("cuda"))
    torch.library.opcheck(ops.varlen_fwd.default, (q, k, v, cu, cu, 70, 70, 0.125, True, False, "", *extra))
    out, lse = ops.varlen_fwd(q.detach(), k.detach(), v.detach(), cu, cu, 70, 70, 0.125, True, False, "", *extra)
    torch.library.opcheck(
        ops.varlen_bwd.default,
        (
            torch.randn_like(out),
            q.detach(),
            k.detach(),
            v.detach(),
            out,
            lse,
            cu,
            cu,
            70,
            70,
            0.125,
            True,
            False,
            "",
            *extra,
        ),
    )


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_torchscript_variants():
    """A scripted function passes the new arguments by their schema names and gets what a direct call gets."""
    require_kernels(64, torch.bfloat16)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, rng_state: torch.Tensor):
        return torch.ops.flash_attn2.fwd(
            q,
            k,
            v,
            0.125,
            False,
            window_left=32,
            window_right=4,
            softcap=12.0,
            alibi_slopes=slopes,
            dropout_p=0.15,
            rng_state=rng_state,
        )

    scripted = torch.jit.script(attend)
    assert "flash_attn2::fwd" in str(scripted.graph)
    q, k, v = make_inputs(2, 100, 120, 4, 2, 64, torch.bfloat16)
    slopes, rng_state = alibi_slopes("heads", 2, 4), draw_rng_state("cuda")
    out, lse = scripted(q, k, v, slopes, rng_state)
    want = ops.fwd(q, k, v, 0.125, False, False, 0, "", 32, 4, 12.0, slopes, 0.15, rng_state)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


# ---------------------------------------------------------------- argument validation

BAD = (ValueError, RuntimeError)


def bad_input_config():
    for d, dtype in itertools.product((64, 128, 32, 96, 160, 192, 224, 256), DTYPES):
        if all(flash_attn_cuda.kernel_available(d, dtype, c, backward=True) for c in (False, True)):
            return d, dtype
    pytest.skip("no compiled kernel")


def _slopes(*shape, dtype=torch.float32, device="cuda"):
    return torch.rand(shape, dtype=dtype, device=device)


# id: (flash_attn_func keywords for a batch of 2 and 4 heads, built on demand; what the message must name).
BAD_FUNC_ARGS = {
    "window-left": (lambda: dict(window_size=(-2, 0)), "window"),
    "window-right": (lambda: dict(window_size=(4, -7)), "window"),
    "softcap-negative": (lambda: dict(softcap=-1.0), "softcap"),
    "softcap-nan": (lambda: dict(softcap=float("nan")), "softcap"),
    "alibi-fp16": (lambda: dict(alibi_slopes=_slopes(4, dtype=torch.float16)), "alibi_slopes"),
    "alibi-heads": (lambda: dict(alibi_slopes=_slopes(5)), "alibi_slopes"),
    "alibi-batch": (lambda: dict(alibi_slopes=_slopes(3, 4)), "alibi_slopes"),
    "alibi-3d": (lambda: dict(alibi_slopes=_slopes(2, 4, 1)), "alibi_slopes"),
    "alibi-cpu": (lambda: dict(alibi_slopes=_slopes(4, device="cpu")), "alibi_slopes"),
    "dropout-negative": (lambda: dict(dropout_p=-0.1), "dropout_p"),
    "dropout-one": (lambda: dict(dropout_p=1.0), "dropout_p"),
    "dropout-above-one": (lambda: dict(dropout_p=1.5), "dropout_p"),
}


@pytest.mark.parametrize("case", list(BAD_FUNC_ARGS))
def test_func_rejects_bad_variant_arguments(case):
    """flash_attn_func and flash_attn_varlen_func reject bad variant arguments, naming the argument."""
    d, dtype = bad_input_config()
    make, name = BAD_FUNC_ARGS[case]
    q, k, v = make_inputs(2, 65, 65, 4, 2, d, dtype)
    with pytest.raises(BAD, match=name):
        flash_attn_func(q, k, v, **make())
    cu = cu_seqlens([40, 25])  # two sequences, as the batch of two: the same slopes are right or wrong
    with pytest.raises(BAD, match=name):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 40, 40, **make())


def _rng(dtype=torch.int64, shape=(2,), device="cuda"):
    return torch.arange(1, 1 + math.prod(shape), dtype=dtype, device=device).view(shape)


# id: (the six trailing op arguments (window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state) for
# a batch of 2 and 4 heads, built on demand; what the message must name).
BAD_OP_ARGS = {
    "window-left": (lambda: (-2, 0, 0.0, None, 0.0, None), "window"),
    "window-right": (lambda: (0, -3, 0.0, None, 0.0, None), "window"),
    "softcap-negative": (lambda: (-1, -1, -0.5, None, 0.0, None), "softcap"),
    "softcap-nan": (lambda: (-1, -1, float("nan"), None, 0.0, None), "softcap"),
    "alibi-fp16": (lambda: (-1, -1, 0.0, _slopes(4, dtype=torch.float16), 0.0, None), "alibi_slopes"),
    "alibi-heads": (lambda: (-1, -1, 0.0, _slopes(3), 0.0, None), "alibi_slopes"),
    "alibi-batch": (lambda: (-1, -1, 0.0, _slopes(3, 4), 0.0, None), "alibi_slopes"),
    "alibi-cpu": (lambda: (-1, -1, 0.0, _slopes(2, 4, device="cpu"), 0.0, None), "alibi_slopes"),
    "alibi-strided": (lambda: (-1, -1, 0.0, _slopes(2, 8)[:, ::2], 0.0, None), "alibi_slopes"),
    "dropout-negative": (lambda: (-1, -1, 0.0, None, -0.25, _rng()), "dropout_p"),
    "dropout-one": (lambda: (-1, -1, 0.0, None, 1.0, _rng()), "dropout_p"),
    "rng-missing": (lambda: (-1, -1, 0.0, None, 0.1, None), "rng_state"),
    "rng-int32": (lambda: (-1, -1, 0.0, None, 0.1, _rng(dtype=torch.int32)), "rng_state"),
    "rng-shape3": (lambda: (-1, -1, 0.0, None, 0.1, _rng(shape=(3,))), "rng_state"),
    "rng-shape1x2": (lambda: (-1, -1, 0.0, None, 0.1, _rng(shape=(1, 2))), "rng_state"),
    "rng-cpu": (lambda: (-1, -1, 0.0, None, 0.1, _rng(device="cpu")), "rng_state"),
}


@pytest.mark.parametrize("case", list(BAD_OP_ARGS))
def test_ops_reject_bad_variant_arguments(case):
    """Every op validates the variant arguments, the backward ops included, naming the argument."""
    d, dtype = bad_input_config()
    make, name = BAD_OP_ARGS[case]
    q, k, v = make_inputs(2, 65, 65, 4, 2, d, dtype)
    scale = d**-0.5
    with pytest.raises(BAD, match=name):
        ops.fwd(q, k, v, scale, False, False, 0, "", *make())
    out, lse = ops.fwd(q, k, v, scale, False)
    with pytest.raises(BAD, match=name):
        ops.bwd(torch.randn_like(out), q, k, v, out, lse, scale, False, False, "", *make())

    cu = cu_seqlens([40, 25])  # two sequences, as the batch of two: the same slopes are right or wrong
    qv, kv, vv = q[0], k[0], v[0]
    with pytest.raises(BAD, match=name):
        ops.varlen_fwd(qv, kv, vv, cu, cu, 40, 40, scale, False, False, "", *make())
    out, lse = ops.varlen_fwd(qv, kv, vv, cu, cu, 40, 40, scale, False)
    with pytest.raises(BAD, match=name):
        ops.varlen_bwd(torch.randn_like(out), qv, kv, vv, out, lse, cu, cu, 40, 40, scale, False, False, "", *make())


# ---------------------------------------------------------------- exhaustive

EXHAUSTIVE_SEQLENS = [1, 17, 113, 203, 1023]


def exhaustive_heads(sq, sk):
    # MHA, GQA and MQA in turn over the length pairs, at a bounded cost.
    return [(4, 4), (6, 2), (4, 1)][(sq + 2 * sk) % 3]


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "seqlens", list(itertools.product(EXHAUSTIVE_SEQLENS, EXHAUSTIVE_SEQLENS)), ids=lambda p: f"sq{p[0]}-sk{p[1]}"
)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_exhaustive_variants(name, seqlens, head_dim, pair):
    sq, sk = seqlens
    h, hk = exhaustive_heads(sq, sk)
    b = 2 if max(sq, sk) <= 203 else 1
    variant, (dtype, kernel) = VARIANTS[name], pair
    if dtype == torch.bfloat16 and variant.alibi and not variant.causal and variant.window[1] < 0 and sq - sk > 256:
        # The rule cannot judge ALiBi in bf16 where every key a row sees is far away: with seqlen_q 1023 against
        # 17 to 203 keys and no right window edge, the first rows' biases reach -slope * 1000 (about -400), which
        # the bf16 reference rounds to spacings of 1 to 2, scrambling its softmax (H200: out's bound 1.0 to 1.5
        # of max|ref|). The kernels add the bias in float32 in either dtype, so these lengths run in fp16 (its
        # spacing 8x finer), on the same kernel family; bf16 ALiBi is judged at every other length pair.
        dtype = torch.float16
    check_shape_variant((b, sq, sk, h, hk, head_dim), variant, dtype, kernel)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize(
    "shape",
    [(2, 97, 161, 6, 2), (2, 161, 97, 4, 1), (2, 1, 300, 8, 2), (1, 500, 500, 3, 3)],
    ids=["sq<sk-gqa", "sq>sk-mqa", "decode", "square"],
)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_exhaustive_head_dims(name, shape, head_dim, pair):
    check_shape_variant((*shape, head_dim), VARIANTS[name], *pair)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_exhaustive_varlen(name, head_dim, pair):
    dtype, kernel = pair
    require_kernels(head_dim, dtype)
    run_varlen(LENS_Q, LENS_K, 6, 2, head_dim, dtype, VARIANTS[name], force=kernel_force(kernel))


# Every variant on every path but the dropout variants on forced key splits, which dropout rules out (see
# FORCED_PATH_CASES).
EXHAUSTIVE_FORCED_PATH_CASES = [
    pytest.param(name, path, id=f"{name}-{path}")
    for name, variant in VARIANTS.items()
    for path, (force, _) in HOPPER_PATHS.items()
    if not (variant.dropout_p and "num_splits" in force)
]


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name, path", EXHAUSTIVE_FORCED_PATH_CASES)
def test_exhaustive_forced_paths(name, path, dtype):
    force, (b, sq, sk, h, hk) = HOPPER_PATHS[path]
    variant = VARIANTS[name]
    check_shape_variant((b, sq, sk, h, hk, 128), variant, dtype, "default", force=force)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("dropout_p", [0.01, 0.3, 0.5, 0.9])
@pytest.mark.parametrize(
    "seqlens", [(1, 1023), (113, 203), (203, 113), (1023, 1023)], ids=lambda p: f"sq{p[0]}-sk{p[1]}"
)
@pytest.mark.parametrize("name", ["win-both", "causal-left", "combo", "combo-causal"])
def test_exhaustive_dropout(name, seqlens, dropout_p, pair):
    sq, sk = seqlens
    variant = dataclasses.replace(VARIANTS[name], dropout_p=dropout_p)
    check_shape_variant((2, sq, sk, 8, 2, 64), variant, *pair)


@pytest.mark.exhaustive
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("seqlens", [(2, 2), (2, 5), (5, 2), (5, 5)], ids=lambda p: f"sq{p[0]}-sk{p[1]}")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_exhaustive_short_seqlens(name, seqlens, head_dim, pair):
    sq, sk = seqlens
    h, hk = exhaustive_heads(sq, sk)
    check_shape_variant((2, sq, sk, h, hk, head_dim), VARIANTS[name], *pair)


# Every kernel family and dtype (MASK_FAMILIES takes one dtype per family).
ALL_MASK_FAMILIES = list(itertools.product(("mma_sync", "wgmma"), DTYPES))


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ALL_MASK_FAMILIES, ids=family_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_exhaustive_kernel_dropout_mask(case, head_dim, family):
    shape, variant = MASK_CASES[case]
    kernel, dtype = family
    require_kernels(head_dim, dtype)
    force = forced_family(kernel, head_dim, dtype)
    check_kernel_masks(*dense_mask_inputs((*shape[:-1], head_dim), dtype), variant, force)


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ALL_MASK_FAMILIES, ids=family_id)
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("name", list(VARLEN_MASK_VARIANTS))
def test_exhaustive_kernel_dropout_mask_varlen(name, head_dim, family):
    kernel, dtype = family
    require_kernels(head_dim, dtype)
    force = forced_family(kernel, head_dim, dtype)
    q, k = varlen_mask_inputs(MASK_LENS_Q, MASK_LENS_K, 6, 2, head_dim, dtype)
    check_kernel_masks(q, k, VARLEN_MASK_VARIANTS[name], force, lens=(MASK_LENS_Q, MASK_LENS_K))


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", MASK_FAMILIES, ids=family_id)
@pytest.mark.parametrize("dropout_p", [0.01, 0.5, 0.9])
# Cases with thousands of visible entries, so that both rates' rare outcome (a drop at 0.01, a keep at 0.9) occurs.
@pytest.mark.parametrize("case", ["sq17-sk200-mha-window", "sq200-sk113-gqa-causal", "sq1-sk200-mqa-softcap"])
def test_exhaustive_kernel_dropout_mask_rates(case, dropout_p, family):
    shape, variant = MASK_CASES[case]
    kernel, dtype = family
    require_kernels(shape[-1], dtype)
    force = forced_family(kernel, shape[-1], dtype)
    variant = dataclasses.replace(variant, dropout_p=dropout_p)
    check_kernel_masks(*dense_mask_inputs(shape, dtype), variant, force)
