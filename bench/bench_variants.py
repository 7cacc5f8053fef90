"""Attention variants: what a sliding window saves, what softcap, ALiBi, dropout and a learnable sink cost, in one
run. bf16 (--dtype fp16), head dim 128, 16 heads (the sink section: its own head dims), batch x seqlen = 16384 tokens;
forward and backward (the backward alone: torch.autograd.grad of a kept output, as bench_fwd.py --pass bwd). Four
sections:

  window         ours with window_size=(1024, 0), causal (Mistral style), and (512, 512), non-causal, against
                 the full mask of the same kind: ours, SDPA FLASH_ATTENTION and CUDNN_ATTENTION (SDPA has no
                 window); the window's time as a fraction of each, and the ideal fraction (visible pairs of the
                 window mask over those of the full mask). seqlen 4096, 8192, 16384 (--quick: 16384).
  softcap_alibi  softcap 30.0, ALiBi slopes (nheads,) fp32, and both, against our plain kernel: the overhead.
                 seqlen 2048 and 8192 (--quick: 8192), causal and not. --sdpa-alibi adds SDPA's
                 EFFICIENT_ATTENTION with ALiBi as an explicit additive bias (1, h, s, s), and without one.
  dropout        dropout_p 0.1: ours and SDPA FLASH_ATTENTION, each against itself without dropout, and ours
                 against SDPA with dropout. seqlen 2048 and 8192 (--quick: 8192), causal and not.
  sink           learnable_sink, fp32 (nheads,) logits that require grad, against the same call without one: the
                 overhead. Hidden size 2048: head dim 64 (32 heads) and 128 (16 heads), causal and not; and head
                 dim 64 with gpt-oss's sliding window, window_size=(128, 0), causal, both calls windowed. The
                 anchor grid's seqlens, 512 to 16384 (--quick: 8192).

    python bench/bench_variants.py                       # all four sections -> variants_<gpu-slug>.{json,md,png}
    python bench/bench_variants.py --quick --rounds 3    # fewer shapes
    python bench/bench_variants.py --dry-run             # the shape list and a rough time estimate, no GPU
    python bench/bench_variants.py --family mma_sync     # ours on the mma.sync kernels (on Hopper: forced)
    python bench/bench_variants.py --sections sink       # the learnable sink's overhead alone
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
TOKENS, NHEADS, HDIM = 16384, 16, 128
SOFTCAP, DROPOUT_P = 30.0, 0.1
WINDOWS = (((1024, 0), True), ((512, 512), False))  # (window_size, causal)
# The sink section's shapes: the anchor grid's head dims at one hidden size (nheads = SINK_HIDDEN // hdim), and
# gpt-oss's sliding window, (128, 0) with causal, at head dim 64, over the anchor grid's seqlens.
SINK_HIDDEN, SINK_HDIMS, SINK_WINDOW = 2048, (64, 128), (128, 0)
SINK_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SINK_SEED = 0  # the sink's logits: the same for every group of a head count, and from run to run
# Appended sections go last: bench_group seeds each group's data with its section's index.
SECTIONS = ("window", "softcap_alibi", "dropout", "sink")
PASSES = ("fwd", "bwd")
SANITY_REL_TOL = 0.05  # a loose "is it the same function" check against SDPA, not the correctness rule


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sections",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument("--quick", action="store_true", help="fewer shapes (window: 16384; others: 8192) and repetitions")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--family",
        choices=["auto", "mma_sync"],
        default="auto",
        help="ours' kernels: the plan's (auto) or the mma.sync ones, forced where the GPU has the Hopper ones",
    )
    p.add_argument("--rounds", type=int, default=3, help="turns each implementation takes per shape (median)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per measurement (default 5, --quick 3)")
    p.add_argument("--rep", type=int, default=None, help="timed calls per measurement, >= 20 (default 30, --quick 20)")
    p.add_argument(
        "--sdpa-alibi",
        action="store_true",
        help="softcap_alibi: also SDPA EFFICIENT_ATTENTION with and without an explicit ALiBi bias",
    )
    p.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=None,
        help="default bench/results/<gpu>/, e.g. bench/results/h200/",
    )
    p.add_argument("--dry-run", action="store_true", help="print the shapes and a rough time estimate; no CUDA")
    a = p.parse_args(argv)
    unknown = set(a.sections) - set(SECTIONS)
    if unknown or not a.sections:
        p.error(f"--sections must be drawn from {','.join(SECTIONS)}")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    a.warmup = a.warmup if a.warmup is not None else (3 if a.quick else 5)
    a.rep = max(a.rep if a.rep is not None else (20 if a.quick else 30), 20)
    return a


# ------------------------------------------------------------------------------------------------- shapes


def visible_pairs(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """(query, key) pairs the mask lets through, counted exactly by the spec's rule: query row i sits at
    p = i + seqlen_k - seqlen_q and sees key j iff (left < 0 or j >= p - left) and (right < 0 or j <= p + right);
    causal forces right = 0."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen_q):
        p = i + seqlen_k - seqlen_q
        lo = 0 if left < 0 else max(0, p - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, p + right)
        total += max(0, hi - lo + 1)
    return total


def impl_specs(group, sdpa_alibi=False):
    """name -> (backend, kwargs): backend "ours" calls flash_attn_func(q, k, v, **kwargs) on (b, s, h, d) tensors,
    "flash" / "cudnn" / "efficient" call SDPA under that backend on (b, h, s, d) transposed views of (b, s, h, d)
    tensors. The kwargs values
    "@alibi_slopes", "@alibi_bias" and "@sink" stand for tensors made with the inputs."""
    c, sec = group["causal"], group["section"]
    if sec == "window":
        return {
            "ours_window": ("ours", {"causal": c, "window_size": tuple(group["window"])}),
            "ours_full": ("ours", {"causal": c}),
            "flash_full": ("flash", {"is_causal": c}),
            "cudnn_full": ("cudnn", {"is_causal": c}),
        }
    if sec == "softcap_alibi":
        specs = {
            "ours": ("ours", {"causal": c}),
            "ours_softcap": ("ours", {"causal": c, "softcap": SOFTCAP}),
            "ours_alibi": ("ours", {"causal": c, "alibi_slopes": "@alibi_slopes"}),
            "ours_softcap_alibi": ("ours", {"causal": c, "softcap": SOFTCAP, "alibi_slopes": "@alibi_slopes"}),
        }
        if sdpa_alibi:
            # SDPA takes a float mask or is_causal, not both: the causal mask goes into the bias as -inf.
            specs["efficient"] = ("efficient", {"is_causal": c})
            specs["efficient_alibi"] = ("efficient", {"attn_mask": "@alibi_bias"})
        return specs
    if sec == "sink":
        # A windowed group's two calls both carry the window, so that the sink is the only difference.
        plain = {"causal": c, **({"window_size": tuple(group["window"])} if group.get("window") else {})}
        return {"ours": ("ours", plain), "ours_sink": ("ours", {**plain, "learnable_sink": "@sink"})}
    return {
        "ours": ("ours", {"causal": c}),
        "ours_dropout": ("ours", {"causal": c, "dropout_p": DROPOUT_P}),
        "flash": ("flash", {"is_causal": c}),
        "flash_dropout": ("flash", {"is_causal": c, "dropout_p": DROPOUT_P}),
    }


def build_groups(args):
    """One group per (section, shape, mask); each group's implementations take turns."""
    groups = []

    def add(section, seqlen, causal, hdim=HDIM, nheads=NHEADS, **extra):
        g = {
            "section": section,
            "seqlen": seqlen,
            "batch": max(1, TOKENS // seqlen),
            "nheads": nheads,
            "hdim": hdim,
            "causal": causal,
            **extra,
        }
        g["impls"] = list(impl_specs(g, args.sdpa_alibi))
        groups.append(g)

    if "window" in args.sections:
        for seqlen in [16384] if args.quick else [4096, 8192, 16384]:
            for window, causal in WINDOWS:
                add("window", seqlen, causal, window=list(window))
    for section in ("softcap_alibi", "dropout"):
        if section in args.sections:
            for seqlen in [8192] if args.quick else [2048, 8192]:
                for causal in (False, True):
                    add(section, seqlen, causal)
    if "sink" in args.sections:
        seqlens = [8192] if args.quick else list(SINK_SEQLENS)
        for hdim in SINK_HDIMS:
            for seqlen in seqlens:
                for causal in (False, True):
                    add("sink", seqlen, causal, hdim=hdim, nheads=SINK_HIDDEN // hdim)
        for seqlen in seqlens:
            add("sink", seqlen, True, hdim=64, nheads=SINK_HIDDEN // 64, window=list(SINK_WINDOW))
    return groups


def windowed(group, name):
    """Whether name's call in the group has a sliding window: the window section's windowed call, and both calls of
    a windowed sink group."""
    return name == "ours_window" or (group["section"] == "sink" and bool(group.get("window")))


def impl_flops(group, name, pass_):
    """FLOPs of one call: the FA2 convention (4*b*h*s^2*d, halved when causal, x2.5 backward) for a full mask;
    for a windowed call, the useful work, 4*b*h*d*(visible pairs), x2.5 backward."""
    b, h, s, d = group["batch"], group["nheads"], group["seqlen"], group["hdim"]
    if windowed(group, name):
        return 4.0 * b * h * d * group["visible"]["window"] * (2.5 if pass_ == "bwd" else 1.0)
    return common.attn_flops(b, h, s, s, d, group["causal"], pass_)


def group_label(g):
    mask = "causal" if g["causal"] else "non-causal"
    win = f" window {tuple(g['window'])}" if g.get("window") else ""
    return f"{g['section']:13s} s={g['seqlen']:5d} b={g['batch']:2d} h={g['nheads']} d={g['hdim']} {mask}{win}"


def add_visible(groups):
    for g in groups:
        if g["section"] == "window":
            s = g["seqlen"]
            g["visible"] = {
                "window": visible_pairs(s, s, g["causal"], tuple(g["window"])),
                "full": visible_pairs(s, s, g["causal"]),
                "full_causal": visible_pairs(s, s, True),
            }
            g["ideal_fraction"] = g["visible"]["window"] / g["visible"]["full"]
        elif g["section"] == "sink" and g.get("window"):
            # The windowed calls' useful work (impl_flops).
            g["visible"] = {"window": visible_pairs(g["seqlen"], g["seqlen"], g["causal"], tuple(g["window"]))}


def dry_run(groups, args):
    # Rough rates (TFLOP/s) for the estimate only: an H200's order of magnitude, windowed calls less efficient.
    rate = {"fwd": 450e12, "bwd": 350e12}
    total, measurements = 0.0, 0
    for g in groups:
        print(group_label(g) + (f"  ideal fraction {g['ideal_fraction']:.4f}" if "ideal_fraction" in g else ""))
        for name, (backend, kw) in impl_specs(g, args.sdpa_alibi).items():
            print(f"    {name:20s} {backend:9s} {kw}")
            for pass_ in PASSES:
                eff = rate[pass_] * (0.6 if windowed(g, name) else 1.0)
                # The rounds and the untimed warm-up round before them.
                total += (args.rounds + 1) * ((args.warmup + args.rep) * impl_flops(g, name, pass_) / eff + 0.02)
                measurements += args.rounds + 1
    print(
        f"\n{len(groups)} groups, {measurements} measurements ({args.rounds} rounds and an untimed warm-up "
        f"round, {args.warmup} warm-up + {args.rep} timed calls each); rough GPU time {total:.0f} s, plus ~20-40 s "
        "to start torch and CUDA and load the kernels."
    )
    print(f"Outputs: {args.out_dir or 'bench/results/<gpu>'}/variants_<gpu-slug>.json, .md, .png")


# ------------------------------------------------------------------------------------------------ runners


def alibi_slopes(nheads):
    """The ALiBi paper's geometric slopes 2^(-8 (i + 1) / nheads), fp32."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)], dtype=torch.float32, device=DEVICE)


def alibi_bias(slopes, seqlen, causal, dtype):
    """(1, h, s, s) additive bias -slope * |i - j|, -inf above the diagonal when causal (seqlen_q == seqlen_k)."""
    idx = torch.arange(seqlen, device=DEVICE)
    dist = (idx[None, :] - idx[:, None]).abs().float()
    bias = torch.empty(1, len(slopes), seqlen, seqlen, device=DEVICE, dtype=dtype)
    for h in range(len(slopes)):  # one head at a time: an fp32 (h, s, s) temporary would be 4 GiB at s = 8192
        bias[0, h] = -slopes[h] * dist
    if causal:
        bias.masked_fill_(torch.ones(seqlen, seqlen, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    return bias


def load_ours():
    try:
        import flash_attn_cuda

        return flash_attn_cuda, None
    except Exception as exc:
        print(f"[variants] WARNING: cannot import flash_attn_cuda ({type(exc).__name__}: {exc}); ours will be n/a")
        return None, f"import failed: {type(exc).__name__}: {exc}"


def ours_context(family):
    """The context factory ours runs under: nothing, or force_plan(kernel="mma_sync") for --family mma_sync."""
    if family == "auto":
        return contextlib.nullcontext
    from flash_attn_cuda.plan import force_plan

    return lambda: force_plan(kernel=family)


def learnable_sink(nheads):
    """(nheads,) fp32 sink logits, 2 * N(0, 1) from a seeded generator: a leaf that requires grad, as a model's
    parameter."""
    gen = torch.Generator(device=DEVICE).manual_seed(SINK_SEED)
    return (torch.randn(nheads, dtype=torch.float32, device=DEVICE, generator=gen) * 2).requires_grad_(True)


def make_runners(lib, lib_err, g, specs, q, k, v, qt, kt, vt, family="auto"):
    """name -> (context factory, fn, inputs, grad_like: dout in out's layout) or an error string. inputs: what the
    backward differentiates, q, k, v and any tensor argument that requires grad (the sink)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    extra = {}
    if any(v_ == "@alibi_slopes" for _, kw in specs.values() for v_ in kw.values()):
        extra["@alibi_slopes"] = alibi_slopes(g["nheads"])
    if any(v_ == "@alibi_bias" for _, kw in specs.values() for v_ in kw.values()):
        extra["@alibi_bias"] = alibi_bias(alibi_slopes(g["nheads"]), g["seqlen"], g["causal"], q.dtype)
    if any(v_ == "@sink" for _, kw in specs.values() for v_ in kw.values()):
        extra["@sink"] = learnable_sink(g["nheads"])
    runners = {}
    for name, (backend, kw) in specs.items():
        kw = {key: extra.get(val, val) if isinstance(val, str) else val for key, val in kw.items()}
        if backend == "ours":
            # The backward asks for the sink's gradient with dq, dk, dv, as training does. Given a sink, the op
            # computes that gradient even when only q's, k's and v's are asked for; asking adds only its return.
            grads = tuple(t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad)
            runners[name] = (
                lib_err
                if lib is None
                else (
                    ours_context(family),
                    lambda kw=kw: lib.flash_attn_func(q, k, v, **kw),
                    (q, k, v, *grads),
                    torch.randn_like,
                )
            )
        else:
            runners[name] = (
                lambda b=backends[backend]: sdpa_kernel([b]),
                lambda kw=kw: F.scaled_dot_product_attention(qt, kt, vt, **kw),
                (qt, kt, vt),
                common.sdpa_grad,
            )
    return runners


def err_text(exc):
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


def prepare(runner):
    """(context factory, {pass: callable to time}, output in (b, s, h, d) or SDPA's layout, error). The forward
    is timed under no_grad (as bench_fwd.py's forward, whose inputs need no grad); the backward is
    torch.autograd.grad of an output made once, its graph kept, with dout in the output's layout (for SDPA the
    transposed view of a (b, s, h, d) tensor). SDPA's 'why not' warnings join the error."""
    if isinstance(runner, str):
        return None, None, None, runner
    ctx, fn, inputs, grad_like = runner
    with warnings.catch_warnings(record=True) as caught, ctx():
        warnings.simplefilter("always")
        try:
            out = fn()
            dout = grad_like(out)

            def fwd():
                with torch.no_grad():
                    return fn()

            def bwd():
                return torch.autograd.grad(out, inputs, dout, retain_graph=True)

            return ctx, {"fwd": fwd, "bwd": bwd}, out.detach(), None
        except Exception as exc:
            err = err_text(exc)
    if caught:
        err += " | " + str(caught[0].message).strip().splitlines()[0][:200]
    return None, None, None, err


def time_rounds(timers, row, args):
    """The implementations take turns, first in an untimed warm-up round (round -1, each one full turn, its times
    dropped: on the H200 the first timing after a pause runs fast), then args.rounds times (round r
    starts with the r-th, so none always follows the same one); in each turn the forward, then the backward.
    row["ms"][name][pass] is the median over the rounds, row["rounds_ms"] the rounds. A pass that fails is
    recorded and left out of later rounds."""
    times = {name: {p: [] for p in fns} for name, (_, fns) in timers.items()}
    names = list(timers)
    for r in range(-1, args.rounds if names else -1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ctx, fns = timers[name]
            for pass_, fn in list(fns.items()):
                with warnings.catch_warnings(), ctx():
                    warnings.simplefilter("ignore")
                    ms, err = common.try_time(fn, args.warmup, args.rep)
                if err:
                    prev = row["errors"].get(name)
                    row["errors"][name] = (prev + "; " if prev else "") + f"{pass_}: {err}"
                    del fns[pass_]
                    times[name][pass_] = []
                elif r >= 0:
                    times[name][pass_].append(ms)
    for name, by_pass in times.items():
        for pass_, ms in by_pass.items():
            row["ms"][name][pass_] = statistics.median(ms) if ms else None
    row["rounds_ms"] = times


def new_row(g, err=None):
    row = {k: v for k, v in g.items() if k != "impls"}
    row.update(ms={n: {p: None for p in PASSES} for n in g["impls"]}, errors={}, warnings=[])
    if err:
        row["errors"] = {n: err for n in g["impls"]}
    return row


def sanity_check(row, outs, ours, ref):
    """A loose same-function check of ours against SDPA's output, both without variants."""
    if ours not in outs or ref not in outs:
        return
    a, b = outs[ours].float(), outs[ref].transpose(1, 2).float()
    diff = (a - b).abs().max().item()
    rel = diff / max(b.abs().max().item(), 1e-30)
    row["check"] = {"ours": ours, "vs": ref, "max_abs_diff": diff, "rel_to_max": rel}
    if not rel <= SANITY_REL_TOL:  # also catches NaN
        row["warnings"].append(f"{ours} differs from {ref}: max|diff| = {diff:.3g} ({rel:.1%} of max|out|)")


def bench_group(lib, lib_err, g, args):
    specs = impl_specs(g, args.sdpa_alibi)
    b, s, h, d = g["batch"], g["seqlen"], g["nheads"], g["hdim"]
    gen = torch.Generator(device=DEVICE).manual_seed(s * 7 + int(g["causal"]) + 1009 * SECTIONS.index(g["section"]))
    # Fresh random data, made before timing: (b, s, h, d) for ours, and for SDPA its own copy as the transposed
    # views of (b, s, h, d) tensors, the layout models give it (common.sdpa_view).
    dtype = DTYPES[args.dtype]
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    qt, kt, vt = (common.sdpa_view(x) for x in (q, k, v))
    row = new_row(g)
    timers, outs = {}, {}
    for name, runner in make_runners(lib, lib_err, g, specs, q, k, v, qt, kt, vt, args.family).items():
        ctx, fns, out, err = prepare(runner)
        if err:
            row["errors"][name] = err
        else:
            timers[name], outs[name] = (ctx, fns), out
    time_rounds(timers, row, args)
    # No check for the sink section: SDPA has no sink, and ours with a sink differs from ours without one by design.
    if g["section"] == "window":
        sanity_check(row, outs, "ours_full", "flash_full")
    elif g["section"] == "dropout":
        sanity_check(row, outs, "ours", "flash")
    elif "efficient" in outs:
        sanity_check(row, outs, "ours", "efficient")
    del q, k, v, qt, kt, vt, outs, timers
    return row


# ------------------------------------------------------------------------------------------------ derived


def ratio(num, den):
    return num / den if num and den else None


def overhead(ms, name, base, pass_):
    """name's time over base's time, minus 1 (0.10: 10% slower), or None."""
    x = ratio(ms.get(name, {}).get(pass_), ms.get(base, {}).get(pass_))
    return None if x is None else x - 1


def finish_row(row):
    """TFLOP/s per implementation and pass, and the section's ratios (all from the median times)."""
    ms = row["ms"]
    row["tflops"] = {
        n: {p: (impl_flops(row, n, p) / (t * 1e-3) / 1e12 if t else None) for p, t in by.items()}
        for n, by in ms.items()
    }
    sec, derived = row["section"], {}
    for p in PASSES:
        if sec == "window":
            # Time of the windowed call over the full-mask call's time: lower is better; ideal_fraction is the floor
            # if time scaled with the visible pairs.
            derived[p] = {
                f"window/{n}": ratio(ms["ours_window"][p], ms[n][p]) for n in ("ours_full", "flash_full", "cudnn_full")
            }
        elif sec == "softcap_alibi":
            # Overhead: variant time over plain time, minus 1 (0.10 = 10% slower).
            derived[p] = {n: overhead(ms, n, "ours", p) for n in ms if n.startswith("ours_")}
            if "efficient_alibi" in ms:
                derived[p]["efficient_alibi"] = overhead(ms, "efficient_alibi", "efficient", p)
                derived[p]["ours_alibi/efficient_alibi"] = ratio(ms["efficient_alibi"][p], ms["ours_alibi"][p])
        elif sec == "dropout":
            # ours/flash as in the README: flash's time over ours (above 1: ours faster).
            derived[p] = {
                "ours_dropout": overhead(ms, "ours_dropout", "ours", p),
                "flash_dropout": overhead(ms, "flash_dropout", "flash", p),
                "ours/flash": ratio(ms["flash"][p], ms["ours"][p]),
                "ours_dropout/flash_dropout": ratio(ms["flash_dropout"][p], ms["ours_dropout"][p]),
            }
        else:
            # The sink's overhead: time with the sink over the same call's time without one, minus 1.
            derived[p] = {"ours_sink": overhead(ms, "ours_sink", "ours", p)}
    row["derived"] = derived
    return row


# ------------------------------------------------------------------------------------------------ reports


def fms(v):
    return common.fmt_num(v, "{:.3f}")


def fpct(v):
    return "n/a" if v is None else f"{v:+.1%}"


def fx(v):
    return common.fmt_num(v, "{:.3f}")


def mask_name(r):
    return "causal" if r["causal"] else "non-causal"


def sink_mask_name(r):
    """The mask, with the window where a sink group has one (the window section gives its windows a column)."""
    w = r.get("window")
    return mask_name(r) + (f", window ({w[0]}, {w[1]})" if w else "")


def shape_tag(r):
    """A row's shape in the Failures list: <section> s<seqlen>[c=causal], and for the sink section, whose groups
    differ in head dim and window too, d<hdim>[w<left>]."""
    tag = f"{r['section']} s{r['seqlen']}{'c' if r['causal'] else ''}"
    if r["section"] == "sink":
        tag += f" d{r['hdim']}" + (f"w{r['window'][0]}" if r.get("window") else "")
    return tag


def markdown(meta, rows):
    lines = [
        f"# {meta['title']}",
        "",
        f"{meta['gpu']} ({meta.get('sm_count', '?')} SMs), commit {meta['commit']}, {meta['date']}, "
        f"torch {meta['torch']} (CUDA {meta['cuda']}), cuDNN {meta['cudnn']}.",
        "",
        meta["method"],
        "",
    ]
    by_sec = {s: [r for r in rows if r["section"] == s] for s in SECTIONS}

    if by_sec["window"]:
        lines += [
            "## 1. Sliding window: cost against the full mask",
            "",
            "Times in ms (median). `win/X`: our windowed call's time over X's time with the full mask of the "
            "same kind ("
            + ", ".join(f"{'causal' if c else 'non-causal'} for {w}" for w, c in WINDOWS)
            + "); lower is better. "
            "`ideal`: visible (query, key) pairs of the window mask over those of the full mask, counted "
            "exactly: the fraction if time scaled with the work. `TFLOP/s`: our windowed call's useful work "
            "(4*b*h*d*visible pairs, x2.5 backward) over its time.",
            "",
            "| seqlen | batch | window | mask | pass | ours window | ours full | flash full | cudnn full "
            "| win/ours | win/flash | win/cudnn | ideal | window TFLOP/s |",
            "|---" * 14 + "|",
        ]
        for r in sorted(by_sec["window"], key=lambda r: (not r["causal"], r["seqlen"])):
            for p in PASSES:
                m, dv = r["ms"], r["derived"][p]
                lines.append(
                    f"| {r['seqlen']} | {r['batch']} | ({r['window'][0]}, {r['window'][1]}) | {mask_name(r)} "
                    f"| {p} | "
                    + " | ".join(fms(m[n][p]) for n in ("ours_window", "ours_full", "flash_full", "cudnn_full"))
                    + " | "
                    + " | ".join(fx(dv[f"window/{n}"]) for n in ("ours_full", "flash_full", "cudnn_full"))
                    + f" | {r['ideal_fraction']:.3f} | {common.fmt_num(r['tflops']['ours_window'][p])} |"
                )
        lines.append("")

    if by_sec["softcap_alibi"]:
        eff = any("efficient_alibi" in r["ms"] for r in by_sec["softcap_alibi"])
        lines += [
            "## 2. Softcap and ALiBi: overhead against our plain kernel",
            "",
            f"Times in ms (median); in parentheses the overhead, variant time over plain time minus 1. softcap "
            f"{SOFTCAP}; ALiBi slopes 2^(-8(i+1)/h), fp32 (nheads,). `plain TFLOP/s` by the FA2 convention."
            + (
                " `efficient`: SDPA EFFICIENT_ATTENTION, plain, and with ALiBi as an explicit additive "
                "bias (1, h, s, s) (-inf above the diagonal when causal), built before timing; "
                "`ours/eff alibi`: its time over our ALiBi time (above 1: ours faster)."
                if eff
                else ""
            ),
            "",
            "| seqlen | batch | mask | pass | plain | plain TFLOP/s | softcap | alibi | softcap + alibi |"
            + (" efficient | efficient + bias | ours/eff alibi |" if eff else ""),
            "|---" * (9 + (3 if eff else 0)) + "|",
        ]
        for r in sorted(by_sec["softcap_alibi"], key=lambda r: (r["causal"], r["seqlen"])):
            for p in PASSES:
                m, dv = r["ms"], r["derived"][p]
                cells = [fms(m["ours"][p]), common.fmt_num(r["tflops"]["ours"][p])]
                cells += [
                    f"{fms(m[n][p])} ({fpct(dv.get(n))})" for n in ("ours_softcap", "ours_alibi", "ours_softcap_alibi")
                ]
                if eff:
                    cells += [
                        fms(m.get("efficient", {}).get(p)),
                        f"{fms(m.get('efficient_alibi', {}).get(p))} ({fpct(dv.get('efficient_alibi'))})",
                        fx(dv.get("ours_alibi/efficient_alibi")),
                    ]
                lines.append(f"| {r['seqlen']} | {r['batch']} | {mask_name(r)} | {p} | " + " | ".join(cells) + " |")
        lines.append("")

    if by_sec["dropout"]:
        lines += [
            "## 3. Dropout: overhead, ours and SDPA flash",
            "",
            f"Times in ms (median). dropout_p {DROPOUT_P}. `overhead`: time with dropout over time without, "
            "minus 1. `ours/flash`: SDPA FLASH_ATTENTION's time over ours (above 1: ours faster), without and "
            "with dropout.",
            "",
            "| seqlen | batch | mask | pass | ours | ours p=0.1 | ours overhead | flash | flash p=0.1 "
            "| flash overhead | ours/flash | ours/flash p=0.1 |",
            "|---" * 12 + "|",
        ]
        for r in sorted(by_sec["dropout"], key=lambda r: (r["causal"], r["seqlen"])):
            for p in PASSES:
                m, dv = r["ms"], r["derived"][p]
                lines.append(
                    f"| {r['seqlen']} | {r['batch']} | {mask_name(r)} | {p} | {fms(m['ours'][p])} | "
                    f"{fms(m['ours_dropout'][p])} | {fpct(dv['ours_dropout'])} | {fms(m['flash'][p])} | "
                    f"{fms(m['flash_dropout'][p])} | {fpct(dv['flash_dropout'])} | {fx(dv['ours/flash'])} | "
                    f"{fx(dv['ours_dropout/flash_dropout'])} |"
                )
        lines.append("")

    if by_sec["sink"]:
        lines += [
            "## 4. Learnable sink: overhead against the same call without one",
            "",
            "Times in ms (median). `ours + sink`: the same call with learnable_sink, fp32 (nheads,) logits drawn as "
            "2 * N(0, 1), a leaf that requires grad, so that the backward computes and returns the sink's gradient "
            "with dq, dk, dv. `overhead`: time with the sink over time without, minus 1. Hidden size "
            f"{SINK_HIDDEN}: heads = {SINK_HIDDEN} / hdim. The windowed rows: head dim 64 with gpt-oss's sliding "
            f"window, window_size={SINK_WINDOW}, causal, in both calls. `TFLOP/s of ours`: the call without the "
            "sink, by the FA2 convention; for the windowed rows the useful work, 4*b*h*d*(visible (query, key) "
            "pairs), x2.5 backward.",
            "",
            "| hdim | heads | seqlen | batch | mask | pass | ours | ours + sink | overhead | TFLOP/s of ours |",
            "|---" * 10 + "|",
        ]
        for r in sorted(by_sec["sink"], key=lambda r: (bool(r.get("window")), r["hdim"], r["causal"], r["seqlen"])):
            for p in PASSES:
                m, dv = r["ms"], r["derived"][p]
                lines.append(
                    f"| {r['hdim']} | {r['nheads']} | {r['seqlen']} | {r['batch']} | {sink_mask_name(r)} | {p} | "
                    f"{fms(m['ours'][p])} | {fms(m['ours_sink'][p])} | {fpct(dv['ours_sink'])} | "
                    f"{common.fmt_num(r['tflops']['ours'][p])} |"
                )
        lines.append("")

    errs = {}
    for r in rows:
        for n, e in r["errors"].items():
            errs.setdefault((n, e), []).append(shape_tag(r))
    if errs:
        lines += [
            "## Failures (recorded as n/a; shapes as <section> s<seqlen>[c=causal], the sink's with d<hdim>[w<left>])",
            "",
        ]
        lines += [f"- {n} ({', '.join(shapes)}): {e}" for (n, e), shapes in sorted(errs.items())] + [""]
    warns = [f"- {r['section']} s{r['seqlen']} {mask_name(r)}: {w}" for r in rows for w in r["warnings"]]
    if warns:
        lines += ["## Warnings", ""] + warns + [""]
    return "\n".join(lines)


def seqlen_tick(x):
    return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)


def plot(path, meta, rows):
    """One row of panels per kind of result in rows: the window's time fractions against seqlen (fwd, bwd); the
    overheads of softcap / ALiBi and of dropout; the sink's overhead at each head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    win = [r for r in rows if r["section"] == "window"]
    sink_hdims = sorted({r["hdim"] for r in rows if r["section"] == "sink"})
    # A run of some sections (--sections) leaves out the rows of panels it has nothing for, rather than drawing
    # them empty; a panel without rows in a row that is drawn is hidden.
    present = {r["section"] for r in rows}
    kinds = [
        kind
        for kind, shown in (
            ("window", bool(win)),
            ("overheads", bool(present & {"softcap_alibi", "dropout"})),
            ("sink", bool(sink_hdims)),
        )
        if shown
    ] or ["window"]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(13, 4.25 * len(kinds)), squeeze=False)
    panels = dict(zip(kinds, axes))
    for ax, p in zip(panels.get("window", []), PASSES):
        if not win:
            ax.set_visible(False)
            continue
        for causal in (True, False):
            grp = sorted((r for r in win if r["causal"] == causal), key=lambda r: r["seqlen"])
            if not grp:
                continue
            xs = [r["seqlen"] for r in grp]
            tag = f"({grp[0]['window'][0]}, {grp[0]['window'][1]}){' causal' if causal else ''}"
            style = "-" if causal else ":"
            for n, marker, color in (("ours_full", "o", "C0"), ("flash_full", "s", "C1"), ("cudnn_full", "^", "C2")):
                ys = [r["derived"][p][f"window/{n}"] for r in grp]
                ax.plot(
                    xs,
                    [float("nan") if y is None else y for y in ys],
                    style,
                    marker=marker,
                    color=color,
                    label=f"{tag} / {n}",
                )
            ax.plot(xs, [r["ideal_fraction"] for r in grp], style, color="gray", label=f"{tag} ideal")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [seqlen_tick(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_title(f"sliding window {p}: window time / full-mask time", fontsize=9)
        ax.set_xlabel("seqlen (batch x seqlen = 16k)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)

    def bars(ax, sec, series, title, hdim=None):
        # hdim: only that head dim's rows (the sink section has two); windowed rows after the others.
        grp = sorted(
            (r for r in rows if r["section"] == sec and hdim in (None, r["hdim"])),
            key=lambda r: (bool(r.get("window")), r["causal"], r["seqlen"]),
        )
        if not grp:
            ax.set_visible(False)
            return
        cells = [(r, p) for r in grp for p in PASSES]
        width = 0.8 / max(len(series), 1)
        for i, (n, label) in enumerate(series):
            ys = [r["derived"][p].get(n) for r, p in cells]
            ax.bar(
                [c + (i - (len(series) - 1) / 2) * width for c in range(len(cells))],
                [0.0 if y is None else 100 * y for y in ys],
                width,
                label=label,
            )
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xticks(
            range(len(cells)),
            [
                f"{seqlen_tick(r['seqlen'])} {'c' if r['causal'] else 'nc'}"
                + (f" w{r['window'][0]}" if r.get("window") else "")
                + f" {p}"
                for r, p in cells
            ],
            rotation=45,
            fontsize=7,
        )
        ax.set_ylabel("overhead, % of plain time")
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)

    if "overheads" in panels:
        bars(
            panels["overheads"][0],
            "softcap_alibi",
            [("ours_softcap", "softcap"), ("ours_alibi", "alibi"), ("ours_softcap_alibi", "softcap + alibi")],
            "softcap / ALiBi: ours",
        )
        bars(
            panels["overheads"][1],
            "dropout",
            [("ours_dropout", "ours"), ("flash_dropout", "SDPA flash")],
            f"dropout p={DROPOUT_P}: overhead",
        )
    # One panel per sink head dim (SINK_HDIMS has two); a row with only one hides the other panel.
    for i, ax in enumerate(panels.get("sink", [])):
        if i < len(sink_hdims):
            h = sink_hdims[i]
            bars(ax, "sink", [("ours_sink", "ours + sink")], f"learnable sink, hdim {h}: overhead", hdim=h)
        else:
            ax.set_visible(False)
    fig.suptitle(f"{meta['title']}: {meta['gpu']}, commit {meta['commit']}, {meta['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    suffix = "".join(f"_{x}" for x in (meta["family"], meta["dtype"]) if x not in ("auto", "bf16"))
    base = os.path.join(out_dir, f"variants_{meta['gpu_slug']}{suffix}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(meta, rows)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    try:
        plot(base + ".png", meta, rows)
    except Exception as exc:  # a missing matplotlib must not lose the numbers
        print(f"[variants] plot skipped: {type(exc).__name__}: {exc}")
    print(f"[variants] wrote {base}.json, .md, .png")
    return text


# --------------------------------------------------------------------------------------------------- main


def progress_line(row):
    parts = []
    for n, by in row["ms"].items():
        parts.append(f"{n} {fms(by['fwd'])}/{fms(by['bwd'])}")
    return (
        group_label(row)
        + " (ms fwd/bwd):\n    "
        + "  ".join(parts)
        + "".join(f"\n    {n}: {e}" for n, e in row["errors"].items())
        + "".join(f"\n    WARNING {w}" for w in row["warnings"])
    )


def main(argv=None):
    args = parse_args(argv)
    groups = build_groups(args)
    add_visible(groups)
    if args.dry_run:
        dry_run(groups, args)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_variants.py needs a CUDA GPU (--dry-run does not)")
    args.out_dir = common.out_dir(args.out_dir)
    torch.manual_seed(0)  # dropout's per-call seeds, ours and SDPA's, come from torch's CUDA generator
    lib, lib_err = load_ours()
    meta = common.stamp()
    meta.update(
        title=f"Attention variants: sliding window, softcap, ALiBi, dropout, learnable sink ({args.dtype}"
        + (", ours on mma.sync)" if args.family == "mma_sync" else ")"),
        dtype=args.dtype,
        family=args.family,
        tokens=TOKENS,
        nheads=NHEADS,
        hdim=HDIM,
        softcap=SOFTCAP,
        dropout_p=DROPOUT_P,
        sink_hidden=SINK_HIDDEN,
        sink_hdims=list(SINK_HDIMS),
        sink_window=list(SINK_WINDOW),
        warmup=args.warmup,
        rep=args.rep,
        rounds=args.rounds,
        quick=args.quick,
        sections=args.sections,
    )
    meta["method"] = (
        f"{args.dtype}, {NHEADS} heads, head dim {HDIM} (the sink section: head dims "
        f"{' and '.join(map(str, SINK_HDIMS))} at hidden size {SINK_HIDDEN}), batch x seqlen = {TOKENS} tokens"
        + (", ours forced to the mma.sync kernels" if args.family == "mma_sync" else "")
        + ". fwd: the call under no_grad; bwd: torch.autograd.grad of an output made once (graph kept), the "
        "backward alone. After an untimed "
        f"warm-up round, each cell: the median over {args.rounds} rounds in which the implementations of a shape "
        "take turns (round r starts with the r-th; in each turn the forward, then the backward), each round the "
        f"median of {args.rep} timed calls (CUDA events) after {args.warmup} warm-up calls. Inputs: ours (b,s,h,d) "
        "contiguous; SDPA the (b,h,s,d) transposed views of (b,s,h,d) tensors, as models call it (dout too, in "
        "out's layout). flash / cudnn / efficient: torch SDPA backends FLASH_ATTENTION / CUDNN_ATTENTION / "
        "EFFICIENT_ATTENTION. TFLOP/s by the FA2 convention (4*b*h*s^2*d, halved when causal, x2.5 backward) "
        "unless said otherwise. n/a: failed or unsupported (see Failures)."
    )
    print(f"[variants] {meta['gpu']} commit {meta['commit']} torch {meta['torch']} cuDNN {meta['cudnn']}")
    rows = []
    for g in groups:
        try:
            row = bench_group(lib, lib_err, g, args)
        except Exception as exc:  # e.g. out of memory making inputs: the group is n/a, the run goes on
            row = new_row(g, err_text(exc))
        rows.append(finish_row(row))
        torch.cuda.empty_cache()
        print(progress_line(row), flush=True)
    print()
    print(write_reports(args.out_dir, meta, rows))


if __name__ == "__main__":
    main()
