"""Forward time against the number of key splits (FLASH_ATTN2_NUM_SPLITS) on short and skinny shapes.

Times 50 back-to-back calls between two CUDA events (GPU-bound when each call's host work is shorter than its
kernels) under torch.no_grad, for 1 (no split), the heuristic's choice ("auto") and forced counts.

    python bench/split_sweep.py
"""
import os
import sys

import torch

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
SPLITS = ["1", "auto", "2", "4", "8", "16"]


def main():
    meta = common.stamp()
    print(f"[split_sweep] {meta['gpu']} commit {meta['commit']}: us per call (50 back-to-back calls)")
    print("shape (b, sq, sk, h, hk, d, causal) | " + " | ".join(SPLITS))
    for b, sq, sk, h, hk, d, causal in SHAPES:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cells = []
        for splits in SPLITS:
            if splits == "auto":
                os.environ.pop("FLASH_ATTN2_NUM_SPLITS", None)
            else:
                os.environ["FLASH_ATTN2_NUM_SPLITS"] = splits
            with torch.no_grad():
                for _ in range(5):
                    flash_attn_func(q, k, v, causal=causal)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    flash_attn_func(q, k, v, causal=causal)
                end.record()
                torch.cuda.synchronize()
            cells.append(f"{start.elapsed_time(end) * 1e3 / 50:.1f}")
        os.environ.pop("FLASH_ATTN2_NUM_SPLITS", None)
        print(f"{(b, sq, sk, h, hk, d, causal)} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
