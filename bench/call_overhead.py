"""Where the time of a small attention call goes, ours against SDPA's FLASH_ATTENTION backend, on the GPU.

For decoding-sized shapes the per-call time of bench_skinny.py (CUDA events around each call, inputs requiring
grad) is the larger of the host's work and the kernels'. This separates the two:
  event_grad / event_nograd  CUDA events around each call, as in bench_skinny.py, with and without grad
  host_grad / host_nograd    host time per call (perf_counter over 100 calls without a synchronization)
  gpu                        GPU time per call: 20 calls captured in a CUDA graph and replayed
and, for ours, the GPU time of the mma.sync kernels (FLASH_ATTN2_DISABLE_WGMMA=1) and of forced key splits.

    python bench/call_overhead.py --out-dir bench/results
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))
import common  # noqa: E402

SHAPES = [  # b, sq, sk, h, hk, d, causal
    (8, 1, 4096, 16, 16, 128, False),
    (8, 1, 16384, 16, 16, 128, False),
    (8, 1, 4096, 32, 4, 128, False),
    (8, 1, 16384, 32, 4, 128, False),
    (8, 16, 4096, 16, 16, 128, False),
    (8, 16, 4096, 32, 4, 128, False),
    (1, 1024, 1024, 1, 1, 128, True),
    (1, 1024, 1024, 4, 4, 128, True),
]


def event_us(fn, rep=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for s, e in pairs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def host_us(fn, calls=100, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_us(fn, calls=20, replays=10):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def with_env(name, value, fn):
    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    from flash_attn_cuda import flash_attn_func
    from flash_attn_cuda.interface import _prepare
    from torch.nn.attention import SDPBackend, sdpa_kernel

    meta = common.stamp()
    print(f"[call_overhead] {meta['gpu']} commit {meta['commit']}: microseconds per call")
    rows = []
    for b, sq, sk, h, hk, d, causal in SHAPES:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        ours = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        flash = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk)  # noqa: E731
        op = torch.ops.flash_attn2.fwd
        scale = d ** -0.5
        row = {"shape": [b, sq, sk, h, hk, d, causal]}
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            warnings.simplefilter("ignore")
            for name, fn in (("ours", ours), ("flash", flash)):
                def nograd(fn=fn):
                    with torch.no_grad():
                        return fn()
                row[name] = {"event_grad": event_us(fn), "event_nograd": event_us(nograd),
                             "host_grad": host_us(fn), "host_nograd": host_us(nograd), "gpu": graph_us(fn)}

            def op_nograd():
                with torch.no_grad():
                    return op(q, k, v, scale, causal, False)
            row["ours"]["host_op_nograd"] = host_us(op_nograd)
            row["ours"]["host_prepare"] = host_us(lambda: _prepare(q, k, v, None, 4, ""))
            # What any torch.ops call costs from Python: a trivial aten op through the same binding.
            row["ours"]["host_trivial_op"] = host_us(lambda: torch.ops.aten.alias(q))
            row["ours"]["gpu_mma_sync"] = graph_us(with_env("FLASH_ATTN2_DISABLE_WGMMA", "1", ours))
            for splits in (1, 2, 4, 8):
                row["ours"][f"gpu_splits{splits}"] = graph_us(with_env("FLASH_ATTN2_NUM_SPLITS", str(splits), ours))
                row["ours"][f"gpu_mma_sync_splits{splits}"] = graph_us(
                    with_env("FLASH_ATTN2_NUM_SPLITS", str(splits), with_env("FLASH_ATTN2_DISABLE_WGMMA", "1", ours)))
        rows.append(row)
        print(f"{tuple(row['shape'])}")
        for name in ("ours", "flash"):
            print(f"  {name:5s} " + "  ".join(f"{k} {v:.1f}" for k, v in row[name].items()), flush=True)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"call_overhead_{meta['gpu_slug']}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"[call_overhead] wrote {path}")


if __name__ == "__main__":
    main()
