"""JIT-compiles every kernel module of a build once, in parallel processes, into CUDA's compute cache.

A build with PTX only (FLASH_ATTN2_CUDA_ARCHS=none) runs on a GPU by having the driver compile each module's PTX
at its first use, which takes seconds per module. A test run with several workers would compile every module
in every worker; after this script, they all read the compiled code from the cache. Set the same CUDA_CACHE_PATH
(and a CUDA_CACHE_MAXSIZE large enough, e.g. 4294967296) for this script and for the runs after it.

    CUDA_CACHE_PATH=/tmp/nvcache CUDA_CACHE_MAXSIZE=4294967296 python tools/jit_warmup.py [--jobs 16]
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

# One small call that runs the kernel `name` (e.g. bwd_hdim128_bf16_causal): a forward, and for bwd_* also its
# backward.
CALL = """
import sys, torch
from flash_attn_cuda import flash_attn_func
pass_, hdim, dtype, mask = sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4]
q, k, v = (torch.randn(1, 129, 2, hdim, dtype=dtype, device="cuda", requires_grad=pass_ == "bwd") for _ in range(3))
out = flash_attn_func(q, k, v, causal=mask == "causal")
if pass_ == "bwd":
    out.sum().backward()
torch.cuda.synchronize()
"""

DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16"}


def run(name, package_parent):
    pass_, hdim, dtype, mask = name.split("_")
    start = time.perf_counter()
    # From the directory that holds the imported package: `python -c` puts the working directory first on the
    # path, where a checkout's flash_attn_cuda would shadow the build under test.
    proc = subprocess.run(
        [sys.executable, "-c", CALL, pass_, hdim.removeprefix("hdim"), DTYPE_NAMES[dtype], mask],
        capture_output=True,
        text=True,
        cwd=package_parent,
    )
    return name, proc.returncode, time.perf_counter() - start, proc.stderr[-2000:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes")
    args = parser.parse_args(argv)
    import flash_attn_cuda

    names = sorted(flash_attn_cuda.compiled_kernels())
    package_parent = os.path.dirname(os.path.dirname(flash_attn_cuda.__file__))
    start = time.perf_counter()
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for name, returncode, seconds, stderr in pool.map(lambda n: run(n, package_parent), names):
            print(f"{name}: {'ok' if returncode == 0 else 'FAILED'} in {seconds:.1f} s", flush=True)
            if returncode != 0:
                failed += 1
                print(stderr, file=sys.stderr)
    print(f"jit_warmup: {len(names)} kernels in {time.perf_counter() - start:.1f} s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
