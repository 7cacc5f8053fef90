"""flash_attn_cuda: FlashAttention-2 in CUDA C++/CuTe, a drop-in for flash-attn 2.x."""

import sys

_argv = getattr(sys, "orig_argv", [])
_RUNNING_INFO = "-mflash_attn_cuda.info" in _argv or any(
    a == "-m" and b == "flash_attn_cuda.info" for a, b in zip(_argv, _argv[1:])
)

try:
    from . import _ops
except Exception:
    # `python -m flash_attn_cuda.info` diagnoses a broken install itself (info.py imports _ops again and reports
    # the error), so it must get past this import; everywhere else the error stands.
    if not _RUNNING_INFO:
        raise
else:
    # Registers (does not activate) the SDPA flash backend implementation with torch.nn.attention.
    from . import sdpa
    from ._ops import compiled_kernels, kernel_available
    from .interface import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache,
    )
    from .padding import pad_input, unpad_input
    from .serving import SchedulerMetadata, flash_attn_combine, get_scheduler_metadata

try:
    from ._build_info import VERSION as __version__
except ImportError:  # a checkout built before setup.py wrote _build_info.py
    __version__ = "0.2.0+unknown"

__all__: list[str] = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "SchedulerMetadata",
    "pad_input",
    "unpad_input",
    "compiled_kernels",
    "kernel_available",
    "sdpa",
    "__version__",
    "_ops",
]
