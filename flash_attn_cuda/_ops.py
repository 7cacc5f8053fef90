"""Loads the compiled ops (torch.ops.flash_attn2.*) and registers their fake implementations.

Autograd for fwd and varlen_fwd is registered in C++ (csrc/autograd.cpp).
"""

import functools

import torch

from . import _C  # noqa: F401  (loading the library registers the ops)

from ._kernel_list import HEAD_DIMS as KERNEL_HEAD_DIMS, kernel_name

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@torch.library.register_fake("flash_attn2::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, num_splits=0, plan_override=""):
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic=False, plan_override=""):
    # The op returns contiguous gradients whatever the strides of q, k and v.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flash_attn2::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic=False, plan_override=""):
    total_q, nheads, head_dim = q.shape
    out = q.new_empty((total_q, nheads, head_dim))
    softmax_lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, deterministic=False, plan_override=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@functools.cache
def compiled_kernels() -> frozenset:
    """Names of the kernels in this build, e.g. 'fwd_hdim128_bf16_causal' or 'bwd_hdim64_fp16_noncausal'."""
    return frozenset(torch.ops.flash_attn2.compiled_kernels())


def kernel_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves `head_dim` (after padding to a multiple of 8)."""
    for kernel_dim in KERNEL_HEAD_DIMS:
        if head_dim <= kernel_dim:
            return kernel_dim
    raise ValueError(f"head_dim must be at most {KERNEL_HEAD_DIMS[-1]}, got {head_dim}")


def kernel_available(head_dim: int, dtype: torch.dtype, causal: bool, backward: bool = False) -> bool:
    """Whether this build contains the forward kernel (and, with ``backward``, also the backward kernel)
    that a call with these settings needs."""
    if dtype not in _DTYPE_NAMES:
        return False
    passes = ("fwd", "bwd") if backward else ("fwd",)
    names = compiled_kernels()
    return all(kernel_name(pass_, kernel_head_dim(head_dim), _DTYPE_NAMES[dtype], causal) in names for pass_ in passes)
