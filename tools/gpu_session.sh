#!/usr/bin/env bash
# Everything one call on our own GPU machine does, in stages, so a single call can build, test, check memory and
# benchmark. It fits our own GPU access (no network, a carried CUTLASS wheel, at most 8 files back per call); to
# benchmark on your own GPU, run the bench/ scripts directly (bench/README.md).
# Run from the repository root:  bash tools/gpu_session.sh build test memcheck bench
# Stages: build (setup.py build_ext --inplace, all kernels unless FLASH_ATTN2_HDIMS/DTYPES say otherwise; also leaves
# the stripped extension, the autograd library and _build_info.py in $OUT/devbuild.tar.xz so a later call can carry it
# in .devbuild/ and skip the build), prebuilt (installs what .devbuild/ holds instead of building; $DEVBUILD names
# another directory), test (pytest, on $PYTEST_WORKERS workers with $PYTEST_ARGS), memcheck (compute-sanitizer over
# tests/memcheck.py; $MEMCHECK_SECTIONS picks sections), bench (mma peak + forward grid), bench_bwd (backward and
# forward+backward, seqlen 2k/8k/16k, with cuDNN and deterministic mode), bench_sdpa (PyTorch SDPA on our kernels
# against its flash and cuDNN backends, forward and backward, seqlen 2k/8k/16k), bench_varlen, bench_skinny, tune
# (bench/tune_tiles.py with $TUNE_ARGS), profile (Nsight Compute over bench/profile_call.py with $PROFILE_ARGS, ncu
# options $NCU_ARGS, report in $OUT/ncu_profile.txt), upstream (flash-attn's test file carried in .upstream/, through
# tools/upstream_compat.py, one test in $UPSTREAM_EVERY), grad_error_ratio (tools/grad_error_ratio.py with
# $GRAD_ERROR_ARGS), pack (everything in $OUT into one results.tar, since a device call returns at most 8 files).
# Results go to $OUT (default /tmp/flash_out).
set -uo pipefail
OUT=${OUT:-/tmp/flash_out}
mkdir -p "$OUT"
# The GPU machine has no network: CUTLASS headers come from a carried nvidia-cutlass wheel in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# stdin to stdout through Python's lzma module ($1: compress or decompress; preset 3: 40 MB in 6 s, to 3.4 MB).
xz_stream() {
    python3 -c 'import lzma, sys
data = sys.stdin.buffer.read()
sys.stdout.buffer.write(lzma.compress(data, preset=3) if sys.argv[1] == "compress" else lzma.decompress(data))' "$1"
}

status=0
for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
    build)
        start=$SECONDS
        # No PTX unless asked for: the H200 runs the sm_90a SASS of every kernel, and a compute_80 pass added 59%
        # to a head-dim-64 backward file's compile and 35% to a forward one's (measured on a CPU machine).
        FLASH_ATTN2_CUDA_ARCHS=${FLASH_ATTN2_CUDA_ARCHS:-90} FLASH_ATTN2_PTX_ARCHS=${FLASH_ATTN2_PTX_ARCHS:-none} \
            MAX_JOBS=${MAX_JOBS:-16} FLASH_ATTN2_PTXAS_VERBOSE=1 \
            python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
        echo "build: $((SECONDS - start)) s wall"
        find build -name .ninja_log -exec cp {} "$OUT/ninja_log.txt" \;
        grep -E "spill stores" "$OUT/build.log" | sort | uniq -c
        # What a later call needs to skip the build: the stripped extension, the autograd library and
        # _build_info.py, as one xz-compressed tar (a device call returns files of at most 16 MiB; the full sm_90a
        # build's 40 MB compress to 3.4 MB), through Python's lzma module (xz_stream), which needs no xz binary.
        rm -rf /tmp/devbuild && mkdir -p /tmp/devbuild && so=$(ls flash_attn_cuda/_C*.so) &&
            strip --strip-debug -o "/tmp/devbuild/$(basename "$so")" "$so" &&
            cp flash_attn_cuda/_autograd_torch*.so flash_attn_cuda/_build_info.py /tmp/devbuild/ &&
            tar -C /tmp/devbuild -cf - . | xz_stream compress > "$OUT/devbuild.tar.xz"
        ;;
    prebuilt)
        # ${DEVBUILD:-.devbuild}/ holds an earlier build stage's devbuild.tar.xz (carry it), or a bare _C*.so.
        devbuild=${DEVBUILD:-.devbuild}
        if [ -f "$devbuild/devbuild.tar.xz" ]; then
            xz_stream decompress < "$devbuild/devbuild.tar.xz" | tar -xf - -C flash_attn_cuda || exit 1
        else
            cp "$devbuild"/_C*.so "$devbuild"/_autograd_torch*.so "$devbuild"/_build_info.py flash_attn_cuda/ \
                2> /dev/null
        fi
        ls flash_attn_cuda/_C*.so > /dev/null || exit 1
        ;;
    upstream)
        # flash-attn's own tests/test_flash_attn.py, carried in .upstream/ (tools/upstream_compat.py), on a
        # sample of one test in $UPSTREAM_EVERY: v2.8.3's file collects 508,772 tests, 300 keeps about 1,700.
        # Its kvcache tests at 131072 keys take several GiB each (their float32 reference most): fifteen at once
        # overflow an 80 GB card, so they run in a second pass on $UPSTREAM_HEAVY_WORKERS workers.
        : > "$OUT/upstream.log"
        for pass in "not 131072|${UPSTREAM_WORKERS:-15}|${UPSTREAM_TIMEOUT:-300}" \
            "131072|${UPSTREAM_HEAVY_WORKERS:-3}|${UPSTREAM_HEAVY_TIMEOUT:-200}"; do
            IFS='|' read -r select workers limit <<< "$pass"
            timeout "$limit" python3 tools/upstream_compat.py .upstream/test_flash_attn.py \
                --every "${UPSTREAM_EVERY:-300}" -- -q -n "$workers" -k "${UPSTREAM_K:+($UPSTREAM_K) and }$select" \
                -rf --tb=line 2>&1 | tee -a "$OUT/upstream.log" | tail -30
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
        ;;
    test)
        # $PYTEST_WORKERS pytest-xdist workers (default 15), then the two tests past 2^21 CTAs alone: they need
        # 32 and 48 GiB of free GPU memory, which the other workers' allocator caches do not leave on an 80 GB
        # card. $PYTEST_ARGS goes to both passes (e.g. --require-gpu).
        timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider tests -n "${PYTEST_WORKERS:-15}" \
            -k "not 2pow21" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -40
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_large_inputs_gpu.py -k 2pow21 \
            ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/test.log" | tail -5
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    memcheck)
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 10 \
            python3 tests/memcheck.py ${MEMCHECK_SECTIONS:-} 2>&1 | tail -15 || status=1
        ;;
    bench)
        python3 bench/mma_peak.py --out-dir "$OUT"
        python3 bench/bench_fwd.py --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -60
        ;;
    bench_bwd)
        python3 bench/bench_fwd.py --out-dir "$OUT" --pass bwd --quick --impls ours,flash,cudnn,ours_det 2>&1 | tail -12
        python3 bench/bench_fwd.py --out-dir "$OUT" --pass fwd_bwd --quick --impls ours,flash,cudnn 2>&1 | tail -12
        ;;
    bench_sdpa)
        python3 bench/bench_sdpa.py --out-dir "$OUT" --quick 2>&1 | tail -12
        python3 bench/bench_sdpa.py --out-dir "$OUT" --pass bwd --quick 2>&1 | tail -12
        ;;
    bench_varlen)
        python3 bench/bench_varlen.py --out-dir "$OUT" 2>&1 | tail -9
        ;;
    bench_skinny)
        python3 bench/bench_skinny.py --out-dir "$OUT" 2>&1 | tail -32
        ;;
    pack)
        # Only 8 files come back from a device call: bundle everything written so far into one tar.
        tar -C "$OUT" -cf /tmp/flash_results.tar . && find "$OUT" -mindepth 1 -delete &&
            mv /tmp/flash_results.tar "$OUT/results.tar"
        ;;
    tune)
        python3 bench/tune_tiles.py --out-dir "$OUT" ${TUNE_ARGS:-} 2>&1 | tail -60
        ;;
    profile)
        # e.g. PROFILE_ARGS="--pass bwd --shape 8,1,16384,16,128 --impls ours,flash"
        #      NCU_ARGS='--nvtx --nvtx-include ours_bwd/ --nvtx-include flash_bwd/ --set full'
        ncu ${NCU_ARGS:---nvtx --nvtx-include ours_fwd/ --nvtx-include ours_bwd/ --set full} \
            python3 bench/profile_call.py ${PROFILE_ARGS:-} > "$OUT/ncu_profile.txt" 2>&1 || status=1
        tail -40 "$OUT/ncu_profile.txt"
        ;;
    grad_error_ratio)
        python3 tools/grad_error_ratio.py ${GRAD_ERROR_ARGS:-} 2>&1 | tail -20
        ;;
    *)
        echo "unknown stage $stage"; exit 2
        ;;
    esac
done
exit $status
