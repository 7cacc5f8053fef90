"""One backward call of ours or of SDPA's flash backend, for profiling under ncu or nsys.

    ncu --kernel-name regex:flash_bwd_kernel --launch-skip 1 --launch-count 1 --set full \
        python bench/profile_bwd.py --impl ours --hdim 128

--shape b,sq,sk,h,d replaces the (tokens, hidden, seqlen, hdim) shape; the calls after the first lie in an
NVTX range "bwd", so `ncu --nvtx --nvtx-include "bwd/"` profiles every kernel of them and nothing else.
"""
import argparse

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "flash"], default="ours")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--shape", help="b,sq,sk,h,d")
    a = p.parse_args()
    b, h = a.tokens // a.seqlen, a.hidden // a.hdim
    sq = sk = a.seqlen
    d = a.hdim
    if a.shape:
        b, sq, sk, h, d = (int(x) for x in a.shape.split(","))
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    if a.impl == "ours":
        from flash_attn_cuda import flash_attn_func
        fn = lambda: flash_attn_func(q, k, v, causal=a.causal)  # noqa: E731
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        q, k, v = qt, kt, vt

        def fn():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
    out = fn()
    dout = torch.randn_like(out)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("bwd")
    for _ in range(a.calls - 1):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
