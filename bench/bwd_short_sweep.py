"""Backward time of short-query shapes against the schedule knobs, with a per-kernel breakdown.

For each shape: ours under each FLASH_ATTN2_BWD_KEY_BLOCKS / FLASH_ATTN2_BWD_SHORT_QUERIES setting and SDPA's
FLASH_ATTENTION backend, as the median of 30 backward calls (torch.autograd.grad, as bench_skinny times it),
then the GPU time of each kernel in one such call (torch.profiler), ours at the default settings and flash's.

    python bench/bwd_short_sweep.py [--out-dir DIR]
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHAPES = [  # b, sq, sk, h, hk, d
    (8, 1, 4096, 16, 16, 128),
    (8, 16, 16384, 16, 16, 128),
    (8, 128, 4096, 16, 16, 128),
    (4, 4096, 4096, 64, 64, 32),
    (4, 4096, 4096, 9, 9, 224),
]
SETTINGS = [  # (FLASH_ATTN2_BWD_KEY_BLOCKS, FLASH_ATTN2_BWD_SHORT_QUERIES); "" = the heuristic's choice
    ("", ""), ("1", ""), ("2", ""), ("4", ""), ("8", ""), ("16", ""), ("32", ""), ("", "0"), ("8", "0"),
]


def set_env(name, value):
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)


def kernel_times(fn, calls=10):
    """{kernel name: GPU us per call} over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name[:90]] += e.device_time_total / calls if hasattr(e, "device_time_total") else e.cuda_time_total / calls
    return dict(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args()
    from flash_attn_cuda import flash_attn_func
    from torch.nn.attention import SDPBackend, sdpa_kernel
    meta = common.stamp()
    print(f"[bwd_short_sweep] {meta['gpu']} commit {meta['commit']}: backward us (median of 30)")
    results = []
    for b, sq, sk, h, hk, d in SHAPES:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = flash_attn_func(q, k, v)
        dout = torch.randn_like(out)
        ours = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out_f = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=h != hk)
        dout_f = dout.transpose(1, 2).contiguous()
        flash = lambda: torch.autograd.grad(out_f, (qt, kt, vt), dout_f, retain_graph=True)  # noqa: E731
        row = {"shape": [b, sq, sk, h, hk, d], "us": {}, "kernels": {}}
        for blocks, short in SETTINGS:
            set_env("FLASH_ATTN2_BWD_KEY_BLOCKS", blocks)
            set_env("FLASH_ATTN2_BWD_SHORT_QUERIES", short)
            row["us"][f"kb={blocks or 'auto'} sq16={short or 'auto'}"] = 1e3 * common.time_ms(ours)
        set_env("FLASH_ATTN2_BWD_KEY_BLOCKS", "")
        set_env("FLASH_ATTN2_BWD_SHORT_QUERIES", "")
        row["us"]["flash"] = 1e3 * common.time_ms(flash)
        row["kernels"]["ours"] = kernel_times(ours)
        row["kernels"]["flash"] = kernel_times(flash)
        results.append(row)
        print(f"shape b,sq,sk,h,hk,d = {b},{sq},{sk},{h},{hk},{d}")
        print("  " + "  ".join(f"{n}: {t:.1f}" for n, t in row["us"].items()))
        for impl, ks in row["kernels"].items():
            print(f"  {impl} kernels (us/call): " + "; ".join(f"{n} {t:.1f}" for n, t in ks.items()))
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, f"bwd_short_sweep_{meta['gpu_slug']}.json"), "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
