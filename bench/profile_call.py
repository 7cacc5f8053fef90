"""A few calls of one shape, forward or backward, ours, SDPA's FLASH_ATTENTION or CUDNN_ATTENTION backend, or
FlashAttention-4 (the flash-attn-4 package), for Nsight Compute (ncu) or Nsight Systems (nsys).

The timed calls of each implementation lie in an NVTX range named <impl>_<pass> ("ours_bwd", "flash_fwd", ...),
after --warmup calls outside it, so `ncu --nvtx --nvtx-include "ours_bwd/"` profiles every kernel of those calls
and nothing else:

    ncu --nvtx --nvtx-include "ours_bwd/" --set full -o bwd_ours \\
        python bench/profile_call.py --pass bwd --shape 1,8192,8192,16,128 --causal
    ncu --nvtx --nvtx-include "ours_fwd/" --nvtx-include "flash_fwd/" \\
        --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \\
        python bench/profile_call.py --pass fwd --shape 8,1,16384,16,128 --impls ours,flash

The shape is --shape b,seqlen_q,seqlen_k,heads,head_dim (with --nheads-k for GQA/MQA), or else the anchor grid's
(--tokens / --seqlen sequences of --seqlen tokens, --hidden / --hdim heads). --plan forces our launch plan, as
flash_attn_cuda.plan.force_plan does (e.g. --plan "kernel=mma_sync;key_blocks=2", --num-splits 4); the plan
that ran is printed before the calls. Ours gets (b, s, h, d) tensors; SDPA the (b, h, s, d) transposed views of
(b, s, h, d) tensors, the layout models give it (the backward's dout too).
"""

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # repo root, after an installed copy
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The SDPA backend each of the other implementations names (looked up when a call is made, so that --help and
# argument errors need no CUDA build of torch).
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--pass",
        dest="pass_",
        choices=["fwd", "bwd"],
        default="fwd",
        help="profile the forward (under no_grad) or the backward alone (default fwd)",
    )
    p.add_argument(
        "--impls",
        type=lambda s: s.split(","),
        default=["ours"],
        help="comma-separated, from ours,flash,cudnn,fa4, run in this order (default ours)",
    )
    p.add_argument("--shape", help="b,seqlen_q,seqlen_k,heads,head_dim (replaces --tokens/--hidden/--seqlen/--hdim)")
    p.add_argument("--nheads-k", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen, without --shape")
    p.add_argument("--hidden", type=int, default=2048, help="heads * hdim, without --shape")
    p.add_argument("--seqlen", type=int, default=8192, help="without --shape")
    p.add_argument("--hdim", type=int, default=128, help="without --shape")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--deterministic", action="store_true", help="ours: deterministic=True")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=1, help="calls before the NVTX range (default 1)")
    p.add_argument("--calls", type=int, default=1, help="calls inside the NVTX range (default 1)")
    p.add_argument(
        "--plan",
        default="",
        help='ours: force_plan choices as "key=value;...", keys kernel, gqa_walk, '
        "key_blocks, short_keys, short_queries",
    )
    p.add_argument("--num-splits", type=int, default=0, help="ours: force the forward's key splits (0: heuristic)")
    a = p.parse_args(argv)
    if not a.impls or set(a.impls) - set(SDPA_BACKENDS) - {"ours", "fa4"}:
        p.error("--impls takes ours, flash, cudnn and/or fa4")
    if a.shape:
        try:
            a.b, a.sq, a.sk, a.h, a.d = (int(x) for x in a.shape.split(","))
        except ValueError:
            p.error("--shape takes five integers: b,seqlen_q,seqlen_k,heads,head_dim")
    else:
        a.b, a.h, a.d = max(1, a.tokens // a.seqlen), a.hidden // a.hdim, a.hdim
        a.sq = a.sk = a.seqlen
    a.hk = a.nheads_k or a.h
    try:
        items = (item.split("=", 1) for item in a.plan.split(";") if item)
        a.choices = {k.strip(): _value(v.strip()) for k, v in items}
    except ValueError:
        p.error('--plan takes "key=value" pairs separated by ";"')
    return a


def _value(text):
    return int(text) if text.lstrip("-").isdigit() else text


def forced(args):
    """force_plan with --plan and --num-splits, or no context when neither is given."""
    if not args.choices and not args.num_splits:
        return contextlib.nullcontext()
    from flash_attn_cuda.plan import force_plan

    return force_plan(num_splits=args.num_splits, **args.choices)


def print_plan(args):
    """The plan our call runs under these choices, from torch.ops.flash_attn2.plan (when this build has it)."""
    try:
        from flash_attn_cuda import plan as plans

        num_splits, override = plans.forced()
        print(
            plans.plan(
                args.pass_,
                batch=args.b,
                seqlen_q=args.sq,
                seqlen_k=args.sk,
                nheads=args.h,
                nheads_k=args.hk,
                head_dim=args.d,
                causal=args.causal,
                deterministic=args.deterministic,
                num_splits=num_splits,
                override=override,
            ),
            flush=True,
        )
    except Exception as exc:
        print(f"[profile] plan not available: {type(exc).__name__}: {exc}", flush=True)


def make_call(impl, args):
    """A callable that runs one call of the pass (the forward graph, for the backward, is built once here)."""
    dtype, grad = DTYPES[args.dtype], args.pass_ == "bwd"
    q = torch.randn(args.b, args.sq, args.h, args.d, device="cuda", dtype=dtype)
    k, v = (torch.randn(args.b, args.sk, args.hk, args.d, device="cuda", dtype=dtype) for _ in range(2))
    if impl == "ours":
        from flash_attn_cuda import flash_attn_func

        inputs = tuple(t.requires_grad_(grad) for t in (q, k, v))

        def fwd():
            return flash_attn_func(*inputs, causal=args.causal, deterministic=args.deterministic)
    elif impl == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func

        # On the same (b, s, h, d) tensors as ours; it returns (out, lse).
        inputs = tuple(t.requires_grad_(grad) for t in (q, k, v))

        def fwd():
            out = fa4_func(*inputs, causal=args.causal)
            return out[0] if isinstance(out, tuple) else out
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # The transposed views of (b, s, h, d) tensors, the layout models give SDPA (common.sdpa_view); the
        # backward's dout likewise, in the output's layout.
        inputs = tuple(common.sdpa_view(t, requires_grad=grad) for t in (q, k, v))
        gqa = {"enable_gqa": True} if args.hk != args.h else {}
        backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
        # SDPA aligns its causal mask top-left, ours bottom-right: the same when seqlen_q == seqlen_k.

        def fwd():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*inputs, is_causal=args.causal, **gqa)

    if not grad:

        def call():
            with torch.no_grad():
                fwd()

        return call
    out = fwd()
    dout = common.sdpa_grad(out) if impl in SDPA_BACKENDS else torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_call.py needs a CUDA GPU")
    print(
        f"[profile] {args.pass_} (b, sq, sk, h, hk, d) = ({args.b}, {args.sq}, {args.sk}, {args.h}, {args.hk}, "
        f"{args.d}) {args.dtype} causal={args.causal}",
        flush=True,
    )
    if args.pass_ == "bwd":
        # Autograd runs a CUDA backward on a worker thread of its own, outside the NVTX range this thread pushes;
        # on the calling thread, the range holds the backward's kernels.
        torch.autograd.set_multithreading_enabled(False)
    for impl in args.impls:
        with forced(args) if impl == "ours" else contextlib.nullcontext():
            if impl == "ours":
                print_plan(args)
            call = make_call(impl, args)
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{impl}_{args.pass_}")
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
