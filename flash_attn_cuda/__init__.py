"""flash_attn_cuda: FlashAttention-2 in CUDA C++/CuTe, a drop-in for flash-attn 2.x."""

from . import _ops
from ._ops import compiled_kernels, kernel_available
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .padding import pad_input, unpad_input

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "pad_input",
    "unpad_input",
    "compiled_kernels",
    "kernel_available",
    "__version__",
    "_ops",
]
