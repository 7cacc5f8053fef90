"""How often the correctness rule fails a result computed with the FlashAttention-2 arithmetic, with and without
the ulp term of tests/conftest.py, by tensor size. On the CPU, no GPU or build needed beyond the package's
reference (flash_attn_cuda.reference).

The kernel is emulated in float64 with the roundings the kernels make: P rounded to the input dtype before P V
and P^T dO, the output rounded once. For each draw of random inputs and each shape, ``out`` and ``dv`` are
checked against the float32 reference with the plain rule (2 max|ref_lowp - ref| + 1e-5 relative below 1) and
with one ulp of the largest entry added; failures are counted by the tensor's number of entries.

    python tools/checker_floors.py --draws 30 --seqlens 1,2,3,5,9,17,33 --head-dims 8,32,64
    python tools/checker_floors.py --draws 300 --seqlens 17,113 --head-dims 64,128 --batch 2 --heads 4
"""

import argparse
import collections
import itertools
import math

import torch

from flash_attn_cuda.reference import attention_ref


def rounded(x, dtype):
    return x.to(dtype).double()


def emulated(q, k, v, dout, causal):
    """(out, dv) with the FlashAttention-2 roundings, float64 elsewhere; q (batch, seqlen_q, heads, head_dim)."""
    dtype = q.dtype
    q, k, v, dout = (t.double().transpose(1, 2) for t in (q, k, v, dout))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    sq, sk = scores.shape[-2:]
    if causal:
        rows, cols = torch.arange(sq)[:, None], torch.arange(sk)[None]
        scores = scores.masked_fill(cols > rows + sk - sq, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = rounded((rounded(p, dtype) @ v) / p.sum(-1, keepdim=True), dtype)
    p = p / p.sum(-1, keepdim=True)
    dv = rounded(rounded(p, dtype).transpose(-1, -2) @ dout, dtype)
    return out.transpose(1, 2), dv.transpose(1, 2)


def reference(q, k, v, dout, causal, upcast):
    leaves = [(t.float() if upcast else t).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, None, causal, upcast=upcast)
    (dv,) = torch.autograd.grad(out, leaves[2], dout.float() if upcast else dout)
    return out.detach(), dv


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--seqlens", default="1,2,3,5,9,17,33")
    parser.add_argument("--head-dims", default="8,32,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    a = parser.parse_args()
    torch.manual_seed(a.seed)
    seqlens = [int(x) for x in a.seqlens.split(",")]
    head_dims = [int(x) for x in a.head_dims.split(",")]
    counts = collections.defaultdict(lambda: [0, 0, 0])  # entries -> [failed plain, failed with ulp, checks]
    for _ in range(a.draws):
        for dtype, sq, sk, d, causal in itertools.product(
            (torch.float16, torch.bfloat16), seqlens, seqlens, head_dims, (False, True)
        ):
            q, k, v = (torch.randn(a.batch, s, a.heads, d, dtype=dtype) for s in (sq, sk, sk))
            dout = torch.randn(a.batch, sq, a.heads, d, dtype=dtype)
            ref, lowp = reference(q, k, v, dout, causal, True), reference(q, k, v, dout, causal, False)
            for ours, r, lp in zip(emulated(q, k, v, dout, causal), ref, lowp):
                m = r.abs().max().item()
                if m == 0:
                    continue
                err = (ours - r.double()).abs().max().item()
                bound = 2 * (lp.double() - r.double()).abs().max().item() + 1e-5 * min(1.0, m)
                ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(m))
                entry = counts[r.numel()]
                entry[0] += err > bound
                entry[1] += err > bound + ulp
                entry[2] += 1
    print("entries  failed(plain)  failed(with ulp)  checks")
    for n in sorted(counts):
        print(f"{n:7d}  {counts[n][0]:13d}  {counts[n][1]:16d}  {counts[n][2]:6d}")


if __name__ == "__main__":
    main()
