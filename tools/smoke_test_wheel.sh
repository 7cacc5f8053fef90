#!/usr/bin/env bash
# Installs a flash_attn_cuda wheel into a fresh virtual environment outside the source tree and tests it there:
# the import resolves to the venv (never to the checkout), `python -m flash_attn_cuda.info` runs, and the test
# suite (tests/, GPU tests skip without a GPU) passes against the installed package. .ci/run and
# .github/workflows/wheels.yml run it on the wheel that tools/build_wheel.sh made.
#
#   bash tools/smoke_test_wheel.sh wheelhouse/flash_attn_cuda-*.whl
#
# PYTEST_ARGS adds pytest options.
#
# torch, pytest, hypothesis and numpy come from the interpreter that runs this script (PYTHON, default
# python3): its site-packages directories are added to the venv's path by a .pth file, as plain directories,
# so that none of their .pth files run. An editable install of flash_attn_cuda there therefore stays out of the
# venv, which the script checks before it installs the wheel.
set -euo pipefail

if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 WHEEL" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd -P)
wheel=$(cd "$(dirname "$1")" && pwd -P)/$(basename "$1")
work=$(mktemp -d "${TMPDIR:-/tmp}/flash_attn_cuda_smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
case "$work/" in "$repo"/*) echo "smoke_test_wheel.sh: $work is inside the repository" >&2; exit 1 ;; esac
unset PYTHONPATH
cd "$work"

"$PYTHON" -m venv venv
py=$work/venv/bin/python
site_dir=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$site_dir/smoke_test_base_site.pth"

if "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("flash_attn_cuda") is None)'; then
    echo "smoke_test_wheel.sh: flash_attn_cuda is importable in the fresh venv before the wheel is installed" >&2
    exit 1
fi
"$py" -m pip install -q --no-deps --no-index "$wheel"

location=$("$py" -c 'import flash_attn_cuda; print(flash_attn_cuda.__file__)')
echo "flash_attn_cuda imported from $location"
case "$location" in
    "$work"/venv/*) ;;
    *) echo "smoke_test_wheel.sh: flash_attn_cuda was not imported from the venv" >&2; exit 1 ;;
esac

"$py" -m flash_attn_cuda.info

# PYTEST_ARGS: extra pytest options (e.g. "-n 8 --dist loadfile" where pytest-xdist is installed).
# shellcheck disable=SC2086  # a list of options
"$py" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$repo/tests"
