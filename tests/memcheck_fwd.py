"""Small forward calls for compute-sanitizer (not a pytest module): odd lengths, causal both ways,
GQA, padded head dims and strided views, so out-of-bounds reads or writes show up as memcheck errors.

    compute-sanitizer --tool memcheck python tests/memcheck_fwd.py
"""
import torch

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func


def main():
    torch.manual_seed(0)
    cases = 0
    for head_dim in (32, 40, 64, 96, 128, 160, 192, 224, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                if not flash_attn_cuda.kernel_available(head_dim, dtype, causal):
                    continue
                for sq, sk in ((1, 17), (17, 1), (113, 77), (77, 203), (130, 130)):
                    # A packed (b, s, 3, h, d) buffer gives strided q, k, v views.
                    qkv = torch.randn(2, max(sq, sk), 3, 4, head_dim, device="cuda", dtype=dtype)
                    q = qkv[:, :sq, 0]
                    k = qkv[:, :sk, 1, :2]
                    v = qkv[:, :sk, 2, :2]
                    flash_attn_func(q, k, v, causal=causal)
                    cases += 1
    torch.cuda.synchronize()
    print(f"memcheck_fwd: {cases} calls done")


if __name__ == "__main__":
    main()
