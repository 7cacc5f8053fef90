"""Per-call host cost of the Python call path, without a GPU (perf log entry 20).

Registers a CPU stand-in op with flash_attn2::fwd's schema and the same torch.library autograd wiring as
flash_attn_cuda/_ops.py, then times (perf_counter, 2000 calls) the ways of calling it: through the registered
autograd with and without grad, dispatched below autograd, and through a plain autograd.Function; and
flash_attn_func's own argument handling (_prepare).

    python bench/host_overhead_probe.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flash_attn_cuda.interface import _prepare, _reject_unsupported  # noqa: E402

SCHEMA = "(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False) -> (Tensor, Tensor)"
torch.library.define("probe::fwd", SCHEMA)


@torch.library.impl("probe::fwd", "CPU")
def _probe_fwd(q, k, v, softmax_scale, causal, deterministic=False):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)


def _backward(ctx, grad_out, grad_lse):
    return None, None, None, None, None, None


torch.library.register_autograd("probe::fwd", _backward, setup_context=_setup_context)


class PlainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = torch.ops.probe.fwd(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def per_call_us(fn, calls=2000):
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    q = torch.randn(8, 1, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(8, 16, 4, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    args = (q, k, v, 0.1, False, False)

    def below_autograd():
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.probe.fwd(*args)

    def no_grad():
        with torch.no_grad():
            return torch.ops.probe.fwd(*args)

    rows = {
        "flash_attn_func argument handling (_prepare)": lambda: (_reject_unsupported(0.0, (-1, -1), 0.0, None),
                                                                 _prepare(q, k, v, None, 4, "")),
        "registered autograd, inputs requiring grad": lambda: torch.ops.probe.fwd(*args),
        "registered autograd, no_grad": no_grad,
        "dispatched below autograd": below_autograd,
        "plain autograd.Function, below autograd inside": lambda: PlainFunction.apply(*args),
    }
    for name, fn in rows.items():
        print(f"{name:50s} {per_call_us(fn):7.1f} us")


if __name__ == "__main__":
    main()
