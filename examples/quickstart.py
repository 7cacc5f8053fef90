"""flash_attn_cuda in a few calls, on a CUDA GPU in bf16: flash_attn_func, one decoding step with
flash_attn_with_kvcache, and PyTorch's scaled_dot_product_attention running these kernels. Each result is checked
against another path to the same attention, within bf16's rounding (TOLERANCE).

    python examples/quickstart.py

Exits with status 1, saying what is missing, when there is no CUDA GPU or no built flash_attn_cuda.
"""

import os
import sys

# The checkout, last: an installed flash_attn_cuda wins; an in-place build (setup.py build_ext --inplace) also works.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Largest difference accepted between two bf16 results of the same attention: outputs here are at most a few units,
# where bf16 keeps 8 bits of mantissa.
TOLERANCE = 0.05

BUILD_HINT = (
    "build it first, e.g. FLASH_ATTN2_HDIMS=128 FLASH_ATTN2_DTYPES=bf16 FLASH_ATTN2_CUDA_ARCHS=80 "
    "pip install --no-build-isolation -v -e .  (README.md, 'Set up from source')"
)


def fail(message):
    print(f"quickstart: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        fail("needs PyTorch >= 2.11 (pip install torch)")
    try:
        import flash_attn_cuda
        from flash_attn_cuda import flash_attn_func, flash_attn_with_kvcache
    except Exception as error:  # ImportError, or the extension failing to load
        fail(f"needs the flash_attn_cuda extension, which did not import ({error}); {BUILD_HINT}")
    if not torch.cuda.is_available():
        fail("needs a CUDA GPU of compute capability 8.0 or newer, and torch sees none")
    if torch.cuda.get_device_capability() < (8, 0):
        fail(f"needs a GPU of compute capability 8.0 or newer; {torch.cuda.get_device_name()} is older")
    # Any head dim this build has kernels for (a quick-start build may hold one); 128 first.
    dtype = torch.bfloat16
    d = next(
        (hd for hd in (128, 64, 256, 96, 32, 160, 192, 224) if flash_attn_cuda.kernel_available(hd, dtype, True)),
        None,
    )
    if d is None or not flash_attn_cuda.kernel_available(d, dtype, True, variants=True):
        fail(f"this build has no bf16 kernels for one head dim (forward and KV cache); {BUILD_HINT}")

    torch.manual_seed(0)
    b, s, h = 2, 1024, 16  # q, k, v: (batch, seqlen, nheads, head_dim)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=True)
    report("flash_attn_func", out, "float32 SDPA", ref.transpose(1, 2))

    # One decoding step: the cache holds s tokens and room for 64 more; k1, v1 are written at row s in place.
    k_cache, v_cache = (torch.cat([x, x.new_zeros(b, 64, h, d)], dim=1) for x in (k, v))
    cache_seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    q1, k1, v1 = (torch.randn_like(x[:, :1]) for x in (q, k, v))
    out1 = flash_attn_with_kvcache(q1, k_cache, v_cache, k=k1, v=v1, cache_seqlens=cache_seqlens, causal=True)
    full = flash_attn_func(q1, torch.cat([k, k1], dim=1), torch.cat([v, v1], dim=1), causal=True)
    report("flash_attn_with_kvcache", out1, "flash_attn_func", full)

    flash_attn_cuda.sdpa.activate()  # SDPA's flash backend runs these kernels until deactivate()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            y = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    finally:
        flash_attn_cuda.sdpa.deactivate()
    report("scaled_dot_product_attention (activated)", y.transpose(1, 2), "flash_attn_func", out)
    print("quickstart: all results agree")


def report(name, out, other_name, other):
    error = (out.float() - other.float()).abs().max().item()
    print(f"{name}: out {tuple(out.shape)}, max |out - {other_name}| {error:.3g}")
    if not error <= TOLERANCE:
        fail(f"{name} differs from {other_name} by {error:.3g}, more than {TOLERANCE}")


if __name__ == "__main__":
    main()
