"""Distribution of the correctness rule's ratio for the backward, over fresh random inputs of one shape.

For each trial, prints max|ours - ref| / max|ref_lowp - ref| for dq, dk and dv (the correctness rule,
conftest.check_close, asks for <= 2, plus 1e-5 absolute), how many trials failed the rule as the tests apply it
(conftest.check_results: atol raised by one ulp and, for dq and dk, by gradient_floors, since D = rowsum(dO * O)
reads the rounded output), and how many gave gradients that differ bit for bit when the same inputs run again
(dq adds its key blocks in whatever order they finish; dk and dv have no such freedom). Implementations: ours
with the Hopper kernels (wgmma), ours under force_plan(kernel="mma_sync") (mma.sync), and PyTorch SDPA's
FlashAttention-2 backend (flash), which computes D the same way. A diagnostic for the gradient tests' tolerances
(tests/conftest.py), not a benchmark.

    python tools/grad_error_ratio.py --hdim 256 --sq 1 --sk 17 --causal --dtype fp16 --trials 300
"""

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.append(ROOT)  # after an installed flash_attn_cuda
from conftest import check_results, gradient_floors  # noqa: E402
from test_bwd_gpu import reference_grads  # noqa: E402

from flash_attn_cuda import flash_attn_func  # noqa: E402
from flash_attn_cuda.plan import force_plan  # noqa: E402
from flash_attn_cuda.reference import attention_ref  # noqa: E402


def ours(kernel):
    def run(q, k, v, dout, causal):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with force_plan(kernel=kernel):
            out = flash_attn_func(q, k, v, causal=causal)
            return out.detach(), torch.autograd.grad(out, (q, k, v), dout)

    return run


def sdpa_flash(q, k, v, dout, causal):
    # SDPA aligns its causal mask to the top-left corner, ours to the bottom-right: the same for seqlen_q ==
    # seqlen_k, and a single query row sees every key in ours (main() drops flash for the other shapes).
    is_causal = causal and q.shape[1] > 1
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    grads = torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))
    return out.detach().transpose(1, 2), [g.transpose(1, 2) for g in grads]


IMPLS = {"wgmma": ours("wgmma"), "mma.sync": ours("mma_sync"), "flash": sdpa_flash}


def trial(run, q, k, v, dout, causal, ref, lowp):
    """[ratio dq, dk, dv, failed the tests' rule, rerun differs dq, dk, dv]."""
    out, grads = run(q, k, v, dout, causal)
    _, again = run(q, k, v, dout, causal)
    ratios = [
        ((g.float() - r).abs().max() / (lp.float() - r).abs().max().clamp_min(1e-30)).item()
        for g, r, lp in zip(grads, ref, lowp)
    ]

    def attend(q, k, v, upcast):
        return attention_ref(q, k, v, None, causal, upcast=upcast)

    floors = gradient_floors(attend, q, k, v, dout, q.shape[-1] ** -0.5, q.shape[1])
    try:
        check_results(("dq", "dk", "dv"), grads, ref, lowp, q.dtype, floors)
        failed = 0.0
    except AssertionError:
        failed = 1.0
    return ratios + [failed] + [float(not torch.equal(a, b)) for a, b in zip(grads, again)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", type=int, default=64)
    p.add_argument("--sq", type=int, default=113)
    p.add_argument("--sk", type=int, default=17)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--gains", default="1,1,1", help="q,k,v multipliers of the standard normal inputs")
    p.add_argument("--impls", default="wgmma,mma.sync,flash")
    a = p.parse_args()
    gains = [float(x) for x in a.gains.split(",")]
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    impls = a.impls.split(",")
    if "flash" in impls and a.causal and a.sq not in (1, a.sk):
        print("flash left out: SDPA's causal mask is aligned top-left, ours bottom-right")
        impls.remove("flash")
    results = {name: [] for name in impls}
    for _ in range(a.trials):
        shape_q, shape_k = (2, a.sq, a.heads, a.hdim), (2, a.sk, a.heads, a.hdim)
        q, k, v = ((torch.randn(s, device="cuda") * g).to(dtype) for s, g in zip((shape_q, shape_k, shape_k), gains))
        dout = torch.randn(shape_q, device="cuda", dtype=dtype)
        ref = reference_grads(q, k, v, dout, a.causal, None, upcast=True)[1:]
        lowp = reference_grads(q, k, v, dout, a.causal, None, upcast=False)[1:]
        for name in impls:
            results[name].append(trial(IMPLS[name], q, k, v, dout, a.causal, ref, lowp))
    print(
        f"hdim {a.hdim} sq {a.sq} sk {a.sk} causal {a.causal} {a.dtype} gains {a.gains}, {a.trials} trials: "
        f"ratio to the lowp error, over-2: trials above 2 (the plain rule); failed: trials failing the tests' "
        f"rule; rerun: trials whose second run differed bitwise"
    )
    for name, rows in results.items():
        t = torch.tensor(rows)
        cells = ", ".join(
            f"{g} median {t[:, i].median():.2f} max {t[:, i].max():.2f} "
            f"over-2 {(t[:, i] > 2).sum().item()} rerun {int(t[:, i + 4].sum().item())}"
            for i, g in enumerate(("dq", "dk", "dv"))
        )
        print(f"  {name:8s} failed {int(t[:, 3].sum().item())}; {cells}")


if __name__ == "__main__":
    main()
