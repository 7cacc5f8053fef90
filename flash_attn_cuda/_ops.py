"""Loads the compiled ops (torch.ops.flash_attn2.*) and registers their fake implementations."""

import functools

import torch

from . import _C  # noqa: F401  (loading the library registers the ops)

KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@torch.library.register_fake("flash_attn2::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic=False):
    # The op returns contiguous gradients whatever the strides of q, k and v.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, *rest = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = bool(rest[0]) if rest else False


def _fwd_backward(ctx, grad_out, grad_softmax_lse):
    # The LSE is an auxiliary output: its gradient is not propagated (as in flash-attn 2.x).
    q, k, v, out, softmax_lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_attn2.bwd(
        grad_out.contiguous(), q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.causal, ctx.deterministic,
    )
    return dq, dk, dv, None, None, None


torch.library.register_autograd("flash_attn2::fwd", _fwd_backward, setup_context=_fwd_setup_context)


@torch.library.register_fake("flash_attn2::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic=False):
    total_q, nheads, head_dim = q.shape
    out = q.new_empty((total_q, nheads, head_dim))
    softmax_lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = bool(rest[0]) if rest else False


def _varlen_fwd_backward(ctx, grad_out, grad_softmax_lse):
    q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_attn2.varlen_bwd(
        grad_out.contiguous(), q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
        ctx.softmax_scale, ctx.causal, ctx.deterministic,
    )
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("flash_attn2::varlen_fwd", _varlen_fwd_backward,
                                setup_context=_varlen_fwd_setup_context)


def _eager_autograd(name, setup_context, backward):
    """Calls torch.ops.flash_attn2.<name> with the autograd registered above, minus the per-call cost of
    torch.library's Python autograd wrapper.

    That wrapper runs at the op's Autograd dispatch key on every call, and costs tens of microseconds with
    inputs that require grad (more than the kernels of a decoding step; bench/results/perf_log.md, entry 20).
    In eager mode the same setup_context and backward run in a plain autograd.Function instead, and the op is
    dispatched below autograd; under torch.compile the op is called as registered, so it traces as one node.
    """

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = getattr(torch.ops.flash_attn2, name)(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    def call(*args):
        op = getattr(torch.ops.flash_attn2, name)  # looked up per call, so tests can substitute the op
        if torch.compiler.is_compiling():
            return op(*args)
        # q, k and v come first; the other tensor arguments (cu_seqlens) never require grad.
        if torch.is_grad_enabled() and (args[0].requires_grad or args[1].requires_grad or args[2].requires_grad):
            return Function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return call


fwd = _eager_autograd("fwd", _fwd_setup_context, _fwd_backward)
varlen_fwd = _eager_autograd("varlen_fwd", _varlen_fwd_setup_context, _varlen_fwd_backward)


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
    suffix = f"hdim{kernel_head_dim(head_dim)}_{_DTYPE_NAMES[dtype]}_{'causal' if causal else 'noncausal'}"
    names = compiled_kernels()
    if backward and f"bwd_{suffix}" not in names:
        return False
    name = f"fwd_{suffix}"
    return name in compiled_kernels()
