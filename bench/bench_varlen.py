"""Variable-length batch benchmark: flash_attn_varlen_func on a packed batch of mixed lengths against SDPA's
FLASH_ATTENTION backend (and our dense kernel) on the same batch padded to its longest sequence, in one run.
TFLOP/s count useful work only: sum over sequences of the FA2 FLOPs of that sequence.

    python bench/bench_varlen.py                      # bf16, hdim 128, 16 heads, causal and not
    python bench/bench_varlen.py --impls ours_varlen,ours_varlen_ws,flash_padded   # also the forced Hopper kernel
    python bench/bench_varlen.py --plot bench/results/h200/varlen_nvidia-h200.json     # redraw a run's PNG
"""

import argparse
import json
import os
import random
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))
import common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="turns each implementation takes per mask (median)")
    p.add_argument(
        "--impls",
        type=lambda s: s.split(","),
        default=list(IMPLS),
        help=f"from {','.join(IMPLS + OPTIONAL_IMPLS)}; ours_varlen_ws: the packed batch with the Hopper "
        "warp-specialized kernels wherever they can run (force_plan(ws=True)), forward and backward",
    )
    p.add_argument("--out-dir", default=None, help="default bench/results/<gpu>/, e.g. bench/results/h200/")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    a.out_dir = common.out_dir(a.out_dir)
    unknown = sorted(set(a.impls) - set(IMPLS + OPTIONAL_IMPLS))
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attn_cuda
    from flash_attn_cuda.plan import force_plan

    rng = random.Random(a.seed)
    lens = [rng.randint(a.min_len, a.max_len) for _ in range(a.batch)]
    total, max_len, h, d = sum(lens), max(lens), a.heads, a.hdim
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    meta = common.stamp()
    meta.update(
        lengths=lens, heads=h, hdim=d, dtype="bf16", warmup=a.warmup, rep=max(a.rep, 20), rounds=a.rounds, impls=a.impls
    )
    print(f"[varlen] {meta['gpu']} commit {meta['commit']}: {a.batch} sequences, {total} tokens, longest {max_len}")

    rows = []
    for causal in (False, True):
        useful = sum(common.attn_flops(1, h, n, n, d, causal) for n in lens)
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        # The padded batch: every sequence in a (batch, max_len) slot.
        padded = [
            torch.randn(a.batch, max_len, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        ]
        # SDPA's own copy of the padded batch, as the transposed views of (b, s, h, d) tensors that models give it
        # (common.sdpa_view); its dout likewise, in its output's layout.
        padded_t = [common.sdpa_view(t) for t in padded]

        def varlen(**choices):
            # The choices reach the ops as arguments, so the backward runs under them too.
            with force_plan(**choices):
                return flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)

        runners = {
            "ours_varlen": (varlen, (q, k, v), torch.randn_like),
            "ours_varlen_ws": (lambda: varlen(ws=True), (q, k, v), torch.randn_like),
            "ours_padded": (lambda: flash_attn_cuda.flash_attn_func(*padded, causal=causal), padded, torch.randn_like),
            "flash_padded": (
                lambda: F.scaled_dot_product_attention(*padded_t, is_causal=causal),
                padded_t,
                common.sdpa_grad,
            ),
        }
        runners = {name: runners[name] for name in a.impls}
        row = {"causal": causal, "useful_flops_fwd": useful, "ms": {}, "tflops": {}, "errors": {}}
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            warnings.simplefilter("ignore")
            times = common.time_fwd_bwd_in_turns(runners, row["errors"], a.warmup, a.rep, a.rounds)
        row["rounds_ms"] = times
        for name in runners:
            ms = {pass_: statistics.median(t) if t else None for pass_, t in times.get(name, {}).items()}
            row["ms"][name] = {"fwd": ms.get("fwd"), "bwd": ms.get("bwd")}
            row["tflops"][name] = {
                pass_: mult * useful / (row["ms"][name][pass_] * 1e-3) / 1e12 if row["ms"][name][pass_] else None
                for pass_, mult in (("fwd", 1.0), ("bwd", 2.5))
            }
        rows.append(row)
        t = row["tflops"]
        print(
            f"causal={causal}: "
            + "  ".join(f"{n} fwd {common.fmt_num(t[n]['fwd'])} bwd {common.fmt_num(t[n]['bwd'])}" for n in t)
            + "".join(f"\n    {n}: {e}" for n, e in row["errors"].items()),
            flush=True,
        )

    os.makedirs(a.out_dir, exist_ok=True)
    base = os.path.join(a.out_dir, f"varlen_{meta['gpu_slug']}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# Variable-length batch, bf16",
        "",
        f"{meta['gpu']} ({meta.get('sm_count')} SMs), commit {meta['commit']}, {meta['date']}, torch {meta['torch']}.",
        "",
        f"{a.batch} sequences, lengths {lens} ({total} tokens, longest {max_len}), {h} heads, head dim {d}. "
        "TFLOP/s of useful work: the FA2 FLOPs of each sequence summed (fwd 4*h*s^2*d, halved when causal; bwd 2.5x), "
        "divided by the measured time. ours_varlen runs the packed batch; ours_padded and flash_padded (SDPA "
        "FLASH_ATTENTION) run the batch padded to the longest sequence, so their time includes the padding. "
        "flash_padded gets the (b, h, s, d) transposed views of (b, s, h, d) tensors (dout too), ours (b, s, h, d). "
        f"After an untimed warm-up round, each cell: the median over {a.rounds} rounds in which the implementations "
        f"take turns (round r starts with the r-th), each round the median of {max(a.rep, 20)} timed calls after "
        f"{a.warmup} warm-up calls.",
        "",
        f"| mask | pass | {' | '.join(a.impls)} | ours_varlen / flash_padded |",
        "|---|---|" + "---|" * (len(a.impls) + 1),
    ]
    for row in rows:
        t = row["tflops"]
        for pass_ in ("fwd", "bwd"):
            ours, flash = (t.get(n, {}).get(pass_) for n in ("ours_varlen", "flash_padded"))
            ratio = ours / flash if ours and flash else None
            lines.append(
                f"| {'causal' if row['causal'] else 'non-causal'} | {pass_} | "
                + " | ".join(common.fmt_num(t[n][pass_]) for n in a.impls)
                + f" | {common.fmt_num(ratio, '{:.2f}')} |"
            )
    errs = [f"- {'causal' if r['causal'] else 'non-causal'} {n}: {e}" for r in rows for n, e in r["errors"].items()]
    if errs:
        lines += ["", "## Failures (recorded as n/a)", "", *errs]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[next(i for i, x in enumerate(lines) if x.startswith("| mask")) :]))  # table, failures
    try:
        plot(base + ".png", meta, rows)
        print(f"[varlen] wrote {base}.json, .md, .png")
    except Exception as exc:  # a missing matplotlib must not lose the numbers (written above)
        print(f"[varlen] plot skipped: {type(exc).__name__}: {exc}")
        print(f"[varlen] wrote {base}.json, .md")


IMPLS = ("ours_varlen", "ours_padded", "flash_padded")
OPTIONAL_IMPLS = ("ours_varlen_ws",)


def plot(path, meta, rows):
    """Grouped bars: useful TFLOP/s per (mask, pass), one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(row, pass_) for row in rows for pass_ in ("fwd", "bwd")]
    impls = meta.get("impls", IMPLS)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        ys = [row["tflops"][name][pass_] or 0.0 for row, pass_ in groups]
        ax.bar([g + (i - (len(impls) - 1) / 2) * width for g in range(len(groups))], ys, width, label=name)
    ax.set_xticks(
        range(len(groups)), [f"{'causal' if row['causal'] else 'non-causal'} {pass_}" for row, pass_ in groups]
    )
    ax.set_ylabel("useful TFLOP/s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(
        f"varlen batch ({len(meta['lengths'])} sequences, hdim {meta['hdim']}): {meta['gpu']}, "
        f"commit {meta['commit']}, {meta['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # redraw the PNG of an existing JSON
        with open(sys.argv[2]) as f:
            saved = json.load(f)
        plot(sys.argv[2].removesuffix(".json") + ".png", saved["meta"], saved["rows"])
    else:
        main()
