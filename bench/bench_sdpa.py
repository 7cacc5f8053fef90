"""PyTorch SDPA on our kernels (flash_attn_cuda.sdpa.activate()) against SDPA's own FLASH_ATTENTION and
CUDNN_ATTENTION backends, in one run, on the anchor shapes (batch*seqlen tokens fixed, hidden = heads*hdim fixed).

Every implementation is F.scaled_dot_product_attention on the same (b, h, s, d) transposed views of (b, s, h, d)
tensors, the layout models give it: sdpa_ours with our kernels activated and the flash backend forced, flash with
them deactivated (PyTorch's FlashAttention-2), cudnn with the cuDNN backend forced. The difference to bench_fwd.py's
`ours` is what the dispatcher glue (flash_attn_cuda/sdpa.py) costs or saves.

    python bench/bench_sdpa.py                     # forward, full anchor grid, bf16  -> sdpa_<gpu-slug>.*
    python bench/bench_sdpa.py --pass bwd --quick  # backward alone, seqlens 2k/8k/16k -> sdpa_bwd_<gpu-slug>.*
"""

import argparse
import collections
import contextlib
import os
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # repo root, last: an installed flash_attn_cuda wins over an unbuilt tree
import bench_fwd  # noqa: E402
import common  # noqa: E402

REF = "sdpa_ours"
IMPLS = [REF, "flash", "cudnn"]
DTYPES = bench_fwd.DTYPES
SANITY_REL_TOL = bench_fwd.SANITY_REL_TOL


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
    p.add_argument("--seqlens", type=ints, default=None, help="default 512,1024,...,16384 (--quick: 2048,8192,16384)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--impls", type=lambda s: s.split(","), default=IMPLS, help=f"from {','.join(IMPLS)}")
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
    if set(a.impls) - set(IMPLS) or REF not in a.impls:
        p.error(f"--impls must include '{REF}' and be drawn from {IMPLS}")
    return a


def load_sdpa():
    """flash_attn_cuda.sdpa, or None and why it cannot be imported (sdpa_ours is then n/a)."""
    try:
        from flash_attn_cuda import sdpa

        return sdpa, None
    except Exception as exc:
        print(f"[bench] WARNING: cannot import flash_attn_cuda.sdpa ({type(exc).__name__}: {exc}); {REF} is n/a")
        return None, f"import failed: {type(exc).__name__}: {exc}"


def backend_context(sdpa, name, tally):
    """The context factory of one implementation's turn: our kernels activated for sdpa_ours (and deactivated
    for the others), its SDPA backend forced. Entered outside the timed calls (bench_fwd.time_rounds enters it
    around each measurement), so the (de)activation, a host-side re-registration of the kernels, is never timed.
    tally[name] counts the calls of ours that ran inside it, served and handed back to PyTorch's kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            # Re-registering replaces a kernel, which the dispatcher may warn about every time.
            warnings.simplefilter("ignore")
            if name == REF:
                sdpa.activate()
            else:
                sdpa.deactivate()
        before = collections.Counter(sdpa.calls)
        try:
            with sdpa_kernel([backend]):
                yield
        finally:
            tally[name].update(collections.Counter(sdpa.calls) - before)
            if name == REF:
                sdpa.deactivate()

    return ctx


def make_runners(sdpa, sdpa_err, qt, kt, vt, causal, impls, tally):
    """name -> (context factory, fn, its inputs, True: an SDPA call) as bench_fwd.prepare_one takes them, or an
    error string. qt, kt, vt: SDPA's transposed views of (b, s, h, d) tensors (common.sdpa_view)."""
    runners = {}
    for name in impls:
        if sdpa is None:
            runners[name] = sdpa_err
            continue
        runners[name] = (
            backend_context(sdpa, name, tally),
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
            (qt, kt, vt),
            True,
        )
    return runners


def check_tally(row, tally, pass_):
    """Our kernels must have served every call of sdpa_ours and no call of the others: a cell of sdpa_ours that
    PyTorch's kernels ran (a shape or build ours cannot serve) is n/a with the reason, not a time of theirs."""
    served = {"fwd": ("forward",), "bwd": ("backward",), "fwd_bwd": ("forward", "backward")}[pass_]
    for name, counts in tally.items():
        fallbacks = counts["fallback_forward"] + counts["fallback_backward"]
        if name == REF and row["ms"].get(name) is not None and (fallbacks or not all(counts[k] for k in served)):
            row["ms"][name] = None
            row["errors"][name] = f"ran PyTorch's kernels, not ours ({dict(counts)})"
        elif name != REF and sum(counts.values()):
            row["warnings"].append(f"{name} ran our kernels ({dict(counts)})")
    row["sdpa_calls"] = {name: dict(counts) for name, counts in tally.items()}


def bench_shape(sdpa, sdpa_err, hdim, causal, seqlen, args):
    dtype = DTYPES[args.dtype]
    batch, nheads = bench_fwd.shape_of(args, hdim, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(hdim * 100003 + seqlen * 7 + int(causal))
    # Fresh random data (never zeros), made before timing, shared by every implementation: the transposed views
    # of (b, s, h, d) tensors, the layout models give SDPA (common.sdpa_view).
    grad = args.pass_ != "fwd"
    qt, kt, vt = (
        common.sdpa_view(torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=dtype, generator=gen), grad)
        for _ in range(3)
    )
    row = bench_fwd.new_row(args, hdim, causal, seqlen)
    tally = {name: collections.Counter() for name in args.impls}
    outs, timers = {}, {}
    for name, runner in make_runners(sdpa, sdpa_err, qt, kt, vt, causal, args.impls, tally).items():
        ctx, timed, out, err = bench_fwd.prepare_one(runner, args.pass_)
        if err:
            row["errors"][name] = err
            continue
        timers[name] = (ctx, timed)
        outs[name] = out
    # The implementations take turns (--rounds), so a drift in the GPU's or host's speed over the run reaches all
    # of them alike; each cell is the median over its rounds.
    bench_fwd.time_rounds(timers, row, args)
    if sdpa is not None:
        check_tally(row, tally, args.pass_)
    ref = next((n for n in args.impls if n != REF and n in outs), None)
    if REF in outs and ref:
        diff = (outs[REF].float() - outs[ref].float()).abs().max().item()
        rel = diff / max(outs[ref].float().abs().max().item(), 1e-30)
        row["check"] = {"vs": ref, "max_abs_diff": diff, "rel_to_max": rel}
        if not rel <= SANITY_REL_TOL:  # also catches NaN
            row["warnings"].append(f"{REF} differs from {ref}: max|diff| = {diff:.3g} ({rel:.1%} of max|out|)")
    del qt, kt, vt, outs
    return row


def report_name(args, gpu_slug):
    """sdpa_<gpu-slug> for the forward, sdpa_bwd_<gpu-slug> / sdpa_fwd_bwd_<gpu-slug> for the others; fp16 runs
    get a _fp16 suffix."""
    middle = "" if args.pass_ == "fwd" else f"{args.pass_}_"
    return f"sdpa_{middle}{gpu_slug}" + ("" if args.dtype == "bf16" else f"_{args.dtype}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_sdpa.py needs a CUDA GPU: no CUDA device is visible to torch")
    sdpa, sdpa_err = load_sdpa()
    meta = bench_fwd.grid_meta(
        args,
        "attention through PyTorch SDPA",
        f"Every implementation is F.scaled_dot_product_attention(q, k, v, is_causal=...) on the same (b,h,s,d) "
        f"transposed views of (b,s,h,d) tensors, as models call it (dout too, in out's layout). {REF}: "
        f"flash_attn_cuda.sdpa activated, backend FLASH_ATTENTION (the aten flash ops on our kernels, through "
        f"their Python glue); flash: deactivated, FLASH_ATTENTION (PyTorch's FlashAttention-2); cudnn: "
        f"CUDNN_ATTENTION. The activation toggles between turns, outside the timed calls. n/a: failed, "
        f"unsupported, or (for {REF}) run by PyTorch's kernels instead of ours.",
    )
    peak = bench_fwd.grid_peak(args, meta)
    try:
        rows = bench_fwd.grid_rows(
            args, peak, lambda hdim, causal, seqlen: bench_shape(sdpa, sdpa_err, hdim, causal, seqlen, args), REF
        )
    finally:
        if sdpa is not None:
            sdpa.deactivate()
    print()
    print(common.write_reports(args.out_dir, report_name(args, meta["gpu_slug"]), meta, rows, args.impls, peak, REF))


if __name__ == "__main__":
    main()
