"""Small forward and backward calls for compute-sanitizer (not a pytest module): odd lengths, causal both
ways, GQA, padded head dims, strided views, deterministic mode and variable-length batches (with empty and
one-token sequences), forced split-KV forwards and forced multi-key-block backwards, so out-of-bounds reads
or writes show up as memcheck errors.

    compute-sanitizer --tool memcheck python tests/memcheck.py
"""
import itertools
import os

import torch

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func


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
    lens_q, lens_k = [0, 1, 17, 130, 64], [5, 0, 17, 77, 129]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda") for n in (lens_q, lens_k))
    head_dims = (32, 64, 96, 128, 160, 192, 224, 256)
    for head_dim, dtype, causal in itertools.product(head_dims, (torch.float16, torch.bfloat16), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True):
            continue
        # Packed (total, 3, h, d) buffers: strided q, k, v of exactly total rows each.
        q = torch.randn(sum(lens_q), 3, 4, head_dim, device="cuda", dtype=dtype)[:, 0].requires_grad_()
        kv = torch.randn(sum(lens_k), 2, 2, head_dim, device="cuda", dtype=dtype).requires_grad_()
        out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                     deterministic=causal)
        out.backward(torch.randn_like(out))
        cases += 1
    # Split-KV forwards, forced (the heuristic leaves shapes this small unsplit); 7 splits of 203 keys leave
    # some splits without a key block.
    for splits, head_dim, causal in itertools.product(("3", "7"), (32, 64, 96, 128, 256), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal):
            continue
        os.environ["FLASH_ATTN2_NUM_SPLITS"] = splits
        q = torch.randn(2, 17, 4, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, 2, 203, 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
        flash_attn_func(q, k, v, causal=causal)
        del os.environ["FLASH_ATTN2_NUM_SPLITS"]
        cases += 1
    # GQA backwards with every CTA walking its whole group (forced; a Hopper-only path), dense and varlen.
    os.environ["FLASH_ATTN2_GQA_WALK"] = "1"
    for head_dim, causal in itertools.product(head_dims, (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            continue
        q = torch.randn(2, 77, 6, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 203, 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
        out.backward(torch.randn_like(out))
        q = torch.randn(sum(lens_q), 6, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(lens_k), 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
        out.backward(torch.randn_like(out))
        cases += 2
    del os.environ["FLASH_ATTN2_GQA_WALK"]
    # Backwards with every CTA walking 3 key blocks (forced; Hopper, head dims <= 128), dense and varlen.
    os.environ["FLASH_ATTN2_BWD_KEY_BLOCKS"] = "3"
    for head_dim, causal in itertools.product((32, 64, 96, 128), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            continue
        for sq, sk in ((1, 700), (300, 200)):
            q = torch.randn(2, sq, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(2, sk, 2, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
            out.backward(torch.randn_like(out))
        q = torch.randn(sum(lens_q), 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(lens_k), 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
        out.backward(torch.randn_like(out))
        cases += 3
    del os.environ["FLASH_ATTN2_BWD_KEY_BLOCKS"]
    # Backwards on the 16-row query tile of the Hopper kernel (head dim 128; forced at every length), with
    # one and with 3 key blocks per CTA, dense and varlen.
    os.environ["FLASH_ATTN2_BWD_SHORT_QUERIES"] = "1"
    for key_blocks, causal in itertools.product(("1", "3"), (False, True)):
        if not flash_attn_cuda.kernel_available(128, torch.bfloat16, causal, backward=True):
            continue
        os.environ["FLASH_ATTN2_BWD_KEY_BLOCKS"] = key_blocks
        for sq, sk in ((1, 700), (5, 200), (40, 300)):
            q = torch.randn(2, sq, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(2, sk, 2, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
            out.backward(torch.randn_like(out))
        q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(lens_k), 2, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
        out.backward(torch.randn_like(out))
        cases += 4
    del os.environ["FLASH_ATTN2_BWD_SHORT_QUERIES"], os.environ["FLASH_ATTN2_BWD_KEY_BLOCKS"]
    # Head dim 128 forwards on the regular Hopper tile, which the short keys above leave to the short-key tile.
    os.environ["FLASH_ATTN2_FWD_SHORT_KEYS"] = "0"
    for dtype, causal in itertools.product((torch.float16, torch.bfloat16), (False, True)):
        if not flash_attn_cuda.kernel_available(128, dtype, causal):
            continue
        for sq, sk in ((1, 17), (113, 77), (77, 203)):
            q = torch.randn(2, sq, 4, 128, device="cuda", dtype=dtype)
            k, v = torch.randn(2, 2, sk, 2, 128, device="cuda", dtype=dtype).unbind(0)
            flash_attn_func(q, k, v, causal=causal)
            cases += 1
    del os.environ["FLASH_ATTN2_FWD_SHORT_KEYS"]
    torch.cuda.synchronize()
    print(f"memcheck: {cases} calls done")


if __name__ == "__main__":
    main()
