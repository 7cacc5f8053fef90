"""Measure the mma.sync m16n8k16 bf16->fp32 throughput ceiling of this GPU (bench/mma_peak.cu) and write
<out-dir>/mma_peak.json = {gpu, tflops, date, commit, ...}, which bench_fwd.py reads to report fractions of it.

    python bench/mma_peak.py [--out-dir bench/results/<gpu>] [--iters 8192] [--reps 20]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def find_nvcc():
    for cand in (
        os.environ.get("NVCC"),
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
    ):
        if cand and os.path.exists(cand):
            return cand
    sys.exit("nvcc not found (set NVCC or CUDA_HOME)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=None, help="default bench/results/<gpu>/, e.g. bench/results/h200/")
    p.add_argument("--iters", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    args.out_dir = common.out_dir(args.out_dir)
    if not torch.cuda.is_available():
        sys.exit("mma_peak.py needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "mma_peak")
        subprocess.run([nvcc, "-O3", f"-arch={arch}", os.path.join(HERE, "mma_peak.cu"), "-o", exe], check=True)
        res = subprocess.run([exe, str(args.iters), str(args.reps)], capture_output=True, text=True)
    print(res.stdout, end="")
    if res.returncode != 0:
        sys.exit(f"mma_peak failed (rc {res.returncode}): {res.stderr.strip()}")
    fields = dict(re.findall(r"(\w+)=(\S+)", res.stdout))
    st = common.stamp()
    out = {
        "gpu": st["gpu"],
        "tflops": float(fields["tflops_median"]),
        "tflops_max": float(fields["tflops_max"]),
        "date": st["date"],
        "commit": st["commit"],
        "arch": arch,
        "instruction": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "config": {
            k: fields[k]
            for k in ("sms", "blocks", "threads", "blocks_per_sm", "chains", "iters", "reps")
            if k in fields
        },
    }
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "mma_peak.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"[mma_peak] {out['gpu']}: {out['tflops']:.1f} TFLOP/s (median; best {out['tflops_max']:.1f}) -> {path}")


if __name__ == "__main__":
    main()
