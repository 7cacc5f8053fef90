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
  microseconds more. Even so, host-bound calls cost more than with the C++ library.

varlen_fwd_paged (flash_attn_varlen_func with a block_table) has no backward op. Its autograd, registered here in
Python, records a node that raises when a backward reaches it (varlen_fwd_paged below): a forward with inputs that
require grad runs, as in flash-attn 2.x, and only a backward through it is an error.

The fake implementations and the autograd rules come from the op table (csrc/op_table.py, generated into
_op_table.py), so they name no op argument here.
"""

import functools
import importlib
import os
import warnings

import torch

from . import _C  # noqa: F401  (loading the library registers the ops)
from ._kernel_list import HEAD_DIMS as KERNEL_HEAD_DIMS
from ._kernel_list import kernel_name
from ._op_table import OPS

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

_FWD = torch.ops.flash_attn2.fwd.default
_VARLEN_FWD = torch.ops.flash_attn2.varlen_fwd.default
_VARLEN_FWD_PAGED = torch.ops.flash_attn2.varlen_fwd_paged.default


def _fake_output(rule: str, args: dict) -> torch.Tensor:
    """One output of a fake implementation, by its rule in the op table: "like:<arg>" is the argument's shape,
    contiguous (the ops return contiguous outputs whatever the strides of their inputs); "lse:<arg>" is the float32
    log-sum-exp of a query tensor, (batch, nheads, seqlen_q) of a 4-D one and (nheads, total_q) of a 3-D one;
    "like_or_empty:<arg>" is an optional argument's shape, or (0,) float32 when the call left it out;
    "attn_out:<q>,<v>" is q's shape with v's head dim (the last), an attention output."""
    kind, name = rule.split(":")
    if kind == "attn_out":
        q_name, v_name = name.split(",")
        q, v = args[q_name], args[v_name]
        return q.new_empty((*q.shape[:-1], v.shape[-1]))
    x = args.get(name)
    if kind == "like":
        return x.new_empty(x.shape)
    if kind == "like_or_empty":
        # An optional argument's gradient: its shape, or an empty fp32 placeholder on the device of the call's
        # tensors (the first one given, whatever the order of keyword arguments).
        if x is not None:
            return x.new_empty(x.shape)
        first = next(a for a in args.values() if isinstance(a, torch.Tensor))
        return first.new_empty((0,), dtype=torch.float32)
    if kind == "lse":
        shape = (x.shape[0], x.shape[2], x.shape[1]) if x.dim() == 4 else (x.shape[1], x.shape[0])
        return x.new_empty(shape, dtype=torch.float32)
    raise ValueError(f"unknown fake rule {rule!r}")


def _bind(op_name: str, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name (those the call left out are absent)."""
    bound = dict(zip(OPS[op_name]["args"], args))
    bound.update(kwargs)
    return bound


def _register_fake(op_name: str) -> None:
    rules = [fake for _, fake in OPS[op_name]["returns"]]

    def fake(*args, **kwargs):
        bound = _bind(op_name, args, kwargs)
        return tuple(_fake_output(rule, bound) for rule in rules)

    torch.library.register_fake(f"flash_attn2::{op_name}", fake)


# Every op that takes tensors gets its fake implementation from the op table: the outputs' shapes follow from
# the inputs' (fwd_kvcache also writes its caches in place, which the schema declares).
for _name, _op in OPS.items():
    if _op["dispatch"] == "tensor":
        _register_fake(_name)


# Dropout's rng_state: int64 (2,) [seed, offset] on the device, drawn from torch's generator for each call. An op
# of its own, tagged nondeterministic_seeded, so that under torch.compile it runs as in eager mode (Inductor would
# otherwise lower torch.randint to its own generator, and compiled and eager runs of one seed would differ), is
# never deduplicated or recomputed for the backward, and in a CUDA graph is drawn again at every replay.
torch.library.define("flash_attn2::rng_state", "(Tensor like) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))


@torch.library.impl("flash_attn2::rng_state", "CompositeExplicitAutograd")
def _rng_state(like):
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=like.device)


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


def kernel_available(
    head_dim: int, dtype: torch.dtype, causal: bool, backward: bool = False, variants: bool = False
) -> bool:
    """Whether this build contains the forward kernel (and, with ``backward``, also the backward kernel)
    that a call with these settings needs (``variants``: a call with a window, softcap, ALiBi or dropout)."""
    if dtype not in _DTYPE_NAMES:
        return False
    passes = ("fwd", "bwd") if backward else ("fwd",)
    names = compiled_kernels()
    return all(
        kernel_name(pass_, kernel_head_dim(head_dim), _DTYPE_NAMES[dtype], causal, variants) in names
        for pass_ in passes
    )


# Autograd. The backward ops have none of their own (no double backward, as in flash-attn 2.x). As there, the
# LSE is an output that requires grad but passes no gradient back. Nothing here names an op's arguments: the op
# table pairs each forward op with its backward op, whose every argument is `d<output>` (the gradient of a forward
# output), a forward output, or a forward argument of the same name, and whose every output `d<name>` is the
# gradient of the forward argument `<name>`; the C++ autograd (csrc/host/autograd/) follows the same rule.


def _output_grad(grad, output):
    """A gradient of a forward output as the backward kernels read it: contiguous, and zeros when the loss did not
    use that output (grads are not materialized, so it then arrives as None)."""
    if grad is None:
        return torch.zeros_like(output, memory_format=torch.contiguous_format)
    return grad.contiguous()


def _autograd_rule(fwd_name: str, backward_op=None):
    """(setup_context, backward) of a forward op, from the op table. backward_op: what computes the gradients
    (default: the table's backward op; tests pass a recorder)."""
    fwd = OPS[fwd_name]
    bwd_name = fwd["backward"]
    bwd = OPS[bwd_name]
    inputs = fwd["args"]
    outputs = [name for name, _ in fwd["returns"]]
    sources = []  # per backward argument: ("grad", output index), ("output", index) or ("input", index)
    for name in bwd["args"]:
        if name.startswith("d") and name[1:] in outputs:
            sources.append(("grad", outputs.index(name[1:])))
        elif name in outputs:
            sources.append(("output", outputs.index(name)))
        else:
            sources.append(("input", inputs.index(name)))
    grad_of = [inputs.index(name[1:]) for name, _ in bwd["returns"]]
    if backward_op is None:
        backward_op = getattr(torch.ops.flash_attn2, bwd_name).default

    def setup_context(ctx, inputs, output):
        # Tensors are saved through save_for_backward (None stays None), everything else on ctx.
        ctx.tensor_slots = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*output, *(inputs[i] for i in ctx.tensor_slots))
        ctx.inputs = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.num_outputs = len(output)
        ctx.set_materialize_grads(False)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        forward_outputs = saved[: ctx.num_outputs]
        forward_inputs = list(ctx.inputs)
        for slot, tensor in zip(ctx.tensor_slots, saved[ctx.num_outputs :]):
            forward_inputs[slot] = tensor
        args = []
        for kind, index in sources:
            if kind == "grad":
                args.append(_output_grad(grads[index], forward_outputs[index]))
            elif kind == "output":
                args.append(forward_outputs[index])
            else:
                args.append(forward_inputs[index])
        result = [None] * len(inputs)
        for gradient, index in zip(backward_op(*args), grad_of):
            # An optional argument the call left out gets no gradient: the backward op returns a placeholder for
            # it, as a schema has no optional returns.
            result[index] = gradient if forward_inputs[index] is not None else None
        return tuple(result)

    return setup_context, backward


_fwd_setup_context, _fwd_backward = _autograd_rule("fwd")
_varlen_fwd_setup_context, _varlen_fwd_backward = _autograd_rule("varlen_fwd")


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
        warnings.warn(
            f"flash_attn_cuda: {name} did not load ({error}); autograd runs in Python", RuntimeWarning, stacklevel=2
        )
        return None
    return minor


# "C++ (torch 2.11)" or "Python": where autograd of the forward ops runs (python -m flash_attn_cuda.info says).
_CPP_AUTOGRAD_TORCH = _load_cpp_autograd()
AUTOGRAD = f"C++ (torch {_CPP_AUTOGRAD_TORCH})" if _CPP_AUTOGRAD_TORCH else "Python"

if _CPP_AUTOGRAD_TORCH is None:
    torch.library.register_autograd("flash_attn2::fwd", _fwd_backward, setup_context=_fwd_setup_context)
    torch.library.register_autograd(
        "flash_attn2::varlen_fwd", _varlen_fwd_backward, setup_context=_varlen_fwd_setup_context
    )

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
    return type(
        name,
        (torch.autograd.Function,),
        {
            "apply": torch._C._FunctionBase.__dict__["apply"],
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
        },
    )


_Fwd = _eager_function("_Fwd", "_FWD", _fwd_setup_context, _fwd_backward)
_VarlenFwd = _eager_function("_VarlenFwd", "_VARLEN_FWD", _varlen_fwd_setup_context, _varlen_fwd_backward)


def _differentiable(fwd_name):
    """Positions of the forward op's arguments that have a gradient (the backward's outputs d<name>)."""
    fwd = OPS[fwd_name]
    return tuple(fwd["args"].index(name[1:]) for name, _ in OPS[fwd["backward"]]["returns"])


_FWD_DIFFERENTIABLE = _differentiable("fwd")
_VARLEN_FWD_DIFFERENTIABLE = _differentiable("varlen_fwd")


def _call(op, function, args, compiling, differentiable):
    """op(*args) with autograd in Python: through `function` when an eager call records a backward node, below
    autograd when none is recorded, and as registered (torch.compile, functorch transforms) otherwise."""
    if compiling or torch._C._are_functorch_transforms_active():
        return op(*args)
    if torch.is_grad_enabled() and any(
        isinstance(args[i], torch.Tensor) and args[i].requires_grad for i in differentiable
    ):
        return function.apply(*args)
    with _below_autograd():
        return op(*args)


def fwd(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, variants, compiling):
    """torch.ops.flash_attn2.fwd with its autograd; eager calls skip a registered Python autograd kernel.
    variants: the trailing variant arguments, in the schema's order (the op table's variants group)."""
    args = (q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, *variants)
    if _CPP_AUTOGRAD_TORCH is not None:
        return _FWD(*args)
    return _call(_FWD, _Fwd, args, compiling, _FWD_DIFFERENTIABLE)


def varlen_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    deterministic,
    plan_override,
    variants,
    compiling,
):
    """torch.ops.flash_attn2.varlen_fwd with its autograd, as fwd()."""
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        deterministic,
        plan_override,
        *variants,
    )
    if _CPP_AUTOGRAD_TORCH is not None:
        return _VARLEN_FWD(*args)
    return _call(_VARLEN_FWD, _VarlenFwd, args, compiling, _VARLEN_FWD_DIFFERENTIABLE)


# Paged keys and values: a forward without a backward. The node that autograd records raises this message when a
# backward reaches it; the public function takes the sink as learnable_sink or s_aux, so the message names both.
PAGED_NO_BACKWARD = (
    "block_table: flash_attn_varlen_func with paged keys and values has no backward pass, so q, k, v and "
    "learnable_sink (s_aux) get no gradient through it; run that call under torch.no_grad(), with tensors that do "
    "not require grad, or detach its outputs before a backward pass"
)

# The error is an op of its own, called by the backward, rather than a raise in the backward itself: torch.compile
# traces the backward (on fake tensors) as soon as an input requires grad, and a raise there would fail the
# compilation of a forward that never runs a backward. Traced, the op stands in the compiled backward and raises
# when that backward runs. It takes the incoming gradient so that it belongs to the backward graph.
torch.library.define("flash_attn2::paged_no_backward", "(Tensor grad) -> Tensor")


@torch.library.impl("flash_attn2::paged_no_backward", "CompositeExplicitAutograd")
def _paged_no_backward(grad):
    raise RuntimeError(PAGED_NO_BACKWARD)


@torch.library.register_fake("flash_attn2::paged_no_backward")
def _paged_no_backward_fake(grad):
    return grad.new_empty(())


_PAGED_ARGS = OPS["varlen_fwd_paged"]["args"]
# The arguments a backward would differentiate: those of varlen_fwd's backward, under the paged op's names.
_VARLEN_FWD_PAGED_DIFFERENTIABLE = tuple(
    _PAGED_ARGS.index(name) for name in ("q", "k_cache", "v_cache", "learnable_sink")
)


def _paged_setup_context(ctx, inputs, output):
    # Only the shapes and dtypes of the differentiable inputs are kept: a saved tensor would make autograd check
    # its version at the backward, and a cache written in place since (the next decoding step) would fail that
    # check with a message about in-place writes instead of this one.
    ctx.num_inputs = len(inputs)
    ctx.metas = [
        (i, inputs[i].shape, inputs[i].dtype)
        for i in _VARLEN_FWD_PAGED_DIFFERENTIABLE
        if isinstance(inputs[i], torch.Tensor)
    ]


def _paged_backward(ctx, *grads):
    grad = next(g for g in grads if g is not None)
    # Raises when it runs. Under tracing it returns a fake scalar, and the gradients are views of it, so that the
    # op stays in the graph for as long as any of them is used.
    anchor = torch.ops.flash_attn2.paged_no_backward(grad)
    result = [None] * ctx.num_inputs
    for index, shape, dtype in ctx.metas:
        result[index] = anchor.to(dtype).expand(shape)
    return tuple(result)


torch.library.register_autograd("flash_attn2::varlen_fwd_paged", _paged_backward, setup_context=_paged_setup_context)
_VarlenFwdPaged = _eager_function("_VarlenFwdPaged", "_VARLEN_FWD_PAGED", _paged_setup_context, _paged_backward)


def varlen_fwd_paged(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    block_table,
    softmax_scale,
    causal,
    plan_override,
    window_left,
    window_right,
    softcap,
    alibi_slopes,
    *,
    learnable_sink,
    compiling,
):
    """torch.ops.flash_attn2.varlen_fwd_paged with its autograd (a node whose backward raises PAGED_NO_BACKWARD),
    as fwd(): eager calls skip the registered Python autograd kernel."""
    args = (
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        block_table,
        softmax_scale,
        causal,
        plan_override,
        window_left,
        window_right,
        softcap,
        alibi_slopes,
        learnable_sink,
    )
    return _call(_VARLEN_FWD_PAGED, _VarlenFwdPaged, args, compiling, _VARLEN_FWD_PAGED_DIFFERENTIABLE)
