"""Build script for flash_attn_cuda: one CUDA extension, flash_attn_cuda._C.

Environment knobs:
  CUTLASS_PATH             CUTLASS checkout to use (its include/ directory is searched)
  FLASH_ATTN2_CUDA_ARCHS   semicolon-separated SM versions, default "80;90"
  FLASH_ATTN2_HDIMS        comma-separated kernel head dims to compile, default all (32,...,256)
  FLASH_ATTN2_DTYPES       comma-separated dtypes to compile, default "fp16,bf16"
  MAX_JOBS                 parallel compile jobs; default from free memory and cores
  NVCC_THREADS             nvcc --threads (parallel arch passes per file), default 1
  FLASH_ATTN2_PTXAS_VERBOSE=1  print registers and spills per kernel
  FLASH_ATTN2_FWD_TILE     "M,N,WARPS" forces one forward tile on every kernel (tile tuning only)
  FLASH_ATTN2_BWD_TILE     "M,N" forces one backward tile on every kernel (tile tuning only)
"""

import itertools
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "csrc"))
from generate_kernels import DTYPES, HEAD_DIMS, MASKS, PASSES, kernel_name  # noqa: E402

# Peak resident memory of one nvcc job on one instantiation, measured on our build machine, with margin.
GB_PER_NVCC_JOB = 2.5


def cutlass_include_dir() -> str:
    """$CUTLASS_PATH, then the git submodule, then the nvidia-cutlass wheel's copy of the headers."""
    candidates = []
    if os.environ.get("CUTLASS_PATH"):
        candidates.append(Path(os.environ["CUTLASS_PATH"]) / "include")
    candidates.append(ROOT / "third_party" / "cutlass" / "include")
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(list(spec.submodule_search_locations)[0]) / "source" / "include")
    except ImportError:
        pass
    for path in candidates:
        if (path / "cute" / "tensor.hpp").is_file():
            return str(path)
    raise RuntimeError(
        "CUTLASS headers not found. Provide them in one of these ways: set CUTLASS_PATH to a CUTLASS v4.2.0 "
        "checkout; run `git submodule update --init third_party/cutlass`; or `pip install nvidia-cutlass==4.2.0.0`."
    )


def env_list(name: str, default, valid, convert=str):
    raw = os.environ.get(name, "")
    try:
        values = [convert(x.strip()) for x in re.split(r"[,;]", raw) if x.strip()] if raw else list(default)
    except ValueError:
        values = [raw]
    bad = [x for x in values if x not in valid]
    if bad:
        raise RuntimeError(f"{name}={raw!r}: unsupported values {bad}; choose from {list(valid)}")
    return values


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) < 1:
        raise RuntimeError(f"{name}={raw!r}: expected a positive integer")
    return int(raw)


def kernel_sources():
    hdims = env_list("FLASH_ATTN2_HDIMS", HEAD_DIMS, HEAD_DIMS, int)
    dtypes = env_list("FLASH_ATTN2_DTYPES", DTYPES, DTYPES)
    sources = []
    for pass_, hdim, dtype, mask in itertools.product(PASSES, hdims, dtypes, MASKS):
        path = Path("csrc") / "instantiations" / f"{kernel_name(pass_, hdim, dtype, mask)}.cu"
        if not (ROOT / path).is_file():
            raise RuntimeError(f"{path} is missing; run `python csrc/generate_kernels.py`")
        sources.append(str(path))
    return sources


def default_max_jobs(nvcc_threads: int) -> int:
    available_gb = 4.0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available_gb = int(line.split()[1]) / 2**20
    except OSError:
        pass
    by_memory = int(available_gb // (GB_PER_NVCC_JOB * nvcc_threads))
    return max(1, min(os.cpu_count() or 1, by_memory))


def nvcc_flags(archs, nvcc_threads):
    flags = [
        "-O3",
        "-std=c++20",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        # torch disables the half/bfloat16 operators that CUTLASS's numeric types rely on.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        f"--threads={nvcc_threads}",
    ]
    for arch in archs:
        # sm_90 code is built for sm_90a, whose warpgroup MMAs the Hopper forward kernels use.
        target = "90a" if arch == "90" else arch
        flags.append(f"-gencode=arch=compute_{target},code=sm_{target}")
    if "90" in archs:
        flags.append("-DFLASH_ATTN2_SM90A")
    tile = os.environ.get("FLASH_ATTN2_FWD_TILE")  # "M,N,WARPS": tile-tuning builds only
    if tile:
        if not re.fullmatch(r"\d+,\d+,\d+", tile):
            raise RuntimeError(f"FLASH_ATTN2_FWD_TILE={tile!r}: expected 'M,N,WARPS', e.g. '128,64,4'")
        m, n, warps = (int(x) for x in tile.split(","))
        flags += [f"-DFLASH_FWD_TILE_M={m}", f"-DFLASH_FWD_TILE_N={n}", f"-DFLASH_FWD_TILE_WARPS={warps}"]
    tile = os.environ.get("FLASH_ATTN2_BWD_TILE")  # "M,N": tile-tuning builds only
    if tile:
        if not re.fullmatch(r"(64|128),(64|128)", tile):
            raise RuntimeError(f"FLASH_ATTN2_BWD_TILE={tile!r}: expected 'M,N' with M and N in {{64, 128}}, e.g. '128,128'")
        m, n = (int(x) for x in tile.split(","))
        flags += [f"-DFLASH_BWD_TILE_M={m}", f"-DFLASH_BWD_TILE_N={n}"]
    if os.environ.get("FLASH_ATTN2_PTXAS_VERBOSE") == "1":
        flags.append("-Xptxas=-v")
    return flags


def locate_cuda_home() -> None:
    """torch guesses CUDA_HOME as the parent of the nvcc found on PATH, which is wrong when that nvcc is
    a wrapper script (e.g. /usr/local/bin/nvcc). Pick the first candidate that has the toolkit headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "include" / "cuda_runtime_api.h").is_file():
            os.environ["CUDA_HOME"] = str(home)
            return


def build_extensions():
    locate_cuda_home()
    from torch.utils.cpp_extension import CUDAExtension

    archs = env_list("FLASH_ATTN2_CUDA_ARCHS", ("80", "90"), ("80", "86", "89", "90", "100", "120"))
    nvcc_threads = env_int("NVCC_THREADS", 1)
    os.environ.setdefault("MAX_JOBS", str(default_max_jobs(nvcc_threads)))
    host = ("module", "ops", "checks", "device_info", "plan", "plan_op", "host_params", "fwd", "bwd", "autograd",
            "kernel_registry")
    sources = [f"csrc/{name}.cpp" for name in host] + [
        "csrc/build_info.cu", "csrc/flash_bwd_aux.cu", "csrc/flash_fwd_combine.cu"]
    fixed_sources = len(sources)
    sources += kernel_sources()
    print(f"flash_attn_cuda: archs={archs} kernels={len(sources) - fixed_sources} MAX_JOBS={os.environ['MAX_JOBS']}")
    return [
        CUDAExtension(
            name="flash_attn_cuda._C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc"), cutlass_include_dir()],
            extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc_flags(archs, nvcc_threads)},
        )
    ]


def main():
    ext_modules = build_extensions()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        packages=find_packages(include=["flash_attn_cuda", "flash_attn_cuda.*"]),
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
