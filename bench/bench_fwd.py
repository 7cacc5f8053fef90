"""Forward attention benchmark: flash_attn_cuda against PyTorch SDPA's FLASH_ATTENTION, CUDNN_ATTENTION and
EFFICIENT_ATTENTION backends, in one run, on the anchor shapes (batch*seqlen tokens fixed, hidden = heads*hdim fixed).

    python bench/mma_peak.py && python bench/bench_fwd.py            # full anchor grid, bf16
    python bench/bench_fwd.py --quick --hdims 128                     # a few shapes
    python bench/bench_fwd.py --hdims 192 --hdim-v 128 --impls ours,ours_padv,cudnn   # V's own head dim (MLA)
"""

import argparse
import contextlib
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

IMPLS = ["ours", "flash", "cudnn", "efficient"]
# ours_det: deterministic=True (its backward differs); ours_det_mma: the same on the mma.sync kernels, which a Hopper
# GPU runs in this mode only where its own have no fixed dQ order (force_plan(kernel="mma_sync"));
# ours_mma: the mma.sync kernels on a Hopper GPU, which
# otherwise runs the warpgroup-MMA ones (force_plan(kernel="mma_sync"), forward and backward); ours_mma99: the
# mma.sync kernels' tile set for GPUs with 99 KiB of shared memory per block (sm_86, sm_89, sm_120), planned as
# on such a GPU (force_plan(max_smem=101376)); ours_nows: on a Hopper GPU, the forward whose warps all load and
# compute instead of the warp-specialized TMA kernel, and the backward on the narrow kernel (force_plan(ws=False));
# ours_ws: the warp-specialized kernels of both passes wherever they can run, also where the plan would pick another,
# on their main tiles (force_plan(ws=True, short_keys=False): no short-key tile of either Hopper forward);
# ours_stagger: the Hopper wide backward's staggered walk wherever it can run (force_plan(stagger=True));
# ours_det_nostagger: deterministic=True without it (force_plan(stagger=False)). ours_padv: with --hdim-v, V
# zero-padded to Q's head dim by the caller and the output cut back, as a call without V's own head dim would run.
OPTIONAL_IMPLS = [
    "ours_det",
    "ours_det_mma",
    "ours_det_nostagger",
    "ours_mma",
    "ours_mma99",
    "ours_nows",
    "ours_ws",
    "ours_stagger",
    "ours_padv",
]
# fa4: FlashAttention-4's flash_attn_func (the flash-attn-4 package, flash_attn.cute), on the same (b, s, h, d)
# tensors as ours; its backward through autograd, as ours.
OTHER_IMPLS = ["fa4"]
SMEM_99KIB = 101376
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SANITY_REL_TOL = 0.05  # a loose "is it the same function" check against SDPA, not the correctness rule


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--pass",
        dest="pass_",
        choices=["fwd", "bwd", "fwd_bwd"],
        default="fwd",
        help="time the forward, the backward alone, or both",
    )
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--hdim-v", type=int, default=None, help="V's head dim, where it differs from Q's and K's (--hdims)")
    p.add_argument("--seqlens", type=ints, default=None, help="default 512,1024,...,16384 (--quick: 2048,8192,16384)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--impls", type=lambda s: s.split(","), default=IMPLS)
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * hdim")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per measurement (default 5, --quick 3)")
    p.add_argument("--rep", type=int, default=None, help="timed calls per measurement, >= 20 (default 30, --quick 20)")
    p.add_argument("--rounds", type=int, default=3, help="turns each implementation takes per shape (median)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--out-dir", default=None, help="default bench/results/<gpu>/, e.g. bench/results/h200/")
    p.add_argument("--mma-peak", default=None, help="mma_peak.json to use (default <out-dir>/mma_peak.json)")
    a = p.parse_args(argv)
    a.out_dir = common.out_dir(a.out_dir)
    a.seqlens = a.seqlens or ([2048, 8192, 16384] if a.quick else [512, 1024, 2048, 4096, 8192, 16384])
    a.warmup = a.warmup if a.warmup is not None else (3 if a.quick else 5)
    a.rep = a.rep if a.rep is not None else (20 if a.quick else 30)
    unknown = set(a.impls) - set(IMPLS + OPTIONAL_IMPLS + OTHER_IMPLS)
    if unknown or "ours" not in a.impls:
        p.error(f"--impls must include 'ours' and be drawn from {IMPLS + OPTIONAL_IMPLS + OTHER_IMPLS}")
    return a


def load_ours():
    try:
        import flash_attn_cuda

        return flash_attn_cuda, None
    except Exception as exc:
        print(f"[bench] WARNING: cannot import flash_attn_cuda ({type(exc).__name__}: {exc}); 'ours' will be n/a")
        return None, f"import failed: {type(exc).__name__}: {exc}"


def timed_pass(fn, inputs, pass_, sdpa=False):
    """The callable to time for a pass: fn itself, its backward alone (the forward graph is built once and
    kept), or forward and backward together. dout has out's layout: contiguous (b, s, h, d) for ours, for SDPA
    (sdpa=True) the transposed view of a (b, s, h, d) tensor (common.sdpa_grad). Returns (callable, output)."""
    if pass_ == "fwd":
        return fn, None
    out = fn()
    dout = common.sdpa_grad(out) if sdpa else torch.randn_like(out)
    if pass_ == "bwd":
        return (lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)), out
    return (lambda: torch.autograd.grad(fn(), inputs, dout)), out


def forced_plan(**choices):
    """A context factory that forces these force_plan choices on the calls made inside it (forward and backward),
    or an error string when this flash_attn_cuda has no plans."""
    try:
        from flash_attn_cuda.plan import force_plan
    except Exception as exc:
        return f"no force_plan: {type(exc).__name__}: {exc}"
    return lambda: force_plan(**choices)


def fa4_runner(q, k, v, causal):
    """FlashAttention-4 as a runner (see make_runners), or why it cannot run."""
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except Exception as exc:
        return f"no FlashAttention-4: {type(exc).__name__}: {exc}"

    def run():
        out = fa4_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return contextlib.nullcontext, run, (q, k, v), False


def make_runners(lib, lib_err, q, k, v, qt, kt, vt, causal, impls):
    """name -> (context factory, fn, its inputs, whether it is SDPA) or an error string. fn returns ours' output
    in (b, s, h, d) and SDPA's in (b, h, s, d); q, k, v are (b, s, h, d), and qt, kt, vt SDPA's transposed views
    of (b, s, h, d) tensors (common.sdpa_view)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    runners = {}
    for name in impls:
        if name in ("ours", *OPTIONAL_IMPLS):
            hdim, dtype = q.shape[-1], q.dtype
            det = name in ("ours_det", "ours_det_mma", "ours_det_nostagger")
            if lib is None:
                runners[name] = lib_err
            elif hasattr(lib, "kernel_available") and not lib.kernel_available(hdim, dtype, causal):
                runners[name] = f"kernel not compiled (hdim {hdim}, {dtype}, causal={causal})"
            else:
                ctx = {
                    "ours_mma": forced_plan(kernel="mma_sync"),
                    "ours_det_mma": forced_plan(kernel="mma_sync"),
                    "ours_mma99": forced_plan(kernel="mma_sync", max_smem=SMEM_99KIB),
                    "ours_nows": forced_plan(ws=False),
                    "ours_ws": forced_plan(ws=True, short_keys=False),
                    "ours_stagger": forced_plan(stagger=True),
                    "ours_det_nostagger": forced_plan(stagger=False),
                }.get(name, contextlib.nullcontext)
                if name == "ours_padv":

                    def fn(d_v=v.shape[-1]):
                        padded = F.pad(v, (0, hdim - d_v))
                        return lib.flash_attn_func(q, k, padded, causal=causal)[..., :d_v]

                else:

                    def fn(det=det):
                        return lib.flash_attn_func(q, k, v, causal=causal, deterministic=det)

                runners[name] = ctx if isinstance(ctx, str) else (ctx, fn, (q, k, v), False)
        elif name == "fa4":
            runners[name] = fa4_runner(q, k, v, causal)
        else:
            runners[name] = (
                lambda b=backends[name]: sdpa_kernel([b]),
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                (qt, kt, vt),
                True,
            )
    return runners


def prepare_one(runner, pass_="fwd"):
    """(context factory, callable to time, output, error) for one runner; SDPA's 'why not' warnings are folded
    into the error message."""
    if isinstance(runner, str):
        return None, None, None, runner
    ctx, fn, inputs, sdpa = runner
    with warnings.catch_warnings(record=True) as caught, ctx():
        warnings.simplefilter("always")
        try:
            out = fn().detach()
            timed, _ = timed_pass(fn, inputs, pass_, sdpa)
            return ctx, timed, out, None
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if caught:
        err += " | " + str(caught[0].message).strip().splitlines()[0][:200]
    return None, None, None, err


def time_rounds(timers, row, args):
    """Times each (context, callable) of timers in turn: an untimed warm-up round (round -1, each runner one
    full turn, its time dropped), then args.rounds rounds; row["ms"] gets each one's median over its rounds and
    row["rounds_ms"] the rounds. A runner that fails is left out of later rounds.

    On the H200 the first timing after the pause between shapes runs up to 20% faster than the ones after it;
    the warm-up round absorbs it, and the median leaves out any later outlier. Round r starts with the r-th
    runner, so that no runner always follows the same one."""
    times = {name: [] for name in timers}
    names = list(timers)
    for r in range(-1, args.rounds if names else -1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name not in timers:
                continue
            ctx, timed = timers[name]
            with warnings.catch_warnings(), ctx():
                warnings.simplefilter("ignore")
                ms, err = common.try_time(timed, args.warmup, args.rep)
            if err:
                row["errors"][name] = err
                del timers[name]
            elif r >= 0:
                times[name].append(ms)
    for name, ms in times.items():
        row["ms"][name] = statistics.median(ms) if ms and name not in row["errors"] else None
    row["rounds_ms"] = times


def shape_of(args, hdim, seqlen):
    return max(1, args.tokens // seqlen), args.hidden // hdim  # batch, nheads


def new_row(args, hdim, causal, seqlen, err=None):
    """A row with every implementation n/a; err, if given, is recorded as every implementation's failure."""
    batch, nheads = shape_of(args, hdim, seqlen)
    return {
        "pass": args.pass_,
        "dtype": args.dtype,
        "hdim": hdim,
        "causal": causal,
        "batch": batch,
        "seqlen": seqlen,
        "nheads": nheads,
        "flops": common.attn_flops(
            batch, nheads, seqlen, seqlen, hdim, causal, args.pass_, getattr(args, "hdim_v", None)
        ),
        "ms": {k: None for k in args.impls},
        "warnings": [],
        "errors": {k: err.splitlines()[0][:300] for k in args.impls} if err else {},
    }


def bench_shape(lib, lib_err, dtype_name, hdim, causal, seqlen, args):
    dtype = DTYPES[dtype_name]
    batch, nheads = shape_of(args, hdim, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hdim * 100003 + seqlen * 7 + int(causal))
    # Fresh random data (never zeros), made before timing: (b, s, h, d) for ours, and for SDPA its own copy as the
    # transposed views of (b, s, h, d) tensors, the layout models give it (common.sdpa_view).
    grad = args.pass_ != "fwd"
    q, k, v = (
        torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype, generator=gen).requires_grad_(grad)
        for d in (hdim, hdim, args.hdim_v or hdim)
    )
    qt, kt, vt = (common.sdpa_view(x) for x in (q, k, v))
    row = new_row(args, hdim, causal, seqlen)
    outs, timers = {}, {}
    for name, runner in make_runners(lib, lib_err, q, k, v, qt, kt, vt, causal, args.impls).items():
        ctx, timed, out, err = prepare_one(runner, args.pass_)
        if err:
            row["errors"][name] = err
            continue
        timers[name] = (ctx, timed)
        outs[name] = out if name.startswith("ours") or name in OTHER_IMPLS else out.transpose(1, 2)
    # The implementations take turns (--rounds), so a drift in the GPU's or host's speed over the run
    # reaches all of them alike; each cell is the median over its rounds.
    time_rounds(timers, row, args)
    ref = next((n for n in args.impls if n in IMPLS and n != "ours" and n in outs), None)
    if "ours" in outs and ref:
        diff = (outs["ours"].float() - outs[ref].float()).abs().max().item()
        rel = diff / max(outs[ref].float().abs().max().item(), 1e-30)
        row["check"] = {"vs": ref, "max_abs_diff": diff, "rel_to_max": rel}
        if not rel <= SANITY_REL_TOL:  # also catches NaN
            row["warnings"].append(f"ours differs from {ref}: max|diff| = {diff:.3g} ({rel:.1%} of max|out|)")
    del q, k, v, qt, kt, vt, outs
    return row


PASS_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwd_bwd": "Forward + backward"}


def grid_meta(args, what, inputs):
    """common.stamp() with the run's settings and its method: how the anchor grid is timed, then `inputs` (what
    each implementation runs on, and what an n/a cell means). what: the title's subject ("attention")."""
    meta = common.stamp()
    meta.update(
        {
            "title": f"{PASS_TITLES[args.pass_]} {what}, {args.dtype}",
            "pass": args.pass_,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "warmup": args.warmup,
            "rep": max(args.rep, 20),
            "rounds": args.rounds,
        }
    )
    meta["method"] = (
        f"{args.dtype}, batch x seqlen = {args.tokens} tokens, hidden {args.hidden} "
        f"(nheads = {args.hidden} / hdim). TFLOP/s by the FA2 convention: 4*b*h*s^2*d, halved when "
        f"causal, x2.5 for the backward, x3.5 for forward + backward"
        + (
            f"; V's head dim {args.hdim_v}, 2*b*h*s^2*(hdim + {args.hdim_v}) for 4*b*h*s^2*d"
            if getattr(args, "hdim_v", None)
            else ""
        )
        + ". After an untimed warm-up round, "
        f"each cell: the median over {args.rounds} rounds in which the implementations take turns "
        f"(round r starts with the r-th), each round the median of {max(args.rep, 20)} timed calls "
        f"(CUDA events) after {args.warmup} warm-up calls. " + inputs
    )
    return meta


def grid_peak(args, meta):
    """The mma.sync peak of mma_peak.json for this GPU (None when not measured), printed with the run's stamp."""
    peak = common.load_mma_peak(args.mma_peak or os.path.join(args.out_dir, "mma_peak.json"), meta["gpu"])
    print(
        f"[bench] {meta['gpu']} commit {meta['commit']} torch {meta['torch']} cuDNN {meta['cudnn']}; mma.sync peak: "
        + (f"{peak['tflops']:.0f} TFLOP/s" if peak else "not measured")
    )
    return peak


def grid_rows(args, peak, measure, ref=common.REF):
    """measure(hdim, causal, seqlen) -> row over the grid of args, each row finished and printed; a shape that
    raises (out of memory making inputs, say) is recorded as n/a and the grid goes on."""
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows = []
    for hdim in args.hdims:
        for causal in causals:
            for seqlen in args.seqlens:
                try:
                    row = measure(hdim, causal, seqlen)
                except Exception as exc:
                    row = new_row(args, hdim, causal, seqlen, f"{type(exc).__name__}: {exc}")
                row = common.finish_row(row, args.impls, peak["tflops"] if peak else None, ref=ref)
                rows.append(row)
                print(
                    f"hdim {hdim:3d} {'causal    ' if causal else 'non-causal'} s={seqlen:5d} b={row['batch']:3d}: "
                    + "  ".join(f"{k} {common.fmt_num(row['tflops'][k])}" for k in args.impls)
                    + "".join(f"\n    {k}: {e}" for k, e in row["errors"].items())
                    + "".join(f"\n    WARNING {w}" for w in row["warnings"]),
                    flush=True,
                )
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fwd.py needs a CUDA GPU")
    lib, lib_err = load_ours()
    meta = grid_meta(
        args,
        "attention",
        "Inputs: ours (b,s,h,d) contiguous; SDPA the (b,h,s,d) transposed views of (b,s,h,d) tensors, as models "
        "call it (dout too, in out's layout). flash / cudnn / efficient: torch SDPA backends FLASH_ATTENTION / "
        "CUDNN_ATTENTION / EFFICIENT_ATTENTION. fa4: FlashAttention-4's flash_attn_func (flash-attn-4), on ours' "
        "tensors. n/a: failed or unsupported.",
    )
    peak = grid_peak(args, meta)
    rows = grid_rows(
        args, peak, lambda hdim, causal, seqlen: bench_shape(lib, lib_err, args.dtype, hdim, causal, seqlen, args)
    )
    name = (
        f"{args.pass_}_{meta['gpu_slug']}"
        + (f"_hdim{args.hdims[0]}v{args.hdim_v}" if args.hdim_v else "")
        + ("" if args.dtype == "bf16" else f"_{args.dtype}")
    )
    print()
    print(common.write_reports(args.out_dir, name, meta, rows, args.impls, peak))


if __name__ == "__main__":
    main()
