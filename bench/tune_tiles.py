"""Measure tile shapes per head dim on this GPU: forward (kBlockM, kBlockN, warps) or backward (kBlockM, kBlockN).

Builds one reduced copy of the extension per candidate tile (bf16, the requested head dims, this GPU's arch)
in parallel, then times each on the anchor shapes (16k tokens, hidden 2048) next to SDPA's flash backend,
and reports the best tile per (head dim, causal) by geometric mean over seqlens. A tile that does not fit a
head dim (shared memory, registers) fails to build and is reported as failed.

    python bench/tune_tiles.py --hdims 64,128,256 --tiles "128,64,4;128,128,8;128,64,8"
    python bench/tune_tiles.py --pass bwd --hdims 64,96 --tiles "64,128;128,128;64,64"
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pass", dest="pass_", choices=["fwd", "bwd"], default="fwd")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--tiles", default=None, help="';'-separated; fwd 'M,N,WARPS', bwd 'M,N'")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--rounds", type=int, default=3, help="turns ours and SDPA flash take per cell (median)")
    p.add_argument("--work-dir", default="/tmp/flash_tune")
    p.add_argument("--out-dir", default=None, help="default bench/results/<gpu>/, e.g. bench/results/h200/")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: time one built copy
    a = p.parse_args(argv)
    if a.tiles is None:
        a.tiles = "128,64,4;128,128,8;128,64,8;64,64,4" if a.pass_ == "fwd" else "64,128;128,128;64,64"
    return a


def tile_dir(work_dir, tile):
    return os.path.join(work_dir, "t" + tile.replace(",", "_"))


def build_all(args, tiles):
    """Starts every build at once; each gets a share of the cores. Returns {tile: error or None}."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    jobs = max(1, (os.cpu_count() or 1) // len(tiles))
    procs = {}
    for tile in tiles:
        dest = tile_dir(args.work_dir, tile)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        for item in ("setup.py", "pyproject.toml", "csrc", "flash_attn_cuda"):
            src = os.path.join(ROOT, item)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(dest, item))
        env = dict(
            os.environ,
            FLASH_ATTN2_HDIMS=args.hdims,
            FLASH_ATTN2_DTYPES="bf16",
            FLASH_ATTN2_CUDA_ARCHS=f"{major}{minor}",
            **{"FLASH_ATTN2_FWD_TILE" if args.pass_ == "fwd" else "FLASH_ATTN2_BWD_TILE": tile},
            FLASH_ATTN2_PTXAS_VERBOSE="1",
            MAX_JOBS=str(jobs),
        )
        log = open(os.path.join(dest, "build.log"), "w")
        procs[tile] = (
            subprocess.Popen(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=dest,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log,
        )
    status = {}
    for tile, (proc, log) in procs.items():
        status[tile] = None if proc.wait() == 0 else f"build failed (see {log.name})"
        log.close()
    return status


def spills(tile, work_dir):
    """Lines of the ptxas report that mention spills, per kernel, from the build log."""
    with open(os.path.join(tile_dir(work_dir, tile), "build.log")) as f:
        return sorted({line.strip() for line in f if "spill stores" in line})


def timed(fn, inputs, pass_, grad_like=None):
    """fn itself, or for the backward a call of autograd on one kept forward graph, with dout made by
    grad_like(out) (default torch.randn_like: out's layout)."""
    import torch

    if pass_ == "fwd":
        return fn
    out = fn()
    dout = (grad_like or torch.randn_like)(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def measure(args):
    """Runs inside a copy: times its flash_attn_cuda and SDPA flash, prints one JSON list."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import common
    from flash_attn_cuda import flash_attn_func

    rows = []
    for hdim in [int(x) for x in args.hdims.split(",")]:
        nheads = 2048 // hdim
        for seqlen in [int(x) for x in args.seqlens.split(",")]:
            batch = max(1, 16384 // seqlen)
            q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            if args.pass_ == "bwd":
                for t in (q, k, v):
                    t.requires_grad_()
            # SDPA's own copy, as the transposed views of (b, s, h, d) tensors that models give it; its dout in
            # the output's layout (common.sdpa_view, common.sdpa_grad).
            qt, kt, vt = (common.sdpa_view(t) for t in (q, k, v))
            for causal in (False, True):
                flops = common.attn_flops(batch, nheads, seqlen, seqlen, hdim, causal, args.pass_)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # (no effect on ours)
                    calls = {
                        "ours": timed(lambda: flash_attn_func(q, k, v, causal=causal), (q, k, v), args.pass_),
                        "flash": timed(
                            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                            (qt, kt, vt),
                            args.pass_,
                            common.sdpa_grad,
                        ),
                    }
                    # The two take turns: an untimed warm-up round (-1), then --rounds rounds, each starting with
                    # the other one than the round before; a cell is the median of its rounds.
                    times, errors = {n: [] for n in calls}, {}
                    for r in range(-1, args.rounds):
                        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                            if name not in errors:
                                ms, e = common.try_time(calls[name], 3, 20)
                                if e:
                                    errors[name] = e
                                elif r >= 0:
                                    times[name].append(ms)
                ours, flash = (statistics.median(times[n]) if times[n] and n not in errors else None for n in calls)
                err = errors.get("ours")
                rows.append(
                    {
                        "hdim": hdim,
                        "seqlen": seqlen,
                        "causal": causal,
                        "ours_tflops": flops / ours / 1e9 if ours else None,
                        "flash_tflops": flops / flash / 1e9 if flash else None,
                        "error": err,
                    }
                )
    print(json.dumps(rows))


def main(argv=None):
    args = parse_args(argv)
    if args.measure:
        return measure(args)
    import common

    tiles = [t.strip() for t in args.tiles.split(";") if t.strip()]
    start = time.time()
    status = build_all(args, tiles)
    print(f"built {len(tiles)} variants in {time.time() - start:.0f} s", flush=True)
    results = {}
    for tile in tiles:
        if status[tile]:
            results[tile] = {"error": status[tile]}
            continue
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--measure",
                "1",
                "--hdims",
                args.hdims,
                "--seqlens",
                args.seqlens,
                "--pass",
                args.pass_,
                "--rounds",
                str(args.rounds),
            ],
            cwd=tile_dir(args.work_dir, tile),
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=tile_dir(args.work_dir, tile) + os.pathsep + HERE),
        )
        try:
            results[tile] = {
                "rows": json.loads(out.stdout.strip().splitlines()[-1]),
                "spills": spills(tile, args.work_dir),
            }
        except (ValueError, IndexError):
            results[tile] = {"error": (out.stderr or out.stdout)[-2000:]}

    tile_name = "tile (M,N,warps)" if args.pass_ == "fwd" else "tile (M,N)"
    lines = [
        f"| hdim | causal | {tile_name} | geomean TFLOP/s | geomean vs flash | spills |",
        "|---|---|---|---|---|---|",
    ]
    best = {}
    for hdim in [int(x) for x in args.hdims.split(",")]:
        for causal in (False, True):
            for tile, res in results.items():
                rows = [
                    r for r in res.get("rows", []) if r["hdim"] == hdim and r["causal"] == causal and r["ours_tflops"]
                ]
                if not rows:
                    lines.append(f"| {hdim} | {causal} | {tile} | failed | | {res.get('error', '')[:80]} |")
                    continue
                g = common.geomean([r["ours_tflops"] for r in rows])
                ratio = common.geomean([r["ours_tflops"] / r["flash_tflops"] for r in rows if r["flash_tflops"]])
                nspill = sum(1 for s in res["spills"] if not s.startswith("0 bytes stack frame, 0 bytes spill"))
                lines.append(f"| {hdim} | {causal} | {tile} | {g:.0f} | {ratio:.3f} | {nspill} kernels spill |")
                if g > best.get((hdim, causal), (0, None))[0]:
                    best[(hdim, causal)] = (g, tile)
    lines.append("")
    lines += [f"best hdim {h} causal={c}: {t} ({g:.0f} TFLOP/s)" for (h, c), (g, t) in sorted(best.items())]
    meta = common.stamp()
    meta["method"] = (
        f"bf16; each cell the median over {args.rounds} rounds (after an untimed warm-up round) in "
        "which ours and SDPA flash take turns, each round the median of 20 timed calls after 3 "
        "warm-up calls; SDPA gets the (b, h, s, d) transposed views of (b, s, h, d) tensors."
    )
    args.out_dir = common.out_dir(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    name = f"tune_{args.pass_}_{common.slug(meta['gpu'])}"
    with open(os.path.join(args.out_dir, name + ".json"), "w") as f:
        json.dump({"meta": meta, "seqlens": args.seqlens, "results": results}, f, indent=1)
    title = "Forward" if args.pass_ == "fwd" else "Backward"
    text = f"# {title} tile tuning ({args.pass_} TFLOP/s)\n\n{meta}\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, name + ".md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
