"""Host time of one small, host-bound attention call, piece by piece, ours against SDPA's FLASH_ATTENTION
backend (bench_skinny's batch 1, 4 heads, 1024 causal tokens by default).

Prints and writes to --out-dir (host_breakdown_<gpu>.json):
  host    perf_counter per call over --calls calls without a synchronization, for the whole call with and without
          grad, our op alone, our op unsplit, and the building blocks a call is made of (an allocation, an
          allocation plus a kernel launch, a trivial op through torch.ops, flash_attn_func's argument handling);
  rounds  --rounds alternating rounds of bench_skinny's timing (CUDA events around each of 30 calls, median),
          to show how far one run's ratio moves from the next;
  profile the torch.profiler CPU table of --calls calls of each (self CPU time per op and per CUDA runtime call).

    python bench/host_breakdown.py --shape 1,1024,1024,4,128,1
"""
import argparse
import json
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))
import common  # noqa: E402
from call_overhead import event_us, host_us, with_env  # noqa: E402


def profile_table(fn, calls, rows=14):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1,1024,1024,4,128,1", help="batch,seqlen_q,seqlen_k,nheads,head_dim,causal")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--label", default="", help="added to the output file name (e.g. the build compared)")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    from flash_attn_cuda import flash_attn_func
    from flash_attn_cuda.interface import _prepare
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, sq, sk, h, d, causal = (int(x) for x in a.shape.split(","))
    causal = bool(causal)
    meta = common.stamp()
    meta.update(shape=[b, sq, sk, h, d, causal], label=a.label)
    print(f"[host_breakdown] {meta['gpu']} commit {meta['commit']} {a.label}: shape {meta['shape']}, us per call")
    dtype = torch.bfloat16
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    scale = d ** -0.5
    op = torch.ops.flash_attn2.fwd
    small = torch.randn(4, device="cuda")

    def nograd(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    ours = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    flash = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
    op_alone = nograd(lambda: op(q, k, v, scale, causal, False))
    pieces = {
        "ours grad": ours,
        "ours no grad": nograd(ours),
        "ours op alone": op_alone,
        "ours op alone, 1 split": with_env("FLASH_ATTN2_NUM_SPLITS", "1", op_alone),
        "flash grad": flash,
        "flash no grad": nograd(flash),
        "torch.empty like out": lambda: torch.empty(b, sq, h, d, device="cuda", dtype=dtype),
        "aten.neg (alloc + launch)": lambda: torch.neg(small),
        "torch.ops.aten.alias": lambda: torch.ops.aten.alias(q),
        "_prepare": lambda: _prepare(q, k, v, None, 4, ""),
    }
    result = {"meta": meta, "host": {}, "rounds": [], "profile": {}}
    with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        warnings.simplefilter("ignore")
        for name, fn in pieces.items():
            result["host"][name] = host_us(fn, a.calls, warmup=20)
            print(f"  host  {name:28s} {result['host'][name]:6.1f}", flush=True)
        for i in range(a.rounds):
            ours_us, flash_us = event_us(ours), event_us(flash)
            result["rounds"].append({"ours": ours_us, "flash": flash_us})
            print(f"  round {i}: event ours {ours_us:5.1f} flash {flash_us:5.1f} ratio {flash_us / ours_us:.3f}",
                  flush=True)
        for name, fn in (("ours grad", ours), ("flash grad", flash)):
            table = profile_table(fn, a.calls)
            result["profile"][name] = table
            print(f"  profile of {a.calls} calls, {name}:\n{table}", flush=True)
    ratios = [r["flash"] / r["ours"] for r in result["rounds"]]
    if ratios:
        print(f"  ratio flash/ours over rounds: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    os.makedirs(a.out_dir, exist_ok=True)
    suffix = f"_{a.label}" if a.label else ""
    path = os.path.join(a.out_dir, f"host_breakdown_{meta['gpu_slug']}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[host_breakdown] wrote {path}")


if __name__ == "__main__":
    main()
