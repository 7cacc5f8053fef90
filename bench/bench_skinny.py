"""Short and skinny shapes, ours against SDPA's FLASH_ATTENTION backend in one run: decoding-like seqlen_q of
1-128 against long KV, batch 1 with few heads, and the head dims off the anchor grid (32/96/160/192/224).
Forward and backward; writes JSON, markdown and a PNG to --out-dir.

    python bench/bench_skinny.py --dtype bf16
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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shapes():
    """(label, batch, seqlen_q, seqlen_k, nheads, nheads_k, hdim, causal)."""
    out = []
    # Short queries run non-causal: with seqlen_q < seqlen_k SDPA aligns its causal mask top-left and flash-attn
    # bottom-right, so causal timings would not compare the same work (for seqlen_q = 1 bottom-right causal is
    # the non-causal product anyway).
    for sq in (1, 16, 128):
        for sk in (4096, 16384):
            out.append(("short q", 8, sq, sk, 16, 16, 128, False))
            out.append(("short q, GQA 8:1", 8, sq, sk, 32, 4, 128, False))
    for h in (1, 4):
        for s in (1024, 8192):
            out.append(("batch 1, few heads", 1, s, s, h, h, 128, True))
    for d in (32, 96, 160, 192, 224):
        for causal in (False, True):
            out.append(("off-grid head dim", 4, 4096, 4096, 2048 // d, 2048 // d, d, causal))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="turns each implementation takes per shape (median)")
    p.add_argument("--out-dir", default=None, help="default bench/results/<gpu>/, e.g. bench/results/h200/")
    a = p.parse_args(argv)
    a.out_dir = common.out_dir(a.out_dir)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attn_cuda

    dtype = DTYPES[a.dtype]
    meta = common.stamp()
    meta.update(dtype=a.dtype, warmup=a.warmup, rep=max(a.rep, 20), rounds=a.rounds)
    print(f"[skinny] {meta['gpu']} commit {meta['commit']}")
    rows = []
    for label, b, sq, sk, h, hk, d, causal in shapes():
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        # SDPA takes (b, h, s, d): its own copy, as the transposed views of (b, s, h, d) tensors that models give it
        # (common.sdpa_view). It expands GQA heads itself only with enable_gqa.
        qt, kt, vt = (common.sdpa_view(t) for t in (q, k, v))
        runners = {
            "ours": (lambda: flash_attn_cuda.flash_attn_func(q, k, v, causal=causal), (q, k, v), torch.randn_like),
            "flash": (
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk),
                (qt, kt, vt),
                common.sdpa_grad,
            ),
        }
        flops = common.attn_flops(b, h, sq, sk, d, causal)
        row = {
            "label": label,
            "batch": b,
            "seqlen_q": sq,
            "seqlen_k": sk,
            "nheads": h,
            "nheads_k": hk,
            "hdim": d,
            "causal": causal,
            "tflops": {},
            "errors": {},
        }
        # Decoding-sized calls are host-bound, and the host's speed drifts over a run: the
        # implementations take turns, --rounds times, and each cell is the median over its rounds.
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            warnings.simplefilter("ignore")
            times = common.time_fwd_bwd_in_turns(runners, row["errors"], a.warmup, a.rep, a.rounds)
        row["rounds_ms"] = times
        for name in runners:
            ms = times.get(name, {})
            row["tflops"][name] = {
                pass_: mult * flops / (statistics.median(ms[pass_]) * 1e-3) / 1e12 if ms.get(pass_) else None
                for pass_, mult in (("fwd", 1.0), ("bwd", 2.5))
            }
        rows.append(row)
        t = row["tflops"]
        print(
            f"{label:26s} b={b} sq={sq:5d} sk={sk:5d} h={h:2d}/{hk:2d} d={d:3d} causal={int(causal)}: "
            + "  ".join(f"{n} fwd {common.fmt_num(t[n]['fwd'])} bwd {common.fmt_num(t[n]['bwd'])}" for n in t)
            + "".join(f"\n    {n}: {e}" for n, e in row["errors"].items()),
            flush=True,
        )

    os.makedirs(a.out_dir, exist_ok=True)
    base = os.path.join(a.out_dir, f"skinny_{meta['gpu_slug']}_{a.dtype}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Short and skinny shapes, {a.dtype}",
        "",
        f"{meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}. TFLOP/s by the FA2 "
        "convention (4*b*h*sq*sk*d, halved when causal; bwd 2.5x). flash: SDPA FLASH_ATTENTION, on the "
        "(b, h, s, d) transposed views of (b, s, h, d) tensors (dout too); ours on (b, s, h, d). After an "
        f"untimed warm-up round, each cell: the median over {a.rounds} rounds in which the implementations "
        f"take turns (round r starts with the r-th), each round the median of {max(a.rep, 20)} timed calls "
        f"after {a.warmup} warm-up calls.",
        "",
        "| shape | b | sq | sk | heads | hdim | causal | fwd ours | fwd flash | fwd ratio | bwd ours | bwd flash "
        "| bwd ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["tflops"]
        cells = []
        for pass_ in ("fwd", "bwd"):
            ours, flash = t["ours"][pass_], t["flash"][pass_]
            cells += [
                common.fmt_num(ours),
                common.fmt_num(flash),
                common.fmt_num(ours / flash if ours and flash else None, "{:.2f}"),
            ]
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['seqlen_q']} | {r['seqlen_k']} | "
            f"{r['nheads']}/{r['nheads_k']} | {r['hdim']} | {r['causal']} | " + " | ".join(cells) + " |"
        )
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot(base + ".png", meta, rows)
    except Exception as exc:  # a missing matplotlib must not lose the numbers (written above)
        print(f"[skinny] plot skipped: {type(exc).__name__}: {exc}")
    print("\n".join(lines))


def plot(path, meta, rows):
    """ours / flash per shape, forward and backward, with the 1.0 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 4))
    for offset, pass_ in ((-0.2, "fwd"), (0.2, "bwd")):
        ys = []
        for r in rows:
            ours, flash = r["tflops"]["ours"][pass_], r["tflops"]["flash"][pass_]
            ys.append(ours / flash if ours and flash else 0.0)
        ax.bar([i + offset for i in range(len(rows))], ys, 0.4, label=pass_)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks(
        range(len(rows)),
        [f"{r['seqlen_q']}x{r['seqlen_k']} h{r['nheads']} d{r['hdim']}{' c' if r['causal'] else ''}" for r in rows],
        rotation=70,
        fontsize=7,
    )
    ax.set_ylabel("ours / SDPA flash")
    ax.legend()
    ax.set_title(
        f"short and skinny shapes, {meta['dtype']}: {meta['gpu']}, commit {meta['commit']}, {meta['date']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
