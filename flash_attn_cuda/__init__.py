"""flash_attn_cuda: FlashAttention-2 in CUDA C++/CuTe, a drop-in for flash-attn 2.x."""

from . import _ops
from ._ops import compiled_kernels, kernel_available
from .interface import flash_attn_func

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "compiled_kernels", "kernel_available", "__version__", "_ops"]
