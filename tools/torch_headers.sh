#!/usr/bin/env bash
# Fetches the C++ headers of several torch minor versions, for the C++ autograd libraries (one per torch minor:
# setup.py's FLASH_ATTN2_AUTOGRAD_TORCH). Only headers and version.py are kept; the wheels are downloaded once.
#
#   bash tools/torch_headers.sh DEST 2.11.0 2.12.0 ...    # prints the FLASH_ATTN2_AUTOGRAD_TORCH value last
#
# DEST/torch-<version>/torch/{include,version.py} per version; a version already there is not fetched again, and
# each wheel is deleted once unpacked. PIP_DOWNLOAD_ARGS adds pip options: an index (e.g. --index-url
# https://download.pytorch.org/whl/cpu for the small CPU wheels: the headers are the same), or
# --python-version/--platform to fetch wheels of another Python than the running one.
set -euo pipefail
dest=$1
shift
PYTHON=${PYTHON:-python3}
mkdir -p "$dest/wheels"
dirs=()
for version in "$@"; do
    out="$dest/torch-$version"
    if [ ! -f "$out/torch/version.py" ]; then
        rm -f "$dest"/wheels/torch-"$version"*.whl
        # shellcheck disable=SC2086  # PIP_DOWNLOAD_ARGS is a list of options
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: ${PIP_DOWNLOAD_ARGS:-} -d "$dest/wheels" \
            "torch==$version"
        wheels=("$dest"/wheels/torch-"$version"*.whl)
        wheel=${wheels[0]}
        rm -rf "$out" && mkdir -p "$out"
        "$PYTHON" -m zipfile -e "$wheel" "$out/unpacked"
        mkdir -p "$out/torch" && mv "$out/unpacked/torch/include" "$out/unpacked/torch/version.py" "$out/torch/"
        rm -rf "$out/unpacked" "$wheel"
    fi
    dirs+=("$(cd "$out/torch" && pwd)")
done
(IFS=';'; echo "${dirs[*]}")
