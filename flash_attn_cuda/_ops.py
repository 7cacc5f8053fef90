"""Loads the compiled ops (torch.ops.flash_attn2.*) and registers their fake implementations and autograd.

The op library (_C) uses only PyTorch's stable ABI, so one build loads into every torch from 2.11 on; that ABI
has no autograd. Autograd of fwd and varlen_fwd comes from one of two places:

- C++ (csrc/host/autograd/autograd.cpp): a small library per torch minor version, built against that version's
  headers (setup.py's FLASH_ATTN2_AUTOGRAD_TORCH) and loaded only into it, as _autograd_torch<major>_<minor>.
  This is today's host cost: the backward node is recorded without leaving C++.
- Python, on a torch the build has no such library for (or with FLASH_ATTN2_PYTHON_AUTOGRAD=1 in the
  environment, read at import): torch.library.register_autograd, which torch.compile, TorchScript and direct
  op calls use. Eager calls from the public functions take ``fwd`` / ``varlen_fwd`` below instead, which run the
  same setup_context and backward through a plain autograd.Function and dispatch below autograd when nothing
  requires grad: the registered Python autograd kernel costs every call, with or without grad, several
  microseconds more. Even so, host-bound calls cost more than with the C++ library (perf log, entry 38).
"""

import functools
import importlib
import os
import warnings

import torch

from . import _C  # noqa: F401  (loading the library registers the ops)

from ._kernel_list import HEAD_DIMS as KERNEL_HEAD_DIMS, kernel_name

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

_FWD = torch.ops.flash_attn2.fwd.default
_BWD = torch.ops.flash_attn2.bwd.default
_VARLEN_FWD = torch.ops.flash_attn2.varlen_fwd.default
_VARLEN_BWD = torch.ops.flash_attn2.varlen_bwd.default


@torch.library.register_fake("flash_attn2::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, num_splits=0, plan_override="",
              window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic=False, plan_override="",
              window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    # The op returns contiguous gradients whatever the strides of q, k and v.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flash_attn2::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic=False, plan_override="", window_left=-1, window_right=-1, softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0, rng_state=None):
    total_q, nheads, head_dim = q.shape
    out = q.new_empty((total_q, nheads, head_dim))
    softmax_lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, deterministic=False, plan_override="", window_left=-1, window_right=-1,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flash_attn2::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=1.0, causal=False,
                      window_left=-1, window_right=-1, softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                      num_splits=0, plan_override=""):
    # The caches are mutated in place (the schema says so); the outputs are new.
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn2::varlen_fwd_paged")
def _varlen_fwd_paged_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                           softmax_scale, causal, plan_override="", window_left=-1, window_right=-1, softcap=0.0,
                           alibi_slopes=None):
    total_q, nheads, head_dim = q.shape
    out = q.new_empty((total_q, nheads, head_dim))
    softmax_lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, softmax_lse


# Dropout's rng_state: int64 (2,) [seed, offset] on the device, drawn from torch's generator for each call. An op
# of its own, tagged nondeterministic_seeded, so that under torch.compile it runs as in eager mode (Inductor would
# otherwise lower torch.randint to its own generator, and compiled and eager runs of one seed would differ), is
# never deduplicated or recomputed for the backward, and in a CUDA graph is drawn again at every replay.
torch.library.define("flash_attn2::rng_state", "(Tensor like) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))


@torch.library.impl("flash_attn2::rng_state", "CompositeExplicitAutograd")
def _rng_state(like):
    return torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=like.device)


@torch.library.register_fake("flash_attn2::rng_state")
def _rng_state_fake(like):
    return like.new_empty((2,), dtype=torch.int64)


def rng_state(like: torch.Tensor) -> torch.Tensor:
    """A fresh dropout rng_state on like's device: torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64)."""
    return torch.ops.flash_attn2.rng_state(like)


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


def kernel_available(head_dim: int, dtype: torch.dtype, causal: bool, backward: bool = False,
                     variants: bool = False) -> bool:
    """Whether this build contains the forward kernel (and, with ``backward``, also the backward kernel)
    that a call with these settings needs (``variants``: a call with a window, softcap, ALiBi or dropout)."""
    if dtype not in _DTYPE_NAMES:
        return False
    passes = ("fwd", "bwd") if backward else ("fwd",)
    names = compiled_kernels()
    return all(kernel_name(pass_, kernel_head_dim(head_dim), _DTYPE_NAMES[dtype], causal, variants) in names
               for pass_ in passes)


# Autograd. The backward ops have none of their own (no double backward, as in flash-attn 2.x). As there, the
# LSE is an output that requires grad but passes no gradient back.


def _out_grad(dout, out):
    """The gradient of ``out`` as the backward kernels read it: contiguous, and zeros when the loss did not use
    out (grads are not materialized, so it then arrives as None)."""
    if dout is None:
        return torch.zeros_like(out, memory_format=torch.contiguous_format)
    return dout.contiguous()


# The trailing attention-variant arguments of every op: window_left, window_right, softcap, alibi_slopes,
# dropout_p, rng_state. The backward gets the forward's, rng_state included, from which it regenerates the
# forward's dropout mask.
_NUM_VARIANT_ARGS = 6


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, _num_splits, plan_override = inputs[:8]
    window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state = inputs[8:]
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, alibi_slopes, rng_state)
    # The plan override reaches the backward too, so a forced path holds for both passes.
    ctx.settings = (softmax_scale, causal, deterministic, plan_override)
    ctx.variants = (window_left, window_right, softcap, dropout_p)
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, softmax_lse, alibi_slopes, rng_state = ctx.saved_tensors
    window_left, window_right, softcap, dropout_p = ctx.variants
    dq, dk, dv = _BWD(_out_grad(dout, out), q, k, v, out, softmax_lse, *ctx.settings, window_left, window_right,
                      softcap, alibi_slopes, dropout_p, rng_state)
    return (dq, dk, dv) + (None,) * (5 + _NUM_VARIANT_ARGS)


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, \
        plan_override = inputs[:11]
    window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state = inputs[11:]
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    ctx.settings = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, plan_override)
    ctx.variants = (window_left, window_right, softcap, dropout_p)
    ctx.set_materialize_grads(False)


def _varlen_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    window_left, window_right, softcap, dropout_p = ctx.variants
    dq, dk, dv = _VARLEN_BWD(_out_grad(dout, out), q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                             *ctx.settings, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    return (dq, dk, dv) + (None,) * (8 + _NUM_VARIANT_ARGS)


def _load_cpp_autograd():
    """Imports the C++ autograd library built for the running torch's minor version. Returns its torch version
    ("2.11"), or None where there is none (or FLASH_ATTN2_PYTHON_AUTOGRAD=1 asks for Python)."""
    if os.environ.get("FLASH_ATTN2_PYTHON_AUTOGRAD") == "1":
        return None
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    name = f"{__package__}._autograd_torch{minor.replace('.', '_')}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return None
    except ImportError as error:  # built for this minor version, yet it does not load: Python autograd is exact
        warnings.warn(f"flash_attn_cuda: {name} did not load ({error}); autograd runs in Python", RuntimeWarning)
        return None
    return minor


# "C++ (torch 2.11)" or "Python": where autograd of the forward ops runs (python -m flash_attn_cuda.info says).
_CPP_AUTOGRAD_TORCH = _load_cpp_autograd()
AUTOGRAD = f"C++ (torch {_CPP_AUTOGRAD_TORCH})" if _CPP_AUTOGRAD_TORCH else "Python"

if _CPP_AUTOGRAD_TORCH is None:
    torch.library.register_autograd("flash_attn2::fwd", _fwd_backward, setup_context=_fwd_setup_context)
    torch.library.register_autograd("flash_attn2::varlen_fwd", _varlen_fwd_backward,
                                    setup_context=_varlen_fwd_setup_context)

_below_autograd = torch._C._AutoDispatchBelowAutograd


def _eager_function(name, op_name, setup_context, backward):
    """An autograd.Function that runs the op `op_name` (a global of this module, looked up per call) below
    autograd, then the registered setup_context; its backward is the registered one."""

    def forward(ctx, *inputs):
        with _below_autograd():
            output = globals()[op_name](*inputs)
        setup_context(ctx, inputs, output)
        return output

    # Function.apply of torch 2.11 binds default arguments and walks the arguments for functorch wrappers in
    # Python before reaching this C++ entry point; _call() uses it only outside functorch transforms. (Dead
    # functorch wrappers that escaped a transform, which that walk unwraps, reach the op as they are.)
    return type(name, (torch.autograd.Function,), {"apply": torch._C._FunctionBase.__dict__["apply"],
                                                   "forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


_Fwd = _eager_function("_Fwd", "_FWD", _fwd_setup_context, _fwd_backward)
_VarlenFwd = _eager_function("_VarlenFwd", "_VARLEN_FWD", _varlen_fwd_setup_context, _varlen_fwd_backward)


def _call(op, function, args, compiling):
    """op(*args) with autograd in Python: through `function` when an eager call records a backward node, below
    autograd when none is recorded, and as registered (torch.compile, functorch transforms) otherwise."""
    if compiling or torch._C._are_functorch_transforms_active():
        return op(*args)
    q, k, v = args[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return function.apply(*args)
    with _below_autograd():
        return op(*args)


def fwd(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, variants, compiling):
    """torch.ops.flash_attn2.fwd with its autograd; eager calls skip a registered Python autograd kernel.
    variants: the six trailing variant arguments (window_left, window_right, softcap, alibi_slopes, dropout_p,
    rng_state)."""
    args = (q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, *variants)
    if _CPP_AUTOGRAD_TORCH is not None:
        return _FWD(*args)
    return _call(_FWD, _Fwd, args, compiling)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               deterministic, plan_override, variants, compiling):
    """torch.ops.flash_attn2.varlen_fwd with its autograd, as fwd()."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
            plan_override, *variants)
    if _CPP_AUTOGRAD_TORCH is not None:
        return _VARLEN_FWD(*args)
    return _call(_VARLEN_FWD, _VarlenFwd, args, compiling)
