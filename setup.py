"""Build script for flash_attn_cuda: one CUDA extension, flash_attn_cuda._C.

The extension is built against PyTorch's LibTorch stable ABI (TORCH_TARGET_VERSION: it loads into every torch
from 2.11 on that was built for the same CUDA major) and the Python limited API (_C.abi3.so, wheels tagged
cp310-abi3), so one wheel per CUDA major serves every CPython >= 3.10 and every torch >= 2.11.
The version is BASE_VERSION plus a PEP 440 local tag naming the CUDA major of the nvcc used, e.g. 0.2.0+cu13
(an sdist carries the bare BASE_VERSION). Every build writes flash_attn_cuda/_build_info.py (what was built,
with what; `python -m flash_attn_cuda.info` prints it). `make wheel` (tools/build_wheel.sh) builds and repairs
a wheel.

Each kernel is two or three generated files, one per kernel family (and per tile set for some mma.sync backward
kernels), each compiled for that family's archs only (family_gencodes), the mma.sync ones with a header overlay
that spares them CuTe's other-arch atoms (family_includes); csrc/nvcc_per_file.py applies both. They compile
longest first (compile_rank), beside the C++ autograd libraries.

The build compiles against the torch installed in the Python that runs it: `pip install --no-build-isolation -v
-e .` (pip's isolated build environment holds no torch; without the flag this script stops and says so, see
docs/design-notes.md, "Isolated builds"). -v lets pip show the build's output, among it ninja's progress,
"flash_attn_cuda: compiled K/N files (T s)" as each file finishes; pip shows nothing of it otherwise.

Environment knobs:
  CUTLASS_PATH             CUTLASS checkout to use (its include/ directory is searched)
  FLASH_ATTN2_CUDA_ARCHS   semicolon-separated SM versions to emit machine code (SASS) for, default "80;90"
                           (90 builds sm_90a, for the wgmma kernels); "none" emits no SASS
  FLASH_ATTN2_PTX_ARCHS    semicolon-separated SM versions to embed PTX for, default "80": GPUs newer than
                           every SASS arch JIT-compile the Ampere kernels from it; "none" embeds no PTX.
                           FLASH_ATTN2_CUDA_ARCHS=none FLASH_ATTN2_PTX_ARCHS=80 builds PTX only
  FLASH_ATTN2_AUTOGRAD_TORCH  semicolon-separated torch package directories (each holding include/ and version.py)
                           to build a C++ autograd library for, one per torch minor version; default: the torch
                           that builds; "none" builds none (autograd then runs in Python on every torch)
  FLASH_ATTN2_HDIMS        comma-separated kernel head dims to compile, default all (32,...,256)
  FLASH_ATTN2_DTYPES       comma-separated dtypes to compile, default "fp16,bf16"
  MAX_JOBS                 parallel compile jobs; default from free memory and cores
  NVCC_THREADS             nvcc --threads (parallel arch passes per file), default 1
  FLASH_ATTN2_PTXAS_VERBOSE=1  print registers and spills per kernel
  FLASH_ATTN2_BUILD_LOG    a file to append one JSON line per kernel file compiled: its time and peak memory
  FLASH_ATTN2_FWD_TILE     "M,N,WARPS" forces one forward tile on every kernel (tile tuning only)
  FLASH_ATTN2_BWD_TILE     "M,N" forces one backward tile on every kernel (tile tuning only)
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
MMA_SYNC_INCLUDE = ROOT / "csrc" / "mma_sync_include"
sys.path.insert(0, str(ROOT / "csrc"))
from generate import DTYPES, HEAD_DIMS, kernel_files  # noqa: E402

# The package version without its local tag; the one place it is set.
BASE_VERSION = "0.2.0"
# The oldest torch the stable-ABI build runs on (-DTORCH_TARGET_VERSION).
TORCH_TARGET_VERSION = (2, 11)
# The oldest CPython the limited-API build runs on (-DPy_LIMITED_API, the wheel's cp310-abi3 tag).
PY_LIMITED_API = (3, 10)

# Peak resident memory of one nvcc job, with margin: 3.68 GiB at most (the head-dim-192 wgmma forward units)
# measured in a release build on a 16-core H100 host (nvcc 13.0; docs/building.md, 'Build time and wheel size').
GB_PER_NVCC_JOB = 4.5

SASS_ARCHS = ("80", "86", "89", "90", "100", "120")
PTX_ARCHS = ("80", "86", "89", "90", "100", "120")

# Building an sdist compiles nothing: no extension, no CUDA version in the version, no _build_info.py.
BUILDING_SDIST = "sdist" in sys.argv[1:]


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


def env_list(name: str, default, valid, convert=str, allow_none=False):
    raw = os.environ.get(name, "")
    if allow_none and raw.strip().lower() == "none":
        return []
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


def kernel_selection():
    """The (head dims, dtypes) to compile kernels for, in the generated lists' order."""
    hdims = env_list("FLASH_ATTN2_HDIMS", HEAD_DIMS, HEAD_DIMS, int)
    dtypes = env_list("FLASH_ATTN2_DTYPES", DTYPES, DTYPES)
    return [h for h in HEAD_DIMS if h in hdims], [d for d in DTYPES if d in dtypes]


def kernel_sources(hdims, dtypes, with_wgmma):
    """(path, pass, head dim, Part) of the generated kernel files to compile (csrc/generate.py, kernel_parts)."""
    sources = []
    for path, (pass_, hdim, dtype, _, part) in kernel_files().items():
        if hdim not in hdims or dtype not in dtypes or (part.family == "wgmma" and not with_wgmma):
            continue
        if not path.is_file():
            raise RuntimeError(f"{path.relative_to(ROOT)} is missing; run `python csrc/generate.py`")
        sources.append((str(path.relative_to(ROOT)), pass_, hdim, part))
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


def sass_target(arch: str) -> str:
    # sm_90 code is built for sm_90a, whose warpgroup MMAs the Hopper kernels use.
    return "90a" if arch == "90" else arch


def gencodes(archs, ptx_archs):
    """nvcc's -gencode flags for SASS of `archs` and PTX of `ptx_archs`."""
    flags = [f"-gencode=arch=compute_{t},code=sm_{t}" for t in map(sass_target, archs)]
    # Portable PTX (compute_90, not the arch-specific compute_90a), which the driver JIT-compiles for GPUs newer
    # than it. The kernels it holds are the ones this arch's pass compiles: the mma.sync ones.
    flags += [f"-gencode=arch=compute_{arch},code=compute_{arch}" for arch in ptx_archs]
    return flags


def mma_sync_sm90_from_ptx(archs, ptx_archs) -> bool:
    """Whether Hopper runs the mma.sync kernels from the PTX (JIT-compiled at their first launch, then cached by
    the driver) rather than from sm_90a SASS of their own: wherever the build embeds PTX that Hopper can run.
    Hopper runs them only in deterministic mode, for the backward calls its wgmma kernels cannot order
    (HOPPER_BWD_MMA_SYNC_HEAD_DIMS in csrc/generate.py), and when told to (FLASH_ATTN2_DISABLE_WGMMA=1, a max_smem
    override); the sm_90a pass of the backward ones at head dims 32 to 128 took as long as their sm_80 pass
    (docs/design-notes.md, 'The release build within ten minutes')."""
    return "90" in archs and any(int(arch) <= 90 for arch in ptx_archs)


def family_gencodes(part, archs, ptx_archs):
    """The -gencode flags of one kernel file (its Part): the wgmma kernels are sm_90a code only; the mma.sync ones
    run on every arch, on Hopper from the PTX where mma_sync_sm90_from_ptx says so."""
    if part.family == "wgmma":
        return gencodes(["90"], [])
    skip_90 = mma_sync_sm90_from_ptx(archs, ptx_archs)
    return gencodes([arch for arch in archs if not (arch == "90" and skip_90)], ptx_archs)


def family_includes(part):
    """The include directories that go ahead of all others for one kernel file: the mma.sync units' overlay, which
    leaves out CuTe's Hopper and Blackwell atom headers (csrc/mma_sync_include/README.md)."""
    return [str(MMA_SYNC_INCLUDE)] if part.family == "mma_sync" else []


# The kernel classes (pass, family) in the order of their mean compile time per unit in a release build on a
# 16-core host before the mma.sync units lost their sm_90a pass and parsed less (nvcc 13.0): mma.sync backward 53 s
# (head dims 160-256), wgmma forward 42 s, mma.sync forward 40 s, wgmma backward 33 s. In the build measured since
# (docs/building.md): 33.4 s, 34.7 s, 30.1 s and 27.8 s, the longest units the wgmma forward's at head dims 192
# and 256 (54-57 s), and the last compile ended 10 s after the sum over 16 jobs allows.
COMPILE_CLASS_ORDER = (("bwd", "mma_sync"), ("fwd", "wgmma"), ("fwd", "mma_sync"), ("bwd", "wgmma"))


def compile_rank(pass_, part, file_gencodes) -> tuple:
    """A sort key that puts a kernel file's compile earlier the longer it is expected to take, so that the build's
    last minutes are not spent on a few long files: files with more machine-code passes first (each pass costs
    about as much as the first), then by class (COMPILE_CLASS_ORDER)."""
    passes = sum(1 for flag in file_gencodes if ",code=sm_" in flag)
    return (-passes, COMPILE_CLASS_ORDER.index((pass_, part.family)))


def nvcc_flags(archs, ptx_archs, nvcc_threads):
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
    flags += gencodes(archs, ptx_archs)
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
            raise RuntimeError(
                f"FLASH_ATTN2_BWD_TILE={tile!r}: expected 'M,N' with M and N in {{64, 128}}, e.g. '128,128'"
            )
        m, n = (int(x) for x in tile.split(","))
        flags += [f"-DFLASH_BWD_TILE_M={m}", f"-DFLASH_BWD_TILE_N={n}"]
    if os.environ.get("FLASH_ATTN2_PTXAS_VERBOSE") == "1":
        flags.append("-Xptxas=-v")
    return flags


def require_torch() -> None:
    """Stops with a message naming --no-build-isolation where torch is not installed, which is what an isolated
    build environment looks like (pip install . without the flag), instead of a bare ModuleNotFoundError."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        oldest = "{}.{}".format(*TORCH_TARGET_VERSION)
        raise SystemExit(
            "flash_attn_cuda: the build cannot import torch. It compiles against the torch you will run it with, "
            "which must be installed\nin the Python that builds; an isolated build environment (pip's default, and "
            f"python -m build's) hides it.\nInstall torch (>= {oldest}) first, then build without build isolation:\n"
            "    pip install --no-build-isolation -v .    (-e for an editable install; -v shows the progress)\n"
            "    python -m build --no-isolation"
        )


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


def nvcc_version() -> str:
    """The CUDA release of the nvcc that builds the kernels (torch's CUDA_HOME), e.g. "13.0"."""
    from torch.utils.cpp_extension import CUDA_HOME

    if not CUDA_HOME:
        raise RuntimeError("no CUDA toolkit found: set CUDA_HOME or put nvcc on PATH")
    out = subprocess.run(
        [os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], check=True, capture_output=True, text=True
    ).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise RuntimeError(f"cannot read the CUDA release from `nvcc --version`:\n{out}")
    return f"{match[1]}.{match[2]}"


def torch_target_define() -> str:
    # TORCH_TARGET_VERSION's layout (torch/headeronly/version.h): major, minor, patch, tweak from the top byte down.
    major, minor = TORCH_TARGET_VERSION
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"


def write_build_info(info: dict) -> None:
    """flash_attn_cuda/_build_info.py: what this build holds (read by flash_attn_cuda.info). Gitignored."""
    lines = ['"""Written by setup.py at build time; do not edit."""', ""]
    lines += [f"{name} = {value!r}" for name, value in info.items()]
    text = "\n".join(lines) + "\n"
    path = ROOT / "flash_attn_cuda" / "_build_info.py"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def torch_minor_of(torch_dir: Path) -> str:
    """ "2.11" for a torch package directory, from its version.py."""
    match = re.search(r"^__version__\s*=\s*['\"](\d+)\.(\d+)", (torch_dir / "version.py").read_text(), re.M)
    if not match:
        raise RuntimeError(f"{torch_dir}/version.py: no __version__ found")
    return f"{match[1]}.{match[2]}"


def shared_cxx_runtime_args() -> list[str]:
    """The link arguments that end each extension's link line so that it uses libstdc++ as a shared library, the C++
    runtime that libtorch uses, also where the compiler links it statically by default (-static-libstdc++ in a
    wrapper or its specs; g++ adds its own -lstdc++ after these arguments, where nothing is left for it to resolve).
    An extension with a runtime of its own can crash the process when an error it raises is caught in libtorch
    (csrc/cxx_runtime.py); each built library is checked after its link. "-lstdc++" where the compiler's search
    path finds the shared library that way, else the shared library by its file name, "-l:libstdc++.so.6" (a
    toolchain whose own directory holds only the static one): the first that links a throwing test library
    without a runtime of its own. Last on the line, after torch's libraries: libc10 exports some of the C++
    library's newer symbols (a C++20 std::stringbuf::str(), say), which then bind there, unversioned, as they do
    without these arguments; bound to libstdc++ itself they would need GLIBCXX_3.4.29, newer than manylinux_2_28
    allows."""
    import tempfile

    from cxx_runtime import carries_cxx_runtime

    compiler = shlex.split(os.environ.get("CXX", "c++"))
    candidates = (["-lstdc++"], ["-l:libstdc++.so.6"])
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "throw.cpp"
        source.write_text('#include <stdexcept>\nextern "C" void fail() { throw std::runtime_error("x"); }\n')
        for args in candidates:
            library = Path(tmp) / "throw.so"
            command = [*compiler, "-shared", "-fPIC", str(source), "-o", str(library), *args]
            if subprocess.run(command, capture_output=True).returncode == 0 and not carries_cxx_runtime(library):
                return args
    # Neither: the check after the link names the problem.
    return candidates[0]


def autograd_extensions(glibc_symver: str, py_limited: str, cxx_runtime_args: list[str]):
    """The C++ autograd libraries, one per torch minor version (csrc/host/autograd/autograd.cpp): the stable ABI has
    no autograd, so each is built against that version's own headers and loaded only into it. Returns
    (extensions, the torch minor versions they serve)."""
    import torch
    from setuptools import Extension

    raw = os.environ.get("FLASH_ATTN2_AUTOGRAD_TORCH", "")
    if raw.strip().lower() == "none":
        return [], ()
    dirs = [Path(p.strip()) for p in raw.split(";") if p.strip()] if raw else [Path(torch.__file__).parent]
    torch_lib = Path(torch.__file__).parent / "lib"
    extensions, minors = [], []
    for torch_dir in dirs:
        include = torch_dir / "include"
        if not (include / "torch" / "csrc" / "api" / "include" / "torch" / "autograd.h").is_file():
            raise RuntimeError(f"FLASH_ATTN2_AUTOGRAD_TORCH: {torch_dir} holds no torch headers (include/)")
        minor = torch_minor_of(torch_dir)
        if minor in minors:
            raise RuntimeError(f"FLASH_ATTN2_AUTOGRAD_TORCH names torch {minor} twice")
        name = "_autograd_torch" + minor.replace(".", "_")
        extensions.append(
            Extension(
                name=f"flash_attn_cuda.{name}",
                sources=["csrc/host/autograd/autograd.cpp"],
                include_dirs=[
                    str(ROOT / "csrc" / "host" / "compat"),
                    str(ROOT / "csrc"),
                    str(include),
                    str(include / "torch" / "csrc" / "api" / "include"),
                ],
                extra_compile_args={
                    "cxx": [
                        "-O3",
                        "-std=c++20",
                        "-fvisibility=hidden",
                        py_limited,
                        "-include",
                        glibc_symver,
                        f"-DFLASH_ATTN2_AUTOGRAD_MODULE={name}",
                    ]
                },
                # Only for the DT_NEEDED entries: the symbols resolve at load time against the torch already in
                # the process, which is the version the headers came from (_ops.py loads no other).
                extra_link_args=[
                    "-Wl,--as-needed",
                    f"-L{torch_lib}",
                    "-ltorch_cpu",
                    "-lc10",
                    "-Wl,--strip-debug",
                    *cxx_runtime_args,
                ],
                py_limited_api=True,
                language="c++",
            )
        )
        minors.append(minor)
    return extensions, tuple(minors)


def build_extensions():
    """The extensions, and the metadata of the build: (ext_modules, version)."""
    locate_cuda_home()
    import torch
    from torch.utils.cpp_extension import CUDAExtension

    archs = env_list("FLASH_ATTN2_CUDA_ARCHS", ("80", "90"), SASS_ARCHS, allow_none=True)
    ptx_archs = env_list("FLASH_ATTN2_PTX_ARCHS", ("80",), PTX_ARCHS, allow_none=True)
    if not archs and not ptx_archs:
        raise RuntimeError("FLASH_ATTN2_CUDA_ARCHS and FLASH_ATTN2_PTX_ARCHS are both empty: nothing would run")
    hdims, dtypes = kernel_selection()
    nvcc_threads = env_int("NVCC_THREADS", 1)
    os.environ.setdefault("MAX_JOBS", str(default_max_jobs(nvcc_threads)))
    cuda_version = nvcc_version()
    version = f"{BASE_VERSION}+cu{cuda_version.split('.')[0]}"

    # Host code (csrc/host/*.cpp: module, ops, checks, plan, fwd, bwd, the torch glue; csrc/launch/*.cpp: the
    # registry; csrc/generated/*.cpp: the op registrations), then the small kernels and the build probe, compiled
    # with the kernels' flags.
    host = sorted(
        str(path.relative_to(ROOT))
        for room in ("host", "launch", "generated")
        for path in (ROOT / "csrc" / room).glob("*.cpp")
    )
    # The kernel files, each with its family's archs and include overlay, longest compile first.
    kernels = kernel_sources(hdims, dtypes, with_wgmma="90" in archs)
    file_flags = {
        os.path.abspath(path): {
            "gencode": family_gencodes(part, archs, ptx_archs),
            "include": family_includes(part),
        }
        for path, pass_, hdim, part in kernels
    }
    kernels.sort(key=lambda k: compile_rank(k[1], k[3], file_flags[os.path.abspath(k[0])]["gencode"]))
    sources = [
        *(path for path, *_ in kernels),
        *host,
        "csrc/launch/build_info.cu",
        "csrc/kernels/flash_bwd_aux.cu",
        "csrc/kernels/flash_fwd_combine.cu",
        "csrc/kernels/kvcache_prep.cu",
    ]

    # Stable ABI only: in torch >= 2.14 TORCH_TARGET_VERSION also turns every non-stable header into an #error.
    # Py_LIMITED_API: torch's BuildExtension adds the same define (same spelling) for py_limited_api extensions.
    abi_flags = [torch_target_define()]
    py_limited = f"-DPy_LIMITED_API=0x{PY_LIMITED_API[0]:02X}{PY_LIMITED_API[1]:02X}0000"
    # csrc/host/compat/glibc_symver.h: dlsym at its glibc 2.2.5/2.17 version (see there), for manylinux_2_28.
    glibc_symver = str(ROOT / "csrc" / "host" / "compat" / "glibc_symver.h")
    # -fvisibility=hidden: the stable ABI's types are hidden, and so are ours then; only PyInit__C is exported.
    cxx_flags = ["-O3", "-std=c++20", "-fvisibility=hidden", *abi_flags, py_limited, "-include", glibc_symver]
    print(
        f"flash_attn_cuda {version}: archs={archs} ptx={ptx_archs} kernel files={len(kernels)} "
        f"MAX_JOBS={os.environ['MAX_JOBS']}"
    )

    cxx_runtime_args = shared_cxx_runtime_args()
    autograd_exts, autograd_minors = autograd_extensions(glibc_symver, py_limited, cxx_runtime_args)
    write_build_info(
        {
            "VERSION": version,
            "TORCH_VERSION": torch.__version__,
            "CUDA_VERSION": cuda_version,
            "TORCH_TARGET_VERSION": "{}.{}".format(*TORCH_TARGET_VERSION),
            "ARCHS": tuple(sass_target(a) for a in archs),
            "PTX_ARCHS": tuple(ptx_archs),
            # The head dims of each pass whose mma.sync kernels Hopper runs from the PTX (mma_sync_sm90_from_ptx).
            "MMA_SYNC_SM90_FROM_PTX": {
                pass_: tuple(hdims) if mma_sync_sm90_from_ptx(archs, ptx_archs) else () for pass_ in ("fwd", "bwd")
            },
            "HEAD_DIMS": tuple(hdims),
            "DTYPES": tuple(dtypes),
            "AUTOGRAD_TORCH": autograd_minors,
        }
    )
    ext = CUDAExtension(
        name="flash_attn_cuda._C",
        sources=sources,
        # csrc/host/compat first: it replaces one system header (see csrc/host/compat/sys/single_threaded.h).
        include_dirs=[str(ROOT / "csrc" / "host" / "compat"), str(ROOT / "csrc"), cutlass_include_dir()],
        extra_compile_args={"cxx": cxx_flags, "nvcc": [*nvcc_flags(archs, ptx_archs, nvcc_threads), *abi_flags]},
        py_limited_api=True,
    )
    # The link line: objects, then extra_link_args, where the libraries CUDAExtension picked (libtorch's, c10's,
    # libcudart) move, after --as-needed, so that _C.so depends only on those whose symbols it uses (the stable
    # shim's). libdl stays needed whatever: it defines dlsym on glibc < 2.34 (csrc/host/compat/glibc_symver.h).
    # --strip-debug drops the debug info that Python's CFLAGS (-g) ask for.
    ext.extra_link_args = [
        "-Wl,--as-needed",
        *(f"-l{lib}" for lib in ext.libraries),
        "-Wl,--no-as-needed",
        "-l:libdl.so.2",
        "-Wl,--strip-debug",
        *cxx_runtime_args,
    ]
    ext.libraries = []
    return [ext, *autograd_exts], version, file_flags


def require_shared_cxx_runtime(library: Path):
    """Stops the build if `library` was linked with a C++ runtime of its own despite shared_cxx_runtime_args (a
    toolchain that cannot link libstdc++ as a shared library, say)."""
    from cxx_runtime import carries_cxx_runtime

    if carries_cxx_runtime(library):
        compiler = os.environ.get("CXX", "c++")
        sys.exit(
            f"error: {library.name} holds a C++ runtime of its own: the C++ compiler ({compiler}) linked libstdc++ "
            "into it statically. The extension must use libtorch's shared libstdc++, or an error it raises can "
            "crash Python instead of raising. Point CXX at a g++ that links libstdc++ as a shared library (the "
            "system's /usr/bin/g++, say) and build again."
        )


def per_file_nvcc(build_temp: Path, file_flags: dict, wrapped) -> str:
    """The PYTORCH_NVCC command that gives each kernel file its family's -gencode flags and include overlay
    (csrc/nvcc_per_file.py): torch's build passes one set of flags to every CUDA source. It runs `wrapped`, a
    PYTORCH_NVCC of the caller's own (ccache, say), or else nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    build_temp.mkdir(parents=True, exist_ok=True)
    map_path = build_temp.resolve() / "nvcc_flags.json"
    map_path.write_text(json.dumps(file_flags, indent=1))
    command = shlex.split(wrapped) if wrapped else [os.path.join(CUDA_HOME, "bin", "nvcc")]
    wrapper = ROOT / "csrc" / "nvcc_per_file.py"
    return shlex.join([sys.executable, str(wrapper), str(map_path), json.dumps(command)])


def main():
    packages = find_packages(include=["flash_attn_cuda", "flash_attn_cuda.*"])
    if BUILDING_SDIST:
        setup(version=BASE_VERSION, packages=packages)
        return
    require_torch()
    ext_modules, version, file_flags = build_extensions()
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import BuildExtension

    kernels_ext = "flash_attn_cuda._C"
    # The order build_extensions() gave _C's sources (longest compile first), which setuptools' sorting by name
    # would undo: torch's ninja file lists the sources in the order they reach the compiler, and ninja starts
    # them in that order.
    source_order = {os.path.abspath(path): i for i, path in enumerate(ext_modules[0].sources)}
    built_apart = set()

    class BuildExtensionInOrder(BuildExtension.with_options(use_ninja=True)):
        """torch's extension build, which puts its ninja writer in self.compiler.compile before setuptools builds
        the extensions one by one. _C's turn comes first: it puts _C's sources back in their order, starts the C++
        autograd libraries in a thread of their own (one file each, which would otherwise compile alone after the
        kernels), compiles the kernels, then waits for the libraries; their own turns find them built."""

        def build_extension(self, ext):
            if ext.name == kernels_ext:
                self.build_kernels_and_the_rest(ext)
            elif ext.name not in built_apart:
                super().build_extension(ext)
            require_shared_cxx_runtime(Path(self.get_ext_fullpath(ext.name)))

        def build_kernels_and_the_rest(self, ext):
            ninja_compile = self.compiler.compile

            def compile_in_order(sources, *args, **kwargs):
                ordered = sorted(sources, key=lambda path: source_order.get(os.path.abspath(path), len(source_order)))
                return ninja_compile(ordered, *args, **kwargs)

            # ninja's status line, printed before each command line as it finishes (torch runs ninja -v; output
            # to a pipe, as under pip, gets one line per file): "flash_attn_cuda: compiled 12/100 files (734.2
            # s): nvcc ...". A NINJA_STATUS of the caller's own is left as it is. Both are set before the thread
            # starts: each ninja run takes a copy of the environment.
            saved = {name: os.environ.get(name) for name in ("NINJA_STATUS", "PYTORCH_NVCC")}
            if saved["NINJA_STATUS"] is None:
                os.environ["NINJA_STATUS"] = "flash_attn_cuda: compiled %f/%t files (%e s): "
            # Only _C has CUDA sources, so only its compiles go through the per-file wrapper.
            os.environ["PYTORCH_NVCC"] = per_file_nvcc(Path(self.build_temp), file_flags, saved["PYTORCH_NVCC"])
            self.compiler.compile = compile_in_order
            try:
                with ThreadPoolExecutor(max_workers=1) as pool:
                    rest = [other for other in self.extensions if other.name != kernels_ext]
                    done = [pool.submit(self.build_apart, other) for other in rest]
                    super().build_extension(ext)
                    for other, future in zip(rest, done):
                        future.result()
                        built_apart.add(other.name)
            finally:
                self.compiler.compile = ninja_compile
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value

        def build_apart(self, ext):
            # A copy of this command with a temp directory of its own: torch's build writes build.ninja into the
            # directory it compiles in. It shares the compiler, whose ninja writer takes that directory as an
            # argument.
            command = copy.copy(self)
            command.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
            BuildExtension.build_extension(command, ext)

    setup(
        version=version,
        packages=packages,
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtensionInOrder},
        options={"bdist_wheel": {"py_limited_api": "cp{}{}".format(*PY_LIMITED_API)}},
    )


if __name__ == "__main__":
    main()
