#!/usr/bin/env bash
# Format and lint gates, on the CPU, in seconds: ruff's lint rules and formatter on the Python (settings in
# pyproject.toml's [tool.ruff]), clang-format on the hand-written C++/CUDA of csrc/ and
# bench/*.cu (style in .clang-format). Changes nothing; exits 1 naming each file that fails, with the command
# that fixes it. .ci/run runs it with the pinned tools (clang-format==23.1.5, ruff==0.17.6); other versions
# may format differently.
#
#   bash tools/check_format.sh
#
# RUFF and CLANG_FORMAT name the tools (default: ruff, clang-format on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-ruff}
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}

for tool in "$RUFF" "$CLANG_FORMAT"; do
    if ! command -v "$tool" > /dev/null; then
        echo "check_format.sh: $tool not found (pip install clang-format==23.1.5 ruff==0.17.6)" >&2
        exit 2
    fi
done
echo "check_format.sh: $("$RUFF" --version), $("$CLANG_FORMAT" --version | head -n 1)"

failed=()

# Lint: ruff prints each violation as FILE:LINE:COL: CODE message.
if ! "$RUFF" check --no-cache --output-format concise .; then
    failed+=("ruff check: the violations above (ruff check --fix . fixes those marked [*])")
fi

# Python formatting: ruff lists the files it would reformat.
# (One "FILE:LINE:COL: unformatted: ..." line per file; older ruff prints "Would reformat: FILE".)
if ! ruff_out=$("$RUFF" format --no-cache --check --output-format concise . 2>&1); then
    echo "$ruff_out"
    mapfile -t files < <(printf '%s\n' "$ruff_out" | sed -n -e 's/^\([^:]*\):[0-9]*:[0-9]*: unformatted.*/\1/p' \
                                                        -e 's/^Would reformat: //p')
    failed+=("ruff format: ${#files[@]} file(s) not formatted (ruff format . fixes them): ${files[*]}")
fi

# C++/CUDA formatting: every hand-written .h, .cpp and .cu under csrc/ and the .cu files of bench/, in one
# clang-format run that reports the first difference of each file ("FILE:LINE:COL: error: code should be
# clang-formatted"). csrc/generated/ keeps the generator's layout; a CPU test checks it matches the generator.
mapfile -t sources < <(find csrc -path csrc/generated -prune -o \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) -type f -print | sort;
                       find bench -maxdepth 1 -name '*.cu' -type f | sort)
if ! cf_out=$("$CLANG_FORMAT" --dry-run --Werror --ferror-limit=1 --style=file "${sources[@]}" 2>&1); then
    echo "$cf_out"
    mapfile -t files < <(printf '%s\n' "$cf_out" | sed -n 's/^\([^: ]*\):[0-9]*:[0-9]*: error: .*/\1/p' | sort -u)
    if [ "${#files[@]}" -eq 0 ]; then
        failed+=("clang-format: failed (output above)")
    else
        counts="${#files[@]} of ${#sources[@]} file(s)"
        failed+=("clang-format: $counts not formatted (clang-format -i FILE... fixes them): ${files[*]}")
    fi
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo >&2
    for message in "${failed[@]}"; do echo "check_format.sh: FAILED: $message" >&2; done
    exit 1
fi
echo "check_format.sh: passed (ruff check, ruff format, clang-format on ${#sources[@]} C++/CUDA files)"
