"""Distribution of the correctness rule's ratio for the backward, wgmma against mma.sync kernels.

For one shape, over fresh random inputs, prints max|ours - ref| / max|ref_lowp - ref| for dq, dk and dv (the
tests require <= 2, plus 1e-5 absolute) with the Hopper kernels and with FLASH_ATTN2_DISABLE_WGMMA=1.

    python bench/grad_error_ratio.py --hdim 64 --sq 113 --sk 17 --causal --dtype fp16 --trials 50
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_bwd_gpu import reference_grads  # noqa: E402

from flash_attn_cuda import flash_attn_func  # noqa: E402


def ratios(q, k, v, dout, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    ref = reference_grads(q, k, v, dout, causal, None, upcast=True)
    lowp = reference_grads(q, k, v, dout, causal, None, upcast=False)
    return [((g.float() - r).abs().max() / (lp.float() - r).abs().max().clamp_min(1e-30)).item()
            for g, r, lp in zip(grads, ref, lowp)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hdim", type=int, default=64)
    p.add_argument("--sq", type=int, default=113)
    p.add_argument("--sk", type=int, default=17)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--trials", type=int, default=50)
    a = p.parse_args()
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    results = {"wgmma": [], "mma.sync": []}
    for _ in range(a.trials):
        shape_q, shape_k = (2, a.sq, a.heads, a.hdim), (2, a.sk, a.heads, a.hdim)
        q, k, v = (torch.randn(s, device="cuda", dtype=dtype) for s in (shape_q, shape_k, shape_k))
        dout = torch.randn(shape_q, device="cuda", dtype=dtype)
        for name, disable in (("wgmma", "0"), ("mma.sync", "1")):
            os.environ["FLASH_ATTN2_DISABLE_WGMMA"] = disable
            results[name].append(ratios(q, k, v, dout, a.causal))
    print(f"hdim {a.hdim} sq {a.sq} sk {a.sk} causal {a.causal} {a.dtype}, {a.trials} trials: ratio to the lowp error")
    for name, rows in results.items():
        t = torch.tensor(rows)
        cells = ", ".join(f"{g} median {t[:, i].median():.2f} max {t[:, i].max():.2f} over-2 {(t[:, i] > 2).sum().item()}"
                          for i, g in enumerate(("dq", "dk", "dv")))
        print(f"  {name:8s} {cells}")


if __name__ == "__main__":
    main()
