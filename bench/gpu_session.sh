#!/usr/bin/env bash
# Everything one GPU-machine call does, in stages, so a single call can build, test, check memory and benchmark.
# Run from the repository root:  bash bench/gpu_session.sh build test memcheck bench
# Stages: build (setup.py build_ext --inplace, all kernels unless FLASH_ATTN2_HDIMS/DTYPES say otherwise),
# test (pytest), memcheck (compute-sanitizer over tests/memcheck.py), bench (mma peak + forward grid),
# tune (bench/tune_tiles.py with $TUNE_ARGS). Results go to $OUT (default /tmp/flash_out).
set -uo pipefail
OUT=${OUT:-/tmp/flash_out}
mkdir -p "$OUT"
# The GPU machine has no network: CUTLASS headers come from a carried nvidia-cutlass wheel in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1

status=0
for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
    build)
        start=$SECONDS
        FLASH_ATTN2_CUDA_ARCHS=${FLASH_ATTN2_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} FLASH_ATTN2_PTXAS_VERBOSE=1 \
            python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
        echo "build: $((SECONDS - start)) s wall"
        find build -name .ninja_log -exec cp {} "$OUT/ninja_log.txt" \;
        grep -E "spill stores" "$OUT/build.log" | sort | uniq -c
        ;;
    test)
        timeout 480 python3 -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tail -40 || status=1
        ;;
    memcheck)
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 \
            python3 tests/memcheck.py 2>&1 | tail -15 || status=1
        ;;
    bench)
        python3 bench/mma_peak.py --out-dir "$OUT"
        python3 bench/bench_fwd.py --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -60
        ;;
    tune)
        python3 bench/tune_tiles.py --out-dir "$OUT" ${TUNE_ARGS:-} 2>&1 | tail -60
        ;;
    *)
        echo "unknown stage $stage"; exit 2
        ;;
    esac
done
exit $status
