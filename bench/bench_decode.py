"""Decoding against a long KV cache: one query token per sequence, ours against SDPA and the HBM copy, in one run.

The targets: flash_attn_with_kvcache with a 1-token query runs at >= 90% of the HBM copy bandwidth measured
in the same run, and a paged cache (page sizes 16, 64, 256) runs within 10% of the contiguous cache. Shapes, all
head dim 128, 32 query heads (bf16 unless --dtype fp16):

  b1_64k      batch 1,  65536 keys, 32 KV heads (MHA)       K+V 1.07 GB in bf16
  b8_8k_gqa   batch 8,   8192 keys,  8 KV heads (GQA 32:8)  K+V 0.27 GB
  b32_4k      batch 32,  4096 keys, 32 KV heads (MHA)       K+V 2.15 GB

Rows of each shape (each implementation gets its own copy of the data, laid out as it wants, made before timing):

  ours            flash_attn_with_kvcache, contiguous cache (b, s, hk, d), cache_seqlens an int32 device tensor
                  holding s (the whole cache is attended to)
  ours_paged<P>   the same keys in a paged cache (b*s/P, P, hk, d) with a shuffled block_table (torch.randperm)
  ours_oversize   a contiguous cache of 1.25 s rows of which cache_seqlens = s are used: the host cannot see the
                  lengths, so this shows how the key-split heuristic copes with a cache larger than its use
  ours_append     a decoding step with append: k, v of one new token written at row s - 1 (cache_seqlens = s - 1)
                  and then attended to; the new row equals the row already there, so the cache never changes
  ours_func       flash_attn_func(q, k, v) on the contiguous cache: the plain kernel, without cache support
  sdpa_flash      torch SDPA under sdpa_kernel(FLASH_ATTENTION), q (b, h, 1, d), k and v (b, hk, s, d), each the
                  transposed view of its own (b, s, h, d) copy (the layout models give SDPA), enable_gqa=True for GQA
  sdpa_cudnn      the same under CUDNN_ATTENTION
  copy            dst.copy_(src) of a buffer of N bytes, N = the shape's K+V bytes: the HBM reference

Bandwidth, defined once:
  - attention rows: N / t, N = K+V bytes of the used cache (2 * b * s * hk * d * element size); the query, the
    output and the appended row are not counted (each under 0.1% of N).
  - copy row: 2N / t, since a copy of N bytes reads N bytes and writes N bytes (read + write traffic, the STREAM
    "copy" convention). This read+write rate is the HBM reference.
  - "of copy" = attention N / t over the copy's 2N / t. The target: ours (contiguous) >= 0.90.
  - "/ ours" = the row's time over ours (contiguous). The target: every paged row <= 1.10.

Timing (bench/common.py): first an untimed warm-up round over every implementation (which also runs a loose
sanity check of every ours row against SDPA's output), then --rounds rounds in which a shape's implementations
take turns (round r starts with the r-th); each turn is common.time_ms, the median of --rep calls each between
its own pair of CUDA events after --warmup untimed calls; each cell is the median over the rounds. The caches
(>= 268 MB) are larger than the H200's 50 MB L2, so every call reads them from HBM without an explicit flush.
With --cuda-graph each call is captured once in a CUDA graph and the replays are timed (no host overhead).

    python bench/bench_decode.py                    # -> decode_<gpu-slug>_bf16.{json,md,png} in bench/results/<gpu>/
    python bench/bench_decode.py --dtype fp16 --shapes b1_64k --page-sizes 16,256
    python bench/bench_decode.py --dry-run          # the shapes, bytes and memory needed; no GPU
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # repo root, last: an installed flash_attn_cuda wins over an unbuilt tree
import common  # noqa: E402

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HDIM = 128
NHEADS = 32
# name -> (batch, seqlen of the cache in use, nheads, nheads_k)
SHAPES = {
    "b1_64k": (1, 65536, NHEADS, 32),
    "b8_8k_gqa": (8, 8192, NHEADS, 8),
    "b32_4k": (32, 4096, NHEADS, 32),
}
DEFAULT_PAGE_SIZES = (16, 64, 256)
OVERSIZE = 1.25  # capacity of the oversize cache over the rows in use
COPY_FRAC_TARGET = 0.90  # ours contiguous: K+V read rate over the copy's read+write rate
PAGED_RATIO_TARGET = 1.10  # paged time over contiguous time
SANITY_REL_TOL = 0.05  # a loose "same function" check, not the correctness rule (tests/ is)


# ---------------------------------------------------------------------------------------------- arguments


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=5, help="turns each implementation takes per shape (median)")
    p.add_argument("--rep", type=int, default=30, help="timed calls per turn (at least 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each turn's timed calls")
    p.add_argument(
        "--shapes",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(SHAPES),
        help=f"comma-separated subset of {','.join(SHAPES)}",
    )
    p.add_argument(
        "--page-sizes",
        type=int_list,
        default=list(DEFAULT_PAGE_SIZES),
        help="comma-separated page sizes of the paged rows (multiples of 16)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time replays of a CUDA graph of each call instead of eager calls (no host overhead)",
    )
    p.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=None,
        help="default bench/results/<gpu>/, e.g. bench/results/h200/",
    )
    p.add_argument("--strict", action="store_true", help="exit with status 2 when a target is missed")
    p.add_argument("--dry-run", action="store_true", help="print the shapes, bytes and memory needed; no GPU")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown or not a.shapes:
        p.error(f"--shapes must be drawn from {','.join(SHAPES)} (got {','.join(a.shapes) or 'nothing'})")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if any(ps < 1 for ps in a.page_sizes):
        p.error("--page-sizes must be positive")
    a.rep = max(a.rep, 20)
    return a


# ------------------------------------------------------------------------------------------------ shapes


def impl_names(page_sizes):
    return (
        ["ours"]
        + [f"ours_paged{ps}" for ps in page_sizes]
        + ["ours_oversize", "ours_append", "ours_func", "sdpa_flash", "sdpa_cudnn", "copy"]
    )


def impl_label(name):
    if name.startswith("ours_paged"):
        return f"ours, paged {name[len('ours_paged') :]}"
    return {
        "ours": "ours, contiguous",
        "ours_oversize": f"ours, contiguous, {OVERSIZE:g}x cache",
        "ours_append": "ours, append 1 token + decode",
        "ours_func": "ours, flash_attn_func (no cache)",
        "sdpa_flash": "SDPA flash (contiguous)",
        "sdpa_cudnn": "SDPA cuDNN (contiguous)",
        "copy": "copy, N bytes (read + write)",
    }[name]


def kv_bytes(shape, elem_size):
    b, s, _, hk = SHAPES[shape]
    return 2 * b * s * hk * HDIM * elem_size


def shape_title(shape, elem_size):
    b, s, h, hk = SHAPES[shape]
    heads = f"{h} heads (MHA)" if h == hk else f"{h}:{hk} heads (GQA)"
    return f"batch {b}, {s} keys, {heads}, head dim {HDIM}, K+V {kv_bytes(shape, elem_size) / 1e9:.2f} GB"


def memory_needed(shape, elem_size, page_sizes):
    """Bytes of device memory a shape's inputs take: the contiguous cache, each paged cache, the oversize cache,
    SDPA's copy and the copy's two buffers (N each)."""
    n = kv_bytes(shape, elem_size)
    return n * (1 + len(page_sizes) + OVERSIZE + 1 + 2)


def dry_run(args):
    esize = torch.finfo(DTYPES[args.dtype]).bits // 8
    names = impl_names(args.page_sizes)
    print(f"dtype {args.dtype}, head dim {HDIM}; implementations: {', '.join(names)}")
    calls = args.rounds * len(names) * (args.warmup + args.rep)
    for shape in args.shapes:
        n = kv_bytes(shape, esize)
        # ~4 TB/s of read+write copy traffic: an attention call about N / 3.6 TB/s, the copy 2N / 4 TB/s.
        est = calls * n / 3.6e12 + args.rounds * (args.warmup + args.rep) * 2 * n / 4e12
        print(
            f"  {shape:10s} {shape_title(shape, esize)}; needs about "
            f"{memory_needed(shape, esize, args.page_sizes) / 2**30:.1f} GiB; timed calls about {est:.1f} s"
        )
    bad = [ps for ps in args.page_sizes for s in args.shapes if SHAPES[s][1] % ps or ps % 16]
    if bad:
        print(
            f"  page sizes {sorted(set(bad))} do not divide a shape's keys or are not multiples of 16: those "
            "rows will be n/a"
        )
    print(f"Outputs: {args.out_dir or 'bench/results/<gpu>'}/decode_<gpu-slug>_{args.dtype}.json, .md, .png")


# ------------------------------------------------------------------------------------------------ runners


def err_text(exc):
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


def make_runners(lib, lib_err, shape, args, dtype):
    """name -> (context factory, fn, layout) or an error string; layout says how to read fn's output as
    (b, 1, h, d): "bshd" for ours, "bhsd" for SDPA, None for the copy."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, h, hk = SHAPES[shape]
    d = HDIM
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + list(SHAPES).index(shape))
    cpu_gen = torch.Generator().manual_seed(2000 + list(SHAPES).index(shape))
    q = torch.randn(b, 1, h, d, device=DEVICE, dtype=dtype, generator=gen)
    k = torch.randn(b, s, hk, d, device=DEVICE, dtype=dtype, generator=gen)
    v = torch.randn(b, s, hk, d, device=DEVICE, dtype=dtype, generator=gen)
    seqlens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
    none = contextlib.nullcontext
    runners = {}

    def ours(name, fn):
        runners[name] = lib_err if lib is None else (none, fn, "bshd")

    ours("ours", lambda: lib.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens))

    for ps in args.page_sizes:
        name = f"ours_paged{ps}"
        if s % ps or ps % 16:
            runners[name] = f"page size {ps} must be a multiple of 16 that divides the {s} keys"
            continue
        pages = s // ps
        perm = torch.randperm(b * pages, generator=cpu_gen).to(DEVICE)
        table = perm.view(b, pages).to(torch.int32)
        # Page perm[i] holds chunk i of the contiguous cache, so block_table[j, p] = perm[j * pages + p] lists
        # sequence j's pages in order and the paged call attends to exactly the contiguous call's keys.
        pool_k = torch.empty(b * pages, ps, hk, d, device=DEVICE, dtype=dtype)
        pool_v = torch.empty_like(pool_k)
        pool_k[perm] = k.reshape(b * pages, ps, hk, d)
        pool_v[perm] = v.reshape(b * pages, ps, hk, d)
        ours(
            name,
            lambda pk=pool_k, pv=pool_v, t=table: lib.flash_attn_with_kvcache(
                q, pk, pv, cache_seqlens=seqlens, block_table=t
            ),
        )

    cap = int(round(s * OVERSIZE))
    k_big = torch.zeros(b, cap, hk, d, device=DEVICE, dtype=dtype)
    v_big = torch.zeros_like(k_big)
    k_big[:, :s] = k
    v_big[:, :s] = v
    ours("ours_oversize", lambda: lib.flash_attn_with_kvcache(q, k_big, v_big, cache_seqlens=seqlens))

    # The appended token is the cache's last row itself: the append rewrites that row with the same values.
    k_new, v_new = k[:, s - 1 : s].clone(), v[:, s - 1 : s].clone()
    seqlens_before = seqlens - 1
    ours("ours_append", lambda: lib.flash_attn_with_kvcache(q, k, v, k=k_new, v=v_new, cache_seqlens=seqlens_before))

    # The same attention through flash_attn_func, whose plain kernel has no cache support: what the cache's
    # variants kernel costs over it.
    ours("ours_func", lambda: lib.flash_attn_func(q, k, v))

    # SDPA's own copy, as the transposed views of (b, s, h, d) tensors that models give it (common.sdpa_view).
    qt, kt, vt = (common.sdpa_view(x) for x in (q, k, v))
    extra = {"enable_gqa": True} if h != hk else {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        runners[name] = (
            lambda be=backend: sdpa_kernel([be]),
            lambda: F.scaled_dot_product_attention(qt, kt, vt, **extra),
            "bhsd",
        )

    n_elems = kv_bytes(shape, 1)  # K+V elements: 2 * b * s * hk * d
    src = torch.randn(n_elems, device=DEVICE, dtype=dtype, generator=gen)
    dst = torch.empty_like(src)
    runners["copy"] = (none, lambda: dst.copy_(src), None)
    return runners


def graphed(ctx, fn):
    """fn captured in a CUDA graph (after two calls on a side stream); returns the graph and its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), ctx():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with ctx(), torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph, graph.replay


def warm_up(runners, row, args):
    """The untimed warm-up round over every implementation: a failure is recorded and the implementation left
    out. Returns (timers name -> (ctx, fn), outputs name -> (b, 1, h, d) float32, graphs to keep alive)."""
    timers, outs, graphs = {}, {}, []
    for name, runner in runners.items():
        if isinstance(runner, str):
            row["errors"][name] = runner
            continue
        ctx, fn, layout = runner
        with warnings.catch_warnings(record=True) as caught, ctx():
            warnings.simplefilter("always")
            try:
                for _ in range(max(args.warmup, 1)):
                    out = fn()
                torch.cuda.synchronize()
            except Exception as exc:
                err = err_text(exc)
                if caught:
                    err += " | " + str(caught[0].message).strip().splitlines()[0][:200]
                row["errors"][name] = err
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                continue
        if layout is not None:
            outs[name] = (out if layout == "bshd" else out.transpose(1, 2)).detach().float().clone()
        if args.cuda_graph:
            try:
                graph, fn = graphed(ctx, fn)
                graphs.append(graph)
            except Exception as exc:
                row["errors"][name] = "CUDA graph capture: " + err_text(exc)
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                continue
        timers[name] = (ctx, fn)
    return timers, outs, graphs


def sanity_check(row, outs):
    """Each ours row against SDPA's output (flash, else cuDNN): a warning past SANITY_REL_TOL of max |out|."""
    ref = next((n for n in ("sdpa_flash", "sdpa_cudnn") if n in outs), None)
    if ref is None:
        row["warnings"].append("no SDPA output to check ours against")
        return
    b = outs[ref]
    scale = max(b.abs().max().item(), 1e-30)
    for name, a in outs.items():
        if not name.startswith("ours"):
            continue
        diff = (a - b).abs().max().item()
        row["checks"][name] = {"vs": ref, "max_abs_diff": diff, "rel_to_max": diff / scale}
        if not diff / scale <= SANITY_REL_TOL:  # also catches NaN
            row["warnings"].append(
                f"{name} differs from {ref}: max|diff| = {diff:.3g} ({diff / scale:.1%} of max|out|)"
            )


def time_rounds(timers, row, args):
    """args.rounds rounds in which the implementations take turns, round r starting with the r-th; an
    implementation that fails is recorded and left out of later rounds."""
    times = {name: [] for name in timers}
    names = list(timers)
    for r in range(args.rounds if names else 0):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in row["errors"]:
                continue
            ctx, fn = timers[name]
            with warnings.catch_warnings(), ctx():
                warnings.simplefilter("ignore")
                ms, err = common.try_time(fn, args.warmup, args.rep)
            if err:
                row["errors"][name] = f"round {r}: {err}"
                times[name] = []
            else:
                times[name].append(ms)
    row["rounds_ms"] = times
    for name in row["ms"]:
        row["ms"][name] = statistics.median(times[name]) if times.get(name) else None


def new_row(shape, args, esize, err=None):
    b, s, h, hk = SHAPES[shape]
    names = impl_names(args.page_sizes)
    row = {
        "shape": shape,
        "batch": b,
        "seqlen": s,
        "nheads": h,
        "nheads_k": hk,
        "hdim": HDIM,
        "dtype": args.dtype,
        "kv_bytes": kv_bytes(shape, esize),
        "oversize_capacity": int(round(s * OVERSIZE)),
        "impls": names,
        "labels": {n: impl_label(n) for n in names},
        "ms": {n: None for n in names},
        "rounds_ms": {},
        "errors": {},
        "warnings": [],
        "checks": {},
    }
    if err:
        row["errors"] = {n: err for n in names}
    return row


def bench_shape(lib, lib_err, shape, args, dtype, esize):
    row = new_row(shape, args, esize)
    runners = make_runners(lib, lib_err, shape, args, dtype)
    timers, outs, graphs = warm_up(runners, row, args)
    sanity_check(row, outs)
    time_rounds(timers, row, args)
    del runners, timers, outs, graphs
    return row


# ------------------------------------------------------------------------------------------------ derived


def finish_row(row, page_sizes):
    """GB/s, fraction of the copy's rate, time over ours, and the two targets' verdicts."""
    n, ms = row["kv_bytes"], row["ms"]
    gbps, frac, rel = {}, {}, {}
    for name, t in ms.items():
        traffic = 2 * n if name == "copy" else n
        gbps[name] = traffic / (t * 1e-3) / 1e9 if t else None
    copy = gbps.get("copy")
    for name, t in ms.items():
        frac[name] = gbps[name] / copy if gbps[name] and copy else None
        rel[name] = t / ms["ours"] if t and ms.get("ours") else None
    row.update(
        gbps=gbps,
        frac_copy=frac,
        time_over_ours=rel,
        copy_read_only_gbps=n / (ms["copy"] * 1e-3) / 1e9 if ms.get("copy") else None,
    )
    verdict = {
        "ours_frac_copy": frac.get("ours"),
        "ours_pass": None if frac.get("ours") is None else frac["ours"] >= COPY_FRAC_TARGET,
        "paged": {},
    }
    for ps in page_sizes:
        x = rel.get(f"ours_paged{ps}")
        verdict["paged"][str(ps)] = {"time_over_ours": x, "pass": None if x is None else x <= PAGED_RATIO_TARGET}
    checks = [verdict["ours_pass"]] + [p["pass"] for p in verdict["paged"].values()]
    verdict["pass"] = all(c is True for c in checks)
    row["verdict"] = verdict
    return row


# ------------------------------------------------------------------------------------------------ reports


def f_us(ms):
    return "n/a" if ms is None else f"{ms * 1e3:.1f}"


def f_num(v, fmt):
    return "n/a" if v is None else fmt.format(v)


def verdict_cell(value, ok):
    return "n/a" if value is None else f"{value:.3f} {'PASS' if ok else 'FAIL'}"


def markdown(meta, rows, page_sizes):
    lines = [
        f"# {meta['title']}",
        "",
        f"{meta['gpu']} ({meta.get('sm_count', '?')} SMs), commit {meta['commit']}, {meta['date']}, "
        f"torch {meta['torch']} (CUDA {meta['cuda']}), cuDNN {meta['cudnn']}.",
        "",
        meta["method"],
        "",
        f"## Targets: ours contiguous >= {COPY_FRAC_TARGET:.2f} of the copy's bandwidth; paged time <= "
        f"{PAGED_RATIO_TARGET:.2f} x contiguous",
        "",
        "| shape | ours GB/s (K+V read) | copy GB/s (read + write) | ours / copy | "
        + " | ".join(f"paged {ps} / contiguous" for ps in page_sizes)
        + " | verdict |",
        "|---" * (5 + len(page_sizes)) + "|",
    ]
    for r in rows:
        v = r["verdict"]
        cells = [verdict_cell(v["ours_frac_copy"], v["ours_pass"])]
        for ps in page_sizes:
            p = v["paged"][str(ps)]
            cells.append(verdict_cell(p["time_over_ours"], p["pass"]))
        lines.append(
            f"| {r['shape']} | {f_num(r['gbps'].get('ours'), '{:.0f}')} | "
            f"{f_num(r['gbps'].get('copy'), '{:.0f}')} | "
            + " | ".join(cells)
            + f" | {'PASS' if v['pass'] else 'FAIL'} |"
        )
    n_pass = sum(1 for r in rows if r["verdict"]["pass"])
    lines += [
        "",
        f"Overall: {'PASS' if rows and n_pass == len(rows) else 'FAIL'} ({n_pass} of {len(rows)} shapes "
        "meet both targets; n/a counts as a miss).",
        "",
    ]
    for r in rows:
        esize = r["kv_bytes"] // (2 * r["batch"] * r["seqlen"] * r["nheads_k"] * r["hdim"])
        lines += [
            f"## {r['shape']}: {shape_title(r['shape'], esize)}",
            "",
            "| implementation | time us | GB/s | of copy | / ours | rounds us (min-max) |",
            "|---|---|---|---|---|---|",
        ]
        for name in r["impls"]:
            rounds = r["rounds_ms"].get(name) or []
            spread = f"{min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f}" if rounds else "n/a"
            lines.append(
                f"| {r['labels'][name]} | {f_us(r['ms'][name])} | {f_num(r['gbps'][name], '{:.0f}')} | "
                f"{f_num(r['frac_copy'][name], '{:.3f}')} | {f_num(r['time_over_ours'][name], '{:.3f}')} "
                f"| {spread} |"
            )
        extra = []
        if r["ms"].get("ours_append") and r["ms"].get("ours"):
            extra.append(
                f"append cost: {(r['ms']['ours_append'] - r['ms']['ours']) * 1e3:+.1f} us over the decode alone"
            )
        if r.get("copy_read_only_gbps"):
            extra.append(f"copy counted as N / t (read only): {r['copy_read_only_gbps']:.0f} GB/s")
        if extra:
            lines += ["", "; ".join(extra) + "."]
        lines.append("")
    errs = [f"- {r['shape']} {n}: {e}" for r in rows for n, e in r["errors"].items()]
    if errs:
        lines += ["## Failures (recorded as n/a)", ""] + errs + [""]
    warns = [f"- {r['shape']}: {w}" for r in rows for w in r["warnings"]]
    if warns:
        lines += ["## Warnings", ""] + warns + [""]
    return "\n".join(lines)


def plot(path, meta, rows):
    """Per shape, each implementation's K+V read rate as a fraction of the copy's read+write rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 4.6), squeeze=False)
    for ax, r in zip(axes[0], rows):
        names = [n for n in r["impls"] if n != "copy"]
        ys = [r["frac_copy"].get(n) or 0.0 for n in names]
        colors = ["tab:blue" if n.startswith("ours") else "tab:gray" for n in names]
        bars = ax.barh(range(len(names)), ys, color=colors)
        for bar, n in zip(bars, names):
            t = r["ms"].get(n)
            ax.text(
                bar.get_width() + 0.01,
                bar.get_y() + bar.get_height() / 2,
                "n/a" if t is None else f"{t * 1e3:.0f} us",
                va="center",
                fontsize=7,
            )
        ax.axvline(COPY_FRAC_TARGET, color="tab:red", linestyle="--", label=f"target {COPY_FRAC_TARGET:.2f}")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(names)), [r["labels"][n] for n in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max([1.2] + [y + 0.15 for y in ys]))
        ax.set_xlabel("K+V read rate / copy read+write rate")
        copy = r["gbps"].get("copy")
        ax.set_title(f"{r['shape']} (copy {'n/a' if copy is None else f'{copy:.0f}'} GB/s)", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{meta['title']}: {meta['gpu']}, commit {meta['commit']}, {meta['date']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(out_dir, meta, rows, page_sizes):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"decode_{meta['gpu_slug']}_{meta['dtype']}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(meta, rows, page_sizes)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    try:
        plot(base + ".png", meta, rows)
        print(f"[decode] wrote {base}.json, .md, .png")
    except Exception as exc:  # a missing matplotlib must not lose the numbers
        print(f"[decode] plot skipped: {type(exc).__name__}: {exc}")
        print(f"[decode] wrote {base}.json, .md")
    return text


# --------------------------------------------------------------------------------------------------- main


def progress_line(row):
    cells = [
        f"{n} n/a" if row["ms"][n] is None else f"{n} {f_us(row['ms'][n])} us ({row['frac_copy'][n] or 0:.2f})"
        for n in row["impls"]
    ]
    return (
        f"{row['shape']}: "
        + "  ".join(cells)
        + "".join(f"\n    {n}: {e}" for n, e in row["errors"].items())
        + "".join(f"\n    WARNING {w}" for w in row["warnings"])
    )


def load_ours():
    try:
        import flash_attn_cuda

        return flash_attn_cuda, None
    except Exception as exc:
        print(f"[decode] WARNING: cannot import flash_attn_cuda ({type(exc).__name__}: {exc}); ours will be n/a")
        return None, f"import failed: {type(exc).__name__}: {exc}"


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU (--dry-run and --help do not)")
    args.out_dir = common.out_dir(args.out_dir)
    dtype = DTYPES[args.dtype]
    esize = torch.finfo(dtype).bits // 8
    lib, lib_err = load_ours()
    meta = common.stamp()
    meta.update(
        title=f"Decoding against a KV cache ({args.dtype}, head dim {HDIM}, seqlen_q 1)",
        dtype=args.dtype,
        hdim=HDIM,
        nheads=NHEADS,
        rounds=args.rounds,
        rep=args.rep,
        warmup=args.warmup,
        page_sizes=args.page_sizes,
        shapes=args.shapes,
        cuda_graph=args.cuda_graph,
        oversize=OVERSIZE,
        targets={"ours_frac_copy_min": COPY_FRAC_TARGET, "paged_time_over_ours_max": PAGED_RATIO_TARGET},
    )
    meta["method"] = (
        "q is (b, 1, 32, 128); N = K+V bytes of the keys in use. GB/s: N / t for attention rows, 2N / t for the copy "
        "(dst.copy_(src) of N bytes reads N and writes N); 'of copy' is a row's GB/s over the copy's; '/ ours' is "
        "the row's time over ours contiguous. ours: flash_attn_with_kvcache with cache_seqlens an int32 device "
        "tensor (the whole cache used); paged P: the same keys in pages of P rows, block_table shuffled; cache "
        f"{OVERSIZE:g}x: capacity {OVERSIZE:g} x the keys used; append: k, v of one token written at row s - 1, "
        "then decoding. SDPA flash / cuDNN: torch SDPA's FLASH_ATTENTION / CUDNN_ATTENTION backends on the "
        "(b, h, s, d) transposed views of (b, s, h, d) tensors, as models call it (enable_gqa=True for GQA). An "
        f"untimed warm-up round over all rows, then each cell the median over {args.rounds} rounds in which the "
        f"rows take turns (round r starts with the r-th), each round the median of {args.rep} calls timed by CUDA "
        f"events after {args.warmup} warm-up calls"
        + (", each call a CUDA graph replay" if args.cuda_graph else "")
        + ". The caches exceed the 50 MB L2, so no flush is needed. n/a: failed or unsupported (see Failures)."
    )
    print(f"[decode] {meta['gpu']} commit {meta['commit']} torch {meta['torch']} cuDNN {meta['cudnn']}")
    rows = []
    for shape in args.shapes:
        try:
            row = bench_shape(lib, lib_err, shape, args, dtype, esize)
        except Exception as exc:  # e.g. out of memory making inputs: the shape is n/a, the run goes on
            row = new_row(shape, args, esize, err_text(exc))
        rows.append(finish_row(row, args.page_sizes))
        torch.cuda.empty_cache()
        print(progress_line(row), flush=True)
    print()
    print(write_reports(args.out_dir, meta, rows, args.page_sizes))
    if args.strict and not all(r["verdict"]["pass"] for r in rows):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
