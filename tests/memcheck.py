"""Small forward and backward calls for compute-sanitizer (not a pytest module): odd lengths, causal both
ways, GQA, padded head dims, strided views and deterministic mode, so out-of-bounds reads or writes show up
as memcheck errors.

    compute-sanitizer --tool memcheck python tests/memcheck.py
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
                with_bwd = flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True)
                for i, (sq, sk) in enumerate(((1, 17), (17, 1), (113, 77), (77, 203), (130, 130))):
                    # A packed (b, s, 3, h, d) buffer gives strided q, k, v views.
                    qkv = torch.randn(2, max(sq, sk), 3, 4, head_dim, device="cuda", dtype=dtype)
                    qkv.requires_grad_(with_bwd)
                    q = qkv[:, :sq, 0]
                    k = qkv[:, :sk, 1, :2]
                    v = qkv[:, :sk, 2, :2]
                    out = flash_attn_func(q, k, v, causal=causal, deterministic=i % 2 == 1)
                    if with_bwd:
                        out.backward(torch.randn_like(out))
                    cases += 1
    torch.cuda.synchronize()
    print(f"memcheck: {cases} calls done")


if __name__ == "__main__":
    main()
