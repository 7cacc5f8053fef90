"""PyTorch's scaled_dot_product_attention on this library's kernels.

When ``torch.nn.functional.scaled_dot_product_attention`` picks its flash backend for CUDA tensors, it calls the
aten op ``_scaled_dot_product_flash_attention`` and, for the gradients, ``_scaled_dot_product_flash_attention_
backward``; nested tensors and ``torch.nn.attention.varlen`` call ``_flash_attention_forward`` and
``_flash_attention_backward`` (over (batch, seqlen, nheads, head_dim) tensors, or packed variable-length ones).
``activate()`` replaces the CUDA kernels of those ops in PyTorch's dispatcher with ones that run this library's
kernels; ``deactivate()`` puts PyTorch's back. Everything above the ops stays PyTorch's: backend selection, the
head-dim padding, autograd, torch.compile's graphs.

Importing this module registers the implementation with ``torch.nn.attention``'s registry of flash attention
implementations under the name ``"flash_attn_cuda"``, without activating it (the registry's contract: users opt
in), so ``torch.nn.attention.activate_flash_attention_impl("flash_attn_cuda")`` and
``torch.nn.attention.restore_flash_attention_impl()`` work as well. Every torch this package supports (2.11 and
newer) has that registry.

A call that these kernels cannot serve runs PyTorch's own kernel (the one replaced, kept at activation), never an
error: another dtype or device, a V head dim other than Q's, a head dim that is not a multiple of 8 or is above
256, a negative scale, empty tensors, a GPU this build has no kernel image for, a kernel this build left out, and
the forward-only arguments ``return_debug_mask``, ``seqused_k``, ``alibi_slopes`` and ``block_table`` (the aten
backward cannot honor the last three, so PyTorch's semantics are kept). ``calls`` counts what ran where.

Dropout: a forward with dropout draws its own seed and offset (from torch's CUDA generator) and returns them as
the op's rng_state, from which the backward regenerates the mask. The backward runs here only for an rng_state
that a forward here made; any other (a forward that ran PyTorch's kernel, or ran before ``activate()``) goes to
PyTorch's backward, whose dropout stream it matches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import torch

from . import _ops, info
from ._kernel_list import kernel_name
from .interface import _kernel_ready
from .plan import forced

NAME = "flash_attn_cuda"

_log = logging.getLogger(__name__)

NOT_ON_ONE_GPU = "tensors not on one CUDA device"

# What ran where since import: "forward" and "backward" for calls served here, "fallback_forward" and
# "fallback_backward" for calls handed to PyTorch's kernels (each also logged at DEBUG level with its reason).
# PyTorch's SDPA kernels call _flash_attention_forward/_backward through the dispatcher, which brings that inner
# call back here: one SDPA call that falls back counts two fallbacks, the inner one for the same reason.
calls: collections.Counter = collections.Counter()

_DTYPES = (torch.float16, torch.bfloat16)
# The attention ops, looked up through this name so that tests of the glue can stand a reference in for them.
_OPS = torch.ops.flash_attn2
_ALIGN = 8  # elements: the kernels' 16-byte loads, which SDPA's own head-dim padding already provides

# A forward here returns its dropout rng_state as a (2,) view of a 3-element buffer: the extra element is the mark
# by which the backward, which sees only the tensor, knows that this library drew it. Storage size is host-side
# metadata: reading it costs no device synchronization. A copy of the state (saved-tensor hooks that offload
# activations make one) loses that mark, so the values carry one too: the kernels read only the low 32 bits of the
# offset, and the high 32 hold _OFFSET_TAG, which PyTorch's offsets (counts of random numbers drawn) do not reach.
_MARKED_RNG_BYTES = 3 * 8
_OFFSET_TAG = 0x53445041


def _aten(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.aten, name).default


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, the ones the dispatcher left out (defaults) filled in from the schema."""
    values = dict(kwargs)
    for argument, value in zip(op._schema.arguments, args):
        values[argument.name] = value
    for argument in op._schema.arguments:
        if argument.name not in values:
            values[argument.name] = argument.default_value if argument.has_default_value() else None
    return values


@functools.cache
def _runs_on(device_index: int) -> bool:
    """Whether this build has a kernel image for the GPU (info.kernel_image, from the build's arch lists)."""
    build = info.load_build_info()
    if build is None or build.get("archs") is None:
        return False
    capability = torch.cuda.get_device_capability(device_index)
    return info.kernel_image(capability, build["archs"], build.get("ptx_archs") or ()) is not None


def _deterministic() -> bool:
    """torch.use_deterministic_algorithms(True), as PyTorch's flash kernels read it: warn-only mode keeps the
    faster, non-deterministic backward (and PyTorch's warning)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _window(size) -> int:
    return -1 if size is None else int(size)


def _kernels(dropout_p, causal, window_left, window_right, head_dim, dtype) -> tuple[str, str]:
    """The names of the forward and backward kernels the plan runs for these arguments (csrc/host/plan.cpp,
    problem_of): a right edge of 0 with causal, or the window (-1, 0), is plain causal; a left edge, or a right one
    past the diagonal without causal, takes the variants kernels; dropout alone runs on the plain forward kernel
    and the variants backward."""
    masked = bool(causal) or window_left >= 0 or window_right >= 0
    window = window_left >= 0 or (not causal and window_right > 0)
    kernel_dim, dtype_name = _ops.kernel_head_dim(head_dim), _ops._DTYPE_NAMES[dtype]
    return (
        kernel_name("fwd", kernel_dim, dtype_name, masked, window),
        kernel_name("bwd", kernel_dim, dtype_name, masked, window or dropout_p > 0.0),
    )


def _unserved(q, k, v, dropout_p, causal, scale, window_left, window_right) -> str | None:
    """Why the kernels here cannot run attention over these tensors, or None when they can. Forward and backward
    ask the same question of the same tensors, so a pass never pairs with the other library's other pass."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}, {k.dtype}, {v.dtype}"
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return "head dims of q, k and v differ"
    if head_dim % _ALIGN != 0 or head_dim > 256:
        return f"head dim {head_dim}"
    if q.numel() == 0 or k.numel() == 0:
        return "empty tensors"
    if scale is not None and scale < 0:
        return "negative scale"
    if not q.is_cuda or k.device != q.device or v.device != q.device:
        return NOT_ON_ONE_GPU
    if not _runs_on(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "no kernel image for this GPU in this build"
    if not set(_kernels(dropout_p, causal, window_left, window_right, head_dim, q.dtype)) <= _ops.compiled_kernels():
        return "kernel not in this build"
    return None


def _like(reference: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """result in the layout of torch.empty_like(reference), which PyTorch's kernels and their meta functions give
    these outputs (and torch.compile's graphs assume): result itself when it has it, else a copy."""
    expected = torch.empty_like(reference)
    if expected.stride() == result.stride():
        return result
    return expected.copy_(result)


def _rng_state(q: torch.Tensor) -> torch.Tensor:
    """A fresh int64 (seed, offset) drawn from torch's CUDA generator (as _ops.rng_state), marked as this library's
    by its storage and by the offset's high word."""
    state = torch.empty(3, dtype=torch.int64, device=q.device)[:2]
    torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=q.device, out=state)
    state[1:].bitwise_and_(0xFFFFFFFF).bitwise_or_(_OFFSET_TAG << 32)
    return state


def _drawn_here(rng_state: torch.Tensor) -> bool:
    """Whether a forward here drew this dropout rng_state: from its storage when it is the tensor the forward
    returned (no synchronization), else from the offset's high word, read from the device."""
    if rng_state.numel() != 2:
        return False
    if rng_state.untyped_storage().nbytes() == _MARKED_RNG_BYTES:
        return True
    if rng_state.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "flash_attn_cuda.sdpa: the backward of an SDPA call with dropout got a copy of the forward's rng_state "
            "(saved-tensor hooks?), and telling whose dropout mask it is means reading it, which a CUDA graph "
            "capture cannot do"
        )
    offset = int(rng_state.view(torch.int64)[1])
    return (offset >> 32) & 0xFFFFFFFF == _OFFSET_TAG


def _fallback(kind: str, reason: str, original, keyset, args, kwargs):
    calls[f"fallback_{kind}"] += 1
    _log.debug("flash_attn_cuda.sdpa: %s runs PyTorch's kernel: %s", kind, reason)
    if original is None:
        raise RuntimeError(f"flash_attn_cuda.sdpa: the {kind} cannot run here ({reason}) and PyTorch has no kernel")
    return original.call_boxed(keyset, *args, **kwargs)


def _varlen_sizes(a: dict) -> tuple:
    """The varlen ops' (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) from the aten arguments `a`."""
    return a["cum_seq_q"], a["cum_seq_k"], int(a["max_q"]), int(a["max_k"])


def _forward(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, rng_state) of _flash_attention_forward's arguments `a`, dense or variable-length, on these
    kernels; out in the layout of empty_like(query), rng_state int64 (marked) or None without dropout."""
    q, k, v = (_kernel_ready(a[name], a[name].shape[-1], False) for name in ("query", "key", "value"))
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    dropout_p = float(a["dropout_p"])
    rng_state = _rng_state(q) if dropout_p > 0.0 else None
    num_splits, plan_override = forced()
    if a.get("num_splits") is not None:
        num_splits = int(a["num_splits"])
    deterministic = _deterministic()
    variants = (_window(a["window_size_left"]), _window(a["window_size_right"]), 0.0, None, dropout_p, rng_state, None)
    if a["cum_seq_q"] is None:
        out, lse = _OPS.fwd(
            q, k, v, float(scale), bool(a["is_causal"]), deterministic, num_splits, plan_override, *variants
        )
    else:
        out, lse = _OPS.varlen_fwd(
            q,
            k,
            v,
            *_varlen_sizes(a),
            float(scale),
            bool(a["is_causal"]),
            deterministic,
            plan_override,
            *variants,
        )
    calls["forward"] += 1
    return _like(a["query"], out), lse, rng_state


def _forward_unserved(a: dict) -> str | None:
    for name in ("seqused_k", "alibi_slopes", "block_table"):
        if a.get(name) is not None:
            return f"{name} is given"
    if a["return_debug_mask"]:
        return "return_debug_mask is set"
    varlen = a["cum_seq_q"] is not None
    if (a["cum_seq_k"] is not None) != varlen or a["query"].dim() != (3 if varlen else 4):
        return "a layout other than (batch, seqlen, nheads, head_dim) or packed variable-length"
    if varlen and any(
        a[name].dtype != torch.int32 or a[name].dim() != 1 or a[name].device != a["query"].device
        for name in ("cum_seq_q", "cum_seq_k")
    ):
        return "cumulative lengths that are not int32 (batch + 1,) on the query's device"
    return _unserved(
        a["query"],
        a["key"],
        a["value"],
        a["dropout_p"],
        a["is_causal"],
        a["scale"],
        _window(a["window_size_left"]),
        _window(a["window_size_right"]),
    )


def _aux_outputs(q: torch.Tensor, rng_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rng_state, unused, debug_attn_mask) as the aten schema returns them: uint64 (2,) and (), and an empty mask."""
    if rng_state is None:
        rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    return rng_state.view(torch.uint64), unused, torch.empty(0, dtype=q.dtype, device=q.device)


def _backward(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """(dq, dk, dv) of _flash_attention_backward's arguments `a` on these kernels, in the layouts of empty_like of
    query, key and value; or why they cannot run here."""
    dropout_p = float(a["dropout_p"])
    window_left, window_right = _window(a["window_size_left"]), _window(a["window_size_right"])
    reason = _unserved(
        a["query"], a["key"], a["value"], dropout_p, a["is_causal"], a["scale"], window_left, window_right
    )
    if reason is not None:
        return reason
    rng_state = None
    if dropout_p > 0.0:
        if not _drawn_here(a["rng_state"]):
            return "the forward's dropout rng_state comes from PyTorch's kernel"
        rng_state = a["rng_state"].view(torch.int64)
    q, k, v = (_kernel_ready(a[name], a[name].shape[-1], False) for name in ("query", "key", "value"))
    dout = a["grad_out"].contiguous()
    out = _kernel_ready(a["out"], a["out"].shape[-1], False)
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    plan_override = forced()[1]
    deterministic = _deterministic()
    variants = (window_left, window_right, 0.0, None, dropout_p, rng_state, None)
    # varlen_bwd takes bwd's arguments with the lengths after the LSE.
    varlen = a["cum_seq_q"] is not None
    op, sizes = (_OPS.varlen_bwd, _varlen_sizes(a)) if varlen else (_OPS.bwd, ())
    dq, dk, dv, _ = op(
        dout,
        q,
        k,
        v,
        out,
        a["logsumexp"],
        *sizes,
        float(scale),
        bool(a["is_causal"]),
        deterministic,
        plan_override,
        *variants,
    )
    calls["backward"] += 1
    return _like(a["query"], dq), _like(a["key"], dk), _like(a["value"], dv)


@dataclasses.dataclass
class _Kernels:
    """The kernels this implementation replaces (PyTorch's, kept to run the calls it cannot serve) and its own."""

    originals: dict

    def flash_forward(self, keyset, *args, **kwargs):
        name = "_flash_attention_forward"
        a = _bind(_aten(name), args, kwargs)
        reason = _forward_unserved(a)
        if reason is not None:
            return _fallback("forward", reason, self.originals[name], keyset, args, kwargs)
        out, lse, rng_state = _forward(a)
        return (out, lse, *_aux_outputs(out, rng_state))

    def flash_forward_inplace(self, keyset, *args, **kwargs):
        name = "_flash_attention_forward_no_dropout_inplace"
        a = _bind(_aten(name), args, kwargs)
        reason = _forward_unserved(a)
        if reason is not None:
            return _fallback("forward", reason, self.originals[name], keyset, args, kwargs)
        out, lse, _ = _forward(a)
        a["out"].copy_(out)
        return lse

    def flash_backward(self, keyset, *args, **kwargs):
        name = "_flash_attention_backward"
        a = _bind(_aten(name), args, kwargs)
        grads = _backward(a)
        if isinstance(grads, str):
            return _fallback("backward", grads, self.originals[name], keyset, args, kwargs)
        return grads

    def sdpa_forward(self, keyset, *args, **kwargs):
        name = "_scaled_dot_product_flash_attention"
        s = _bind(_aten(name), args, kwargs)
        query, key, value = s["query"], s["key"], s["value"]
        a = {
            "query": query.transpose(1, 2) if query.dim() == 4 else query,
            "key": key.transpose(1, 2) if key.dim() == 4 else key,
            "value": value.transpose(1, 2) if value.dim() == 4 else value,
            "cum_seq_q": None,
            "cum_seq_k": None,
            "dropout_p": s["dropout_p"],
            "is_causal": s["is_causal"],
            "return_debug_mask": s["return_debug_mask"],
            "scale": s["scale"],
            "window_size_left": None,
            "window_size_right": None,
        }
        reason = _forward_unserved(a)
        if reason is not None:
            return _fallback("forward", reason, self.originals[name], keyset, args, kwargs)
        out, lse, rng_state = _forward(a)
        rng, unused, debug_mask = _aux_outputs(out, rng_state)
        return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], rng, unused, debug_mask

    def sdpa_backward(self, keyset, *args, **kwargs):
        name = "_scaled_dot_product_flash_attention_backward"
        s = _bind(_aten(name), args, kwargs)
        if s["query"].dim() != 4:
            return _fallback("backward", "query is not 4-D", self.originals[name], keyset, args, kwargs)
        a = {name: s[name].transpose(1, 2) for name in ("grad_out", "query", "key", "value", "out")}
        a.update(
            logsumexp=s["logsumexp"],
            cum_seq_q=None,
            cum_seq_k=None,
            max_q=s["max_q"],
            max_k=s["max_k"],
            dropout_p=s["dropout_p"],
            is_causal=s["is_causal"],
            rng_state=s["philox_seed"],
            scale=s["scale"],
            window_size_left=None,
            window_size_right=None,
        )
        grads = _backward(a)
        if isinstance(grads, str):
            return _fallback("backward", grads, self.originals[name], keyset, args, kwargs)
        return tuple(g.transpose(1, 2) for g in grads)


# aten op -> the _Kernels method that replaces its CUDA kernel. _flash_attention_forward_no_dropout_inplace is
# newer than torch 2.11; an op the running torch lacks is skipped.
_REPLACED = {
    "_scaled_dot_product_flash_attention": "sdpa_forward",
    "_scaled_dot_product_flash_attention_backward": "sdpa_backward",
    "_flash_attention_forward": "flash_forward",
    "_flash_attention_forward_no_dropout_inplace": "flash_forward_inplace",
    "_flash_attention_backward": "flash_backward",
}


@dataclasses.dataclass
class Handle:
    """The live replacement: removing it (or dropping the last reference) restores PyTorch's kernels."""

    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _present(name: str) -> bool:
    return hasattr(torch.ops.aten, name) and "default" in getattr(torch.ops.aten, name).overloads()


def _kernel(name: str, dispatch_key: str):
    """PyTorch's kernel of the aten op for the key, or None where it has none (the CPU key of these ops)."""
    try:
        return torch.library.get_kernel(f"aten::{name}", dispatch_key)
    except RuntimeError:
        return None


def register_kernels(dispatch_key: str = "CUDA") -> Handle:
    """Replaces the CUDA kernels of the flash attention aten ops with this library's (the registry's register_fn:
    ``activate()`` is the way in). PyTorch's kernels are read first, so that the calls these kernels cannot serve
    run them. dispatch_key: another key than CUDA's is for tests of this glue on the CPU."""
    names = [name for name in _REPLACED if _present(name)]
    kernels = _Kernels({name: _kernel(name, dispatch_key) for name in names})
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for name in names:
        library.impl(name, getattr(kernels, _REPLACED[name]), dispatch_key, with_keyset=True)
    return Handle(library)


def _registry():
    """torch.nn.attention's registry functions, or None on a torch without them."""
    attention = torch.nn.attention
    needed = (
        "register_flash_attention_impl",
        "activate_flash_attention_impl",
        "current_flash_attention_impl",
        "restore_flash_attention_impl",
    )
    return attention if all(hasattr(attention, n) for n in needed) else None


# Used only where torch.nn.attention has no registry: the handle activate() installed.
_handle: Handle | None = None


def activate() -> None:
    """Runs PyTorch SDPA's flash backend (and the aten flash attention ops under it) on this library's kernels, for
    CUDA fp16 and bf16 tensors, forward and backward; what they cannot serve runs PyTorch's kernels. Replaces any
    other activated flash attention implementation. Undo with ``deactivate()``."""
    global _handle
    registry = _registry()
    if registry is not None:
        registry.activate_flash_attention_impl(NAME)
        return
    deactivate()
    _handle = register_kernels()


def deactivate() -> None:
    """Restores PyTorch's own flash attention kernels, if this library's are active; otherwise does nothing."""
    global _handle
    registry = _registry()
    if registry is not None:
        if registry.current_flash_attention_impl() == NAME:
            registry.restore_flash_attention_impl()
        return
    if _handle is not None:
        _handle.remove()
        _handle = None


def is_active() -> bool:
    """Whether SDPA's flash backend runs on this library's kernels now."""
    registry = _registry()
    if registry is not None:
        return registry.current_flash_attention_impl() == NAME
    return _handle is not None


if _registry() is not None:
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=register_kernels)
