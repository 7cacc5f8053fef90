#!/usr/bin/env bash
# Fetches the C++ headers of several torch minor versions, for the C++ autograd libraries (one per torch minor:
# setup.py's FLASH_ATTN2_AUTOGRAD_TORCH). Only headers and version.py are kept; the wheels are downloaded once.
#
#   bash tools/torch_headers.sh DEST 2.11.0 2.12.0 ...    # prints the FLASH_ATTN2_AUTOGRAD_TORCH value last
#
# DEST/torch-<version>/torch/{include,version.py} per version; a version already there is not fetched again, and
# each wheel is deleted once unpacked. Each wheel is fetched by exact version (torch==VERSION) from the indexes
# pip is configured with; from PyPI that is the CUDA wheel for the running Python (527 MB for 2.13.0; its headers
# serve as well as a CPU wheel's). PIP_DOWNLOAD_ARGS adds pip options: an index (e.g. --index-url
# https://download.pytorch.org/whl/cpu for the smaller CPU wheels, whose versions, 2.13.0+cpu, torch==2.13.0
# matches), or --python-version/--platform to fetch wheels of another Python than the running one.
# TORCH_HEADERS_EXACT=1 asks for torch===VERSION instead, which matches the release itself and never a local build
# of it (2.13.0+cpu): a wheel in one machine's --find-links directory is then not taken over the index's, and
# every machine unpacks the same file.
set -euo pipefail
dest=$1
shift
PYTHON=${PYTHON:-python3}
op="=="
if [ "${TORCH_HEADERS_EXACT:-0}" = 1 ]; then
    op="==="
fi
mkdir -p "$dest/wheels"
dirs=()
for version in "$@"; do
    out="$dest/torch-$version"
    if [ ! -f "$out/torch/version.py" ]; then
        rm -f "$dest"/wheels/torch-"$version"*.whl
        start=$(date +%s)
        # shellcheck disable=SC2086  # PIP_DOWNLOAD_ARGS is a list of options
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: ${PIP_DOWNLOAD_ARGS:-} -d "$dest/wheels" \
            "torch$op$version"
        wheels=("$dest"/wheels/torch-"$version"*.whl)
        wheel=${wheels[0]}
        echo "torch_headers.sh: fetched $(basename "$wheel") ($(( $(stat -c %s "$wheel") / 1000000 )) MB)" \
             "in $(( $(date +%s) - start )) s" >&2
        rm -rf "$out" && mkdir -p "$out"
        # Only torch/include/ and torch/version.py: 39 MB of the 1.1 GB that the CUDA wheel unpacks to.
        "$PYTHON" -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    keep = [n for n in whl.namelist() if n.startswith("torch/include/") or n == "torch/version.py"]
    whl.extractall(sys.argv[2], keep)' "$wheel" "$out"
        rm -f "$wheel"
    fi
    dirs+=("$(cd "$out/torch" && pwd)")
done
(IFS=';'; echo "${dirs[*]}")
