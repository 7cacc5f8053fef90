"""Forward time against the number of key splits (FLASH_ATTN2_NUM_SPLITS) and the Hopper tile
(FLASH_ATTN2_FWD_SHORT_KEYS) on short and skinny shapes, with SDPA's FLASH_ATTENTION backend alongside.

Times 50 back-to-back calls between two CUDA events (GPU-bound when each call's host work is shorter than its
kernels) under torch.no_grad, for 1 (no split), the heuristic's choice ("auto") and forced counts.

    python bench/split_sweep.py [--shape 8,1,16384,16,16,128,0 ...] [--splits 1,auto,2,4] [--short-keys default,1]
"""
import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from flash_attn_cuda import flash_attn_func  # noqa: E402

SHAPES = [  # b, sq, sk, h, hk, d, causal
    (8, 1, 4096, 16, 16, 128, False),
    (8, 1, 16384, 32, 4, 128, False),
    (8, 16, 4096, 16, 16, 128, False),
    (1, 1024, 1024, 1, 1, 128, True),
    (1, 1024, 1024, 4, 4, 128, True),
    (1, 8192, 8192, 1, 1, 128, True),
]


def per_call_us(fn, calls=50):
    with torch.no_grad():
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def set_env(name, value):
    if value in ("auto", "default"):
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", help="b,sq,sk,h,hk,d,causal (repeatable; default: a fixed list)")
    p.add_argument("--splits", default="1,auto,2,4,8,16")
    p.add_argument("--short-keys", default="default", help="FLASH_ATTN2_FWD_SHORT_KEYS settings to sweep")
    a = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shape] if a.shape else SHAPES
    splits = a.splits.split(",")
    meta = common.stamp()
    print(f"[split_sweep] {meta['gpu']} commit {meta['commit']}: us per call (50 back-to-back calls)")
    print("shape (b, sq, sk, h, hk, d, causal) | short keys | " + " | ".join(splits) + " | flash")
    for b, sq, sk, h, hk, d, causal in shapes:
        causal = bool(causal)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            warnings.simplefilter("ignore")
            flash_us = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                          enable_gqa=h != hk))
        for short_keys in a.short_keys.split(","):
            set_env("FLASH_ATTN2_FWD_SHORT_KEYS", short_keys)
            cells = []
            for count in splits:
                set_env("FLASH_ATTN2_NUM_SPLITS", count)
                cells.append(f"{per_call_us(lambda: flash_attn_func(q, k, v, causal=causal)):.1f}")
            print(f"{(b, sq, sk, h, hk, d, int(causal))} | {short_keys} | " + " | ".join(cells) + f" | {flash_us:.1f}",
                  flush=True)
        os.environ.pop("FLASH_ATTN2_NUM_SPLITS", None)
        os.environ.pop("FLASH_ATTN2_FWD_SHORT_KEYS", None)


if __name__ == "__main__":
    main()
