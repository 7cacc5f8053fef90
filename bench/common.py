"""Shared helpers for the attention benchmarks: timing, FLOP counting, run stamps and reports.

Row format (one dict per shape), shared by the forward and backward benchmarks:
    {"pass": "fwd", "dtype": "bf16", "hdim": 128, "causal": False, "batch": 4, "seqlen": 4096, "nheads": 16,
     "flops": ..., "ms": {impl: float | None}, "tflops": {impl: float | None}, "errors": {impl: str},
     "ratios": {"ours/flash": float | None, ...}, "frac_mma": {impl: float | None}}
A value of None means the implementation failed or does not support the shape.
"""

import datetime
import json
import math
import os
import re
import statistics
import subprocess

import torch

REF = "ours"


# ----------------------------------------------------------------------------------------------- FLOPs


def attn_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd", head_dim_v=None):
    """FLOPs by the FlashAttention-2 paper's convention: forward 4*b*h*sq*sk*d (two matmuls), halved when
    causal; backward 2.5x forward; fwd_bwd 3.5x forward. With V's own head dim (head_dim_v), 2*b*h*sq*sk*(d + d_v)
    for the forward."""
    d_v = head_dim if head_dim_v is None else head_dim_v
    f = 2.0 * batch * nheads * seqlen_q * seqlen_k * (head_dim + d_v)
    if causal:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


# ---------------------------------------------------------------------------------------------- timing


def time_ms(fn, warmup=5, rep=30):
    """Median wall time of fn() on the GPU in milliseconds: `warmup` untimed calls, then `rep` (>= 20) calls
    each bracketed by its own pair of CUDA events."""
    rep = max(rep, 20)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def try_time(fn, warmup, rep):
    """(ms, None) on success, (None, message) if fn raises (unsupported shape, no kernel, out of memory ...)."""
    try:
        return time_ms(fn, warmup, rep), None
    except Exception as exc:  # a competitor failing must never stop the run
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        return None, msg[:300]


# ------------------------------------------------------------------------------------------ SDPA layout


def time_fwd_bwd_in_turns(runners, errors, warmup, rep, rounds):
    """Times the forward and the backward of each runner, the runners taking turns: an untimed warm-up round
    (each one full turn, its times dropped), then `rounds` rounds, round r starting with the r-th runner so that
    none always follows the same one. runners: name -> (forward fn, its differentiable inputs, a function making
    the output's gradient from the output). A runner whose first call fails, or a pass that fails later, is
    recorded in errors[name] and not timed again. Returns {name: {"fwd": [ms per round], "bwd": [...]}}."""
    passes, times = {}, {}
    for name, (fn, inputs, grad_like) in runners.items():
        try:
            out = fn()
            dout = grad_like(out)  # in out's layout
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            continue
        passes[name] = {
            "fwd": fn,
            "bwd": lambda out=out, inputs=inputs, dout=dout: torch.autograd.grad(out, inputs, dout, retain_graph=True),
        }
        times[name] = {"fwd": [], "bwd": []}
    names = list(passes)
    for r in range(-1, rounds if names else -1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fns = passes[name]
            for pass_, f in list(fns.items()):
                ms, err = try_time(f, warmup, rep)
                if err:  # no further rounds for a pass that failed
                    errors[name] = f"{pass_}: {err}"
                    del fns[pass_]
                elif r >= 0:
                    times[name][pass_].append(ms)
    return times


def sdpa_view(x, requires_grad=None):
    """SDPA's own copy of a (b, s, h, d) tensor x, handed over as the (b, h, s, d) transposed view of a
    (b, s, h, d) tensor: the layout models give SDPA (q_proj(x).view(b, s, h, d).transpose(1, 2)) and the one
    FlashAttention-2 reads without copies. Contiguous (b, h, s, d) inputs would make SDPA flash's backward copy
    and overstate our lead. A leaf that requires grad as x does (or as requires_grad says)."""
    t = x.detach().clone(memory_format=torch.contiguous_format).transpose(1, 2)
    return t.requires_grad_(x.requires_grad if requires_grad is None else requires_grad)


def sdpa_grad(out):
    """A random output gradient for SDPA's (b, h, s, d) output in the same layout: the transposed view of a
    (b, s, h, d) tensor, as the gradient that comes back through a model's output projection."""
    return torch.randn_like(out.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)


# ----------------------------------------------------------------------------------------------- stamp


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def gpu_dir(gpu=None):
    """The folder of a GPU's results under bench/results/: its name's slug without the vendor ("h200")."""
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-gpu"
    return re.sub(r"^nvidia-", "", slug(gpu))


def out_dir(given=None):
    """--out-dir when given, else bench/results/<gpu>/ for this GPU."""
    return given or os.path.join(RESULTS, gpu_dir())


def git_commit():
    env = os.environ.get("FLASH_ATTN2_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except Exception:
        pass
    return "unknown"


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _cudnn_version():
    try:
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        v = None
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v and v >= 90000 else (str(v) if v else None)


def stamp():
    """Where and when a result was measured."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-gpu"
    info = {
        "gpu": gpu,
        "gpu_slug": slug(gpu),
        "commit": git_commit(),
        "date": utc_now(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    return info


def load_mma_peak(path, gpu):
    """The mma.sync ceiling written by mma_peak.py, or None if absent or measured on another GPU."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        peak = json.load(f)
    if peak.get("gpu") != gpu or not peak.get("tflops"):
        print(f"[bench] ignoring {path}: measured on {peak.get('gpu')!r}, this is {gpu!r}")
        return None
    return peak


# ------------------------------------------------------------------------------------------ row maths


def finish_row(row, impls, peak_tflops=None, ref=REF):
    """Fill tflops, ratios (ref/other, by TFLOP/s, i.e. other_time/ref_time) and fractions of the mma ceiling."""
    row["tflops"] = {k: (row["flops"] / (row["ms"][k] * 1e-3) / 1e12 if row["ms"].get(k) else None) for k in impls}
    t = row["tflops"]
    row["ratios"] = {f"{ref}/{k}": (t[ref] / t[k] if t.get(ref) and t.get(k) else None) for k in impls if k != ref}
    row["frac_mma"] = {k: (v / peak_tflops if v and peak_tflops else None) for k, v in t.items()}
    return row


def geomean(values):
    vals = [v for v in values if v]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


# --------------------------------------------------------------------------------------------- reports


def fmt_num(v, fmt="{:.0f}"):
    return "n/a" if v is None else fmt.format(v)


def _cell(row, k, peak):
    v = row["tflops"].get(k)
    if v is None:
        return "n/a"
    return f"{v:.0f} ({v / peak:.0%})" if peak else f"{v:.0f}"


def _groups(rows):
    """Rows grouped by (pass, hdim, causal), each sorted by seqlen, groups in a stable order."""
    out = {}
    for r in sorted(rows, key=lambda r: (r["hdim"], r["causal"], r["seqlen"])):
        out.setdefault((r["pass"], r["hdim"], r["causal"]), []).append(r)
    return out


def markdown_report(meta, rows, impls, peak=None, ref=REF, summary_seqlens=(2048, 8192, 16384), baseline="flash"):
    peak_t = peak["tflops"] if peak else None
    others = [k for k in impls if k != ref]
    lines = [
        f"# {meta['title']}",
        "",
        f"{meta['gpu']} ({meta.get('sm_count', '?')} SMs), commit {meta['commit']}, {meta['date']}, "
        f"torch {meta['torch']} (CUDA {meta['cuda']}), cuDNN {meta['cudnn']}.",
        "",
        meta.get("method", ""),
        "",
    ]
    if peak_t:
        lines += [
            f"Percentages: fraction of the measured mma.sync m16n8k16 bf16->fp32 ceiling, "
            f"{peak_t:.0f} TFLOP/s (mma_peak.py, {peak.get('date')}, commit {peak.get('commit')}).",
            "",
        ]
    lines += summary_markdown(rows, ref, baseline, summary_seqlens), ""
    for (pas, hdim, causal), grp in _groups(rows).items():
        lines += [
            f"## {pas}, hdim {hdim}, {'causal' if causal else 'non-causal'}",
            "",
            "| seqlen | batch x heads | " + " | ".join(impls) + " | " + " | ".join(f"{ref}/{k}" for k in others) + " |",
            "|---" * (2 + len(impls) + len(others)) + "|",
        ]
        for r in grp:
            lines.append(
                f"| {r['seqlen']} | {r['batch']} x {r['nheads']} | "
                + " | ".join(_cell(r, k, peak_t) for k in impls)
                + " | "
                + " | ".join(fmt_num(r["ratios"].get(f"{ref}/{k}"), "{:.2f}") for k in others)
                + " |"
            )
        lines.append("")
    errs = {}
    for r in rows:
        for k, e in r.get("errors", {}).items():
            errs.setdefault((k, e), []).append(f"{r['pass']} h{r['hdim']}{'c' if r['causal'] else ''} s{r['seqlen']}")
    if errs:
        lines += ["## Failures (recorded as n/a; shapes as h<hdim>[c=causal] s<seqlen>)", ""]
        lines += [f"- {k} ({', '.join(shapes)}): {e}" for (k, e), shapes in sorted(errs.items())] + [""]
    warns = [
        f"- {r['pass']} hdim {r['hdim']} causal={r['causal']} seqlen {r['seqlen']}: {w}"
        for r in rows
        for w in r.get("warnings", [])
    ]
    if warns:
        lines += ["## Warnings", ""] + warns + [""]
    return "\n".join(lines)


def summary_markdown(rows, ref=REF, other="flash", seqlens=(2048, 8192, 16384)):
    """Compact table: ref vs other TFLOP/s and their ratio at a few sequence lengths, plus geometric means."""
    key = f"{ref}/{other}"
    idx = {(r["pass"], r["hdim"], r["causal"], r["seqlen"]): r for r in rows}
    measured = {r["seqlen"] for r in rows}
    seqlens = [s for s in seqlens if s in measured] or sorted(measured)
    groups = list(_groups(rows))
    lines = [
        f"## Summary: {ref} vs {other} (TFLOP/s, ratio {key})",
        "",
        "| pass | hdim | mask | " + " | ".join(f"seqlen {s}" for s in seqlens) + " |",
        "|---" * (3 + len(seqlens)) + "|",
    ]
    picked = []
    for pas, hdim, causal in groups:
        cells = []
        for s in seqlens:
            r = idx.get((pas, hdim, causal, s))
            if r is None:
                cells.append("-")
                continue
            ratio = r["ratios"].get(key)
            picked.append(ratio)
            t = r["tflops"]
            cells.append(f"{fmt_num(t.get(ref))} vs {fmt_num(t.get(other))} = {fmt_num(ratio, '{:.2f}')}")
        lines.append(f"| {pas} | {hdim} | {'causal' if causal else 'non-causal'} | " + " | ".join(cells) + " |")
    every = [r["ratios"].get(key) for r in rows]
    g_pick, g_all = geomean(picked), geomean(every)
    n_pick, n_all = sum(1 for v in picked if v), sum(1 for v in every if v)
    lines += [
        "",
        f"Geometric mean of {key}: {fmt_num(g_pick, '{:.3f}')} over the {n_pick} cells above, "
        f"{fmt_num(g_all, '{:.3f}')} over all {n_all} measured shapes.",
    ]
    lines += ratio_lines(rows, ref)
    return "\n".join(lines)


# The implementations a Hopper user would otherwise pick: where a run has more than one, each cell is also held
# against the faster of them in that cell.
LEADERS = ("cudnn", "fa4")


def ratio_lines(rows, ref=REF, leaders=LEADERS, floor=0.90):
    """Geometric mean, lowest and highest of ref's speed over every other implementation of the rows, and over
    the faster of `leaders` in each cell where more than one of them ran, with the cells below `floor`."""
    impls = sorted({k for r in rows for k, v in r["tflops"].items() if v and k != ref})
    parts = []
    for k in impls:
        vals = [r["tflops"][ref] / r["tflops"][k] for r in rows if r["tflops"].get(ref) and r["tflops"].get(k)]
        if vals:
            parts.append(f"{k} {geomean(vals):.3f} ({min(vals):.3f}-{max(vals):.3f}, {len(vals)} cells)")
    lines = (
        ["", f"Speed of {ref} over each, geometric mean (lowest-highest): " + "; ".join(parts) + "."] if parts else []
    )
    ran = [k for k in leaders if any(r["tflops"].get(k) for r in rows)]
    if len(ran) > 1:
        vals = []
        for r in rows:
            theirs = [r["tflops"][k] for k in ran if r["tflops"].get(k)]
            if r["tflops"].get(ref) and len(theirs) == len(ran):
                vals.append(r["tflops"][ref] / max(theirs))
        if vals:
            below = sum(1 for v in vals if v < floor)
            lines += [
                "",
                f"{ref} over the faster of {' and '.join(ran)} in each cell: {geomean(vals):.3f} "
                f"({min(vals):.3f}-{max(vals):.3f}) over {len(vals)} cells, {below} below {floor:.2f}.",
            ]
    return lines


def plot_report(path, meta, rows, impls, peak=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    hdims = sorted({h for _, h, _ in groups})
    masks = sorted({c for _, _, c in groups})
    fig, axes = plt.subplots(len(hdims), len(masks), figsize=(6 * len(masks), 3.8 * len(hdims)), squeeze=False)
    for (pas, hdim, causal), grp in groups.items():
        ax = axes[hdims.index(hdim)][masks.index(causal)]
        xs = [r["seqlen"] for r in grp]
        for k in impls:
            ys = [r["tflops"].get(k) for r in grp]
            ys = [float("nan") if y is None else y for y in ys]
            ax.plot(xs, ys, marker="o", linewidth=2.5 if k == REF else 1.5, label=k)
        if peak:
            ax.axhline(peak["tflops"], linestyle="--", color="gray", label=f"mma.sync peak {peak['tflops']:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{pas} hdim {hdim}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen (batch x seqlen fixed)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 0.97), fontsize=9)
    fig.suptitle(f"{meta['title']}: {meta['gpu']}, commit {meta['commit']}, {meta['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(out_dir, name, meta, rows, impls, peak=None, ref=REF, baseline="flash"):
    """Write <name>.json, <name>.md and <name>.png under out_dir; return the markdown summary."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "mma_peak": peak, "impls": impls, "rows": rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown_report(meta, rows, impls, peak, ref=ref, baseline=baseline))
    try:
        plot_report(base + ".png", meta, rows, impls, peak)
    except Exception as exc:  # a missing matplotlib must not lose the numbers
        print(f"[bench] plot skipped: {type(exc).__name__}: {exc}")
    print(f"[bench] wrote {base}.json, .md, .png")
    return summary_markdown(rows, ref, baseline)
