"""A few decoding-shaped forward calls, ours then SDPA's FLASH_ATTENTION backend, for Nsight Compute:

    ncu --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --launch-skip 3 \
        --launch-count 4 python bench/decode_profile.py

Shape (b, seqlen_q, seqlen_k, heads, head_dim) = (8, 1, 16384, 16, 128) bf16 by default: memory-bound, and
where our forward kernel took 311 us to flash's 262 us on an H200 (bench/call_overhead.py, perf log 21).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8,1,16384,16,128", help="b,seqlen_q,seqlen_k,heads,head_dim")
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    b, sq, sk, h, d = (int(x) for x in a.shape.split(","))
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from flash_attn_cuda import flash_attn_func
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with torch.no_grad():
        for _ in range(a.calls):
            flash_attn_func(q, k, v)
        torch.cuda.synchronize()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            for _ in range(a.calls):
                F.scaled_dot_product_attention(qt, kt, vt)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
