"""Per-call host overhead of flash_attn_cuda, two builds compared (say, before and after a change to the
host path). Small calls are host-bound, so this times the host side of each call: time.perf_counter around the
call, with no synchronization inside the timed region.

Both builds register their ops as torch.ops.flash_attn2.*, so each runs in its own process. The driver starts
one worker process per build and round, with PYTHONPATH=<that build's directory> prepended, alternating the
order (old new, new old, ...), and compares the medians against a bar: new may be slower than old
by at most max(10% of old, 3 us).

    python bench/call_overhead.py --impl old=/path/to/old --impl new=/path/to/new [--rounds 3] [--out-dir DIR]

Each directory must hold a built `flash_attn_cuda` package (flash_attn_cuda/__init__.py and its _C library),
e.g. a git worktree after `python setup.py build_ext --inplace`; the repository root itself is one. The first
--impl is the baseline. A worker that imports flash_attn_cuda from anywhere else fails.

Shapes (bf16, head dim 128): "b1_s1024", q, k, v (1, 1024, 4, 128), causal; "decode", q (8, 1, 32, 128),
k, v (8, 4096, 4, 128) (GQA 8:1), non-causal. Modes: fwd_nograd (flash_attn_func under torch.no_grad),
fwd_grad (inputs require grad; the forward call, then the release of its graph, timed apart), fwd_bwd
(forward call, then out.backward(dout), timed apart and summed), op_alone (torch.ops.flash_attn2.fwd under
no_grad), op_below (the fwd and bwd ops dispatched below autograd: the op library alone). A trivial op
(torch.ops.aten.add on 8-element tensors), timed at the start and the end of each worker, shows the host's speed
in that process.

Writes call_overhead_<gpu-slug>.json and .md to --out-dir (default bench/results/<gpu>/) and prints the table.
Exit status: 1 if a worker failed (its output is printed), 2 with --strict if a row fails the bar, else 0.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Only bench/ (for common.py): never the repository root, whose flash_attn_cuda would mask a missing package
# in the directory under test.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# (label, description, q shape, k/v shape, causal); bf16, head dim 128.
SHAPES = {
    "b1_s1024": ("batch 1 / 1024 tokens, 4 heads, causal", (1, 1024, 4, 128), (1, 1024, 4, 128), True),
    "decode": (
        "decode step: 8 x 1 query vs 4096 keys, 32/4 heads (GQA 8:1)",
        (8, 1, 32, 128),
        (8, 4096, 4, 128),
        False,
    ),
}
# Mode -> the phases it times, in the order its step returns them.
MODES = {
    "fwd_nograd": ("fwd",),
    "fwd_grad": ("fwd", "release"),
    "fwd_bwd": ("fwd", "bwd", "fwd+bwd"),
    "op_alone": ("op",),
    "op_below": ("fwd", "bwd"),
}
REF_SHAPE, REF_MODE = "reference", "aten.add"  # the trivial op's rows
BAR_REL, BAR_ABS_US = 0.10, 3.0


# ============================================================================================ worker


def stats_us(samples_ns):
    """Median, p10, p90, mean, min and count of a list of nanosecond durations, in microseconds."""
    us = sorted(x / 1000.0 for x in samples_ns)
    if len(us) >= 2:
        dec = statistics.quantiles(us, n=10, method="inclusive")
        p10, p90 = dec[0], dec[8]
    else:
        p10 = p90 = us[0]
    return {
        "median": statistics.median(us),
        "p10": p10,
        "p90": p90,
        "mean": statistics.fmean(us),
        "min": us[0],
        "n": len(us),
    }


def measure(step, n, warmup, sync_every, sync):
    """Calls step() `warmup` times untimed, then n times; step() times its own phases and returns their
    durations in ns. sync() runs every `sync_every` calls, outside every timed region, so that the launch
    queue never fills (the GPU side of a call can outlast its host side). Returns one list per phase."""
    for i in range(warmup):
        if i % sync_every == 0:
            sync()
        step()
    sync()
    samples = []
    for i in range(n):
        if i % sync_every == 0:
            sync()
        samples.append(step())
    sync()
    return [list(col) for col in zip(*samples)]


def make_step(mode, fa, q, k, v, qg, kg, vg, dout, causal, scale):
    """(context manager factory for the whole measurement, step function) of one mode. Each step frees its
    tensors on return, after its last timestamp, except where freeing is a timed phase (fwd_grad's release)."""
    import contextlib

    import torch

    pc = time.perf_counter_ns
    if mode == "fwd_nograd":

        def step():
            t0 = pc()
            out = fa(q, k, v, causal=causal)  # noqa: F841  (freed on return, untimed)
            t1 = pc()
            return (t1 - t0,)

        return torch.no_grad, step
    if mode == "fwd_grad":

        def step():
            t0 = pc()
            out = fa(qg, kg, vg, causal=causal)
            t1 = pc()
            del out  # drops the graph: the autograd node and its saved tensors
            t2 = pc()
            return (t1 - t0, t2 - t1)

        return contextlib.nullcontext, step
    if mode == "fwd_bwd":

        def step():
            qg.grad = kg.grad = vg.grad = None  # untimed: every backward assigns fresh gradients
            t0 = pc()
            out = fa(qg, kg, vg, causal=causal)
            t1 = pc()
            out.backward(dout)
            t2 = pc()
            return (t1 - t0, t2 - t1, t2 - t0)

        return contextlib.nullcontext, step
    if mode == "op_alone":
        op = torch.ops.flash_attn2.fwd

        def step():
            t0 = pc()
            res = op(q, k, v, scale, causal)  # noqa: F841
            t1 = pc()
            return (t1 - t0,)

        return torch.no_grad, step
    if mode == "op_below":
        # The forward and backward ops with no autograd at all (dispatched below it): what the C++ op library
        # costs, apart from the Python wrapper and the autograd machinery.
        fwd_op, bwd_op = torch.ops.flash_attn2.fwd.default, torch.ops.flash_attn2.bwd.default
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            out, lse = fwd_op(q, k, v, scale, causal)

        def step():
            t0 = pc()
            res = fwd_op(q, k, v, scale, causal)  # noqa: F841
            t1 = pc()
            grads = bwd_op(dout, q, k, v, out, lse, scale, causal)  # noqa: F841
            t2 = pc()
            return (t1 - t0, t2 - t1)

        @contextlib.contextmanager
        def below_autograd():
            with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
                yield

        return below_autograd, step
    raise ValueError(f"unknown mode {mode!r}")


def reference_step(device):
    import torch

    a = torch.ones(8, device=device)
    b = torch.ones(8, device=device)
    add = torch.ops.aten.add.Tensor
    pc = time.perf_counter_ns

    def step():
        t0 = pc()
        res = add(a, b)  # noqa: F841
        t1 = pc()
        return (t1 - t0,)

    return step


def run_worker(a):
    t_start = time.perf_counter()
    import traceback

    import torch

    import common
    import flash_attn_cuda

    path = os.path.abspath(flash_attn_cuda.__file__)
    lib = getattr(getattr(flash_attn_cuda, "_C", None), "__file__", None)
    print(
        f"[worker {a.label}] flash_attn_cuda {getattr(flash_attn_cuda, '__version__', '?')} from {path}"
        f" (library {lib}), torch {torch.__version__}",
        flush=True,
    )
    if a.expect_dir:
        want = os.path.abspath(a.expect_dir)
        # Either spelling: the path as found on sys.path, or with symlinks resolved on both sides.
        if os.path.commonpath([want, path]) != want and os.path.commonpath(
            [os.path.realpath(want), os.path.realpath(path)]
        ) != os.path.realpath(want):
            print(
                f"[worker {a.label}] ERROR: flash_attn_cuda was imported from {path}, not from under {want}: that "
                "directory holds no flash_attn_cuda package, or another copy comes first on sys.path",
                file=sys.stderr,
            )
            return 3
    if os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        print(f"[worker {a.label}] WARNING: CUDA_LAUNCH_BLOCKING is set: host times include the GPU's", flush=True)

    if a.cpu_smoke:
        # No GPU: meta tensors go through the same Python wrapper, dispatcher and autograd registration (the
        # fake implementations stand in for the kernels). The times mean nothing; the code path is exercised.
        device, sync = "meta", (lambda: None)
    else:
        if not torch.cuda.is_available():
            print(
                f"[worker {a.label}] ERROR: no CUDA device (use --cpu-smoke to test the script without one)",
                file=sys.stderr,
            )
            return 3
        device, sync = "cuda", torch.cuda.synchronize
    info = common.stamp()
    if a.cpu_smoke:
        info["gpu"] = info["gpu_slug"] = "cpu-smoke"
    res = {
        "label": a.label,
        "expect_dir": a.expect_dir,
        "file": path,
        "library": lib,
        "version": getattr(flash_attn_cuda, "__version__", None),
        "stamp": info,
        "device": device,
        "params": {"n": a.n, "warmup": a.warmup, "sync_every": a.sync_every},
        "rows": [],
        "errors": [],
        "grad_fn": {},
    }
    ref = reference_step(device)

    def add_row(shape, mode, phases, cols):
        for phase, col in zip(phases, cols):
            res["rows"].append({"shape": shape, "mode": mode, "phase": phase, **stats_us(col)})

    with torch.no_grad():
        add_row(REF_SHAPE, REF_MODE, ("start",), measure(ref, a.n, a.warmup, a.sync_every, sync))
    fa = flash_attn_cuda.flash_attn_func
    for shape in a.shapes:
        _, q_shape, kv_shape, causal = SHAPES[shape]
        torch.manual_seed(0)
        q = torch.randn(q_shape, device=device, dtype=torch.bfloat16)
        k = torch.randn(kv_shape, device=device, dtype=torch.bfloat16)
        v = torch.randn(kv_shape, device=device, dtype=torch.bfloat16)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn(q_shape, device=device, dtype=torch.bfloat16)
        scale = q_shape[-1] ** -0.5
        for mode in a.modes:
            try:
                if mode == "fwd_grad":  # which autograd registration this build uses: the log's proof
                    res["grad_fn"][shape] = type(fa(qg, kg, vg, causal=causal).grad_fn).__name__
                ctx, step = make_step(mode, fa, q, k, v, qg, kg, vg, dout, causal, scale)
                with ctx():
                    cols = measure(step, a.n, a.warmup, a.sync_every, sync)
                add_row(shape, mode, MODES[mode], cols)
                last = res["rows"][-len(MODES[mode]) :]
                print(
                    f"[worker {a.label}] {shape:9s} {mode:10s} "
                    + "  ".join(
                        f"{r['phase']} {r['median']:7.2f} us (p10 {r['p10']:.2f}, p90 {r['p90']:.2f})" for r in last
                    ),
                    flush=True,
                )
            except Exception as exc:
                traceback.print_exc()
                res["errors"].append(f"{shape} {mode}: {type(exc).__name__}: {exc}".splitlines()[0][:400])
                try:
                    sync()
                except Exception:
                    pass
        del q, k, v, qg, kg, vg, dout
    with torch.no_grad():
        add_row(REF_SHAPE, REF_MODE, ("end",), measure(ref, a.n, a.warmup, a.sync_every, sync))
    ends = [r for r in res["rows"] if r["shape"] == REF_SHAPE]
    print(
        f"[worker {a.label}] trivial op (aten.add): start {ends[0]['median']:.2f} us, "
        f"end {ends[-1]['median']:.2f} us;"
        f" grad_fn {res['grad_fn']}",
        flush=True,
    )
    res["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text)
    else:
        print("RESULT " + text)
    for e in res["errors"]:
        print(f"[worker {a.label}] ERROR {e}", file=sys.stderr)
    return 1 if res["errors"] else 0


# ============================================================================================ driver

# Environment variables per implementation: --impl NAME=DIR@VAR=VALUE[,VAR=VALUE] (e.g. the same build with
# FLASH_ATTN2_PYTHON_AUTOGRAD=1).
IMPL_ENV = {}


def parse_impl(text):
    name, sep, rest = text.partition("=")
    path, at, env_text = rest.rpartition("@")
    if not at or "=" not in env_text:  # no environment part (a directory name may hold '@')
        path, env_text = rest, ""
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--impl takes NAME=DIR[@VAR=VALUE,...], got {text!r}")
    env = {}
    for item in filter(None, env_text.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise argparse.ArgumentTypeError(f"--impl {text!r}: expected VAR=VALUE after '@', got {item!r}")
        env[var] = value
    IMPL_ENV[name] = env
    return name, os.path.abspath(os.path.expanduser(path))


def dir_commit(path):
    """The short commit of a directory that is the top of a git work tree, else None (a copied package has none)."""
    try:
        top = subprocess.run(
            ["git", "-C", path, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10
        )
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(path):
            return None
        head = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        return head.stdout.strip() or None
    except Exception:
        return None


def tail(text, lines=40):
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_one(a, name, path, round_idx, tmp):
    """One worker process; returns (result dict or None, failure message or None)."""
    json_out = os.path.join(tmp, f"{name}_round{round_idx}.json")
    cmd = [
        sys.executable,
        "-u",
        os.path.abspath(__file__),
        "--worker",
        "--label",
        name,
        "--expect-dir",
        path,
        "--json-out",
        json_out,
        "--n",
        str(a.n),
        "--warmup",
        str(a.warmup),
        "--sync-every",
        str(a.sync_every),
        "--shapes",
        ",".join(a.shapes),
        "--modes",
        ",".join(a.modes),
    ]
    if a.cpu_smoke:
        cmd.append("--cpu-smoke")
    env = dict(os.environ, **IMPL_ENV.get(name, {}))
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.perf_counter() - t0
    if a.verbose:
        print(out.rstrip())
    res = None
    if os.path.exists(json_out):
        with open(json_out) as f:
            res = json.load(f)
        res["process_wall_s"] = wall
        res["log"] = out
    if rc == 0 and res is not None:
        print(
            f"[call_overhead] round {round_idx + 1} {name}: {wall:.1f} s, flash_attn_cuda from {res['file']}, "
            f"grad_fn {', '.join(sorted(set(res['grad_fn'].values()))) or 'n/a'}",
            flush=True,
        )
        return res, None
    last = [ln for ln in err.splitlines() if ln.strip()]
    msg = f"round {round_idx + 1} {name}: worker exit {rc} after {wall:.1f} s"
    if last:
        msg += f" ({last[-1].strip()[:200]})"
    print(
        f"[call_overhead] FAILED {msg}\n--- stdout (tail) ---\n{tail(out)}\n--- stderr (tail) ---\n{tail(err)}\n---",
        flush=True,
    )
    return res, msg


def aggregate(per_impl):
    """{impl: [worker result, ...]} -> {(shape, mode, phase): {impl: summary over rounds}}."""
    cells = {}
    for name, results in per_impl.items():
        acc = {}
        for res in results:
            for r in res["rows"]:
                acc.setdefault((r["shape"], r["mode"], r["phase"]), []).append(r)
        for key, rows in acc.items():
            meds = [r["median"] for r in rows]
            cells.setdefault(key, {})[name] = {
                "median": statistics.median(meds),
                "round_min": min(meds),
                "round_max": max(meds),
                "p10": statistics.median(r["p10"] for r in rows),
                "p90": statistics.median(r["p90"] for r in rows),
                "mean": statistics.median(r["mean"] for r in rows),
                "round_medians": meds,
                "rounds": len(meds),
            }
    return cells


def verdict(old, new):
    """(new - old in us, in % of old, allowed slowdown in us, PASS/FAIL) by the bar."""
    diff = new - old
    allowed = max(BAR_REL * old, BAR_ABS_US)
    return diff, 100.0 * diff / old if old else float("nan"), allowed, "PASS" if diff <= allowed else "FAIL"


def row_order(cells):
    order = []
    for shape in [REF_SHAPE] + list(SHAPES):
        for mode in [REF_MODE] + list(MODES):
            for phase in ("start", "end") + tuple(p for ph in MODES.values() for p in ph):
                if (shape, mode, phase) in cells and (shape, mode, phase) not in order:
                    order.append((shape, mode, phase))
    return order


def build_report(meta, impls, cells):
    names = [n for n, _ in impls]
    base, others = names[0], names[1:]
    rows, failing, missing = [], [], []
    for key in row_order(cells):
        shape, mode, phase = key
        c = cells[key]
        row = {"shape": shape, "mode": mode, "phase": phase, "impls": c, "vs": {}}
        for o in others:
            if base in c and o in c:
                diff, pct, allowed, v = verdict(c[base]["median"], c[o]["median"])
                if shape == REF_SHAPE:
                    v = "ref"  # the host's speed, not a flash_attn_cuda call
                elif v == "FAIL":
                    failing.append(f"{o}: {shape} {mode} {phase}")
                row["vs"][o] = {"diff_us": diff, "diff_pct": pct, "allowed_us": allowed, "verdict": v}
            else:
                row["vs"][o] = {"verdict": "n/a"}
                if shape != REF_SHAPE:
                    missing.append(f"{o}: {shape} {mode} {phase}")
        rows.append(row)

    lines = [
        "# Per-call host overhead",
        "",
        f"{meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta.get('torch')} "
        f"(CUDA {meta.get('cuda')}), rounds: {meta['rounds']}.",
        "",
    ]
    for n, path in impls:
        i = meta["impls"][n]
        env = "".join(f" {k}={v}" for k, v in i.get("env", {}).items())
        lines.append(
            f"- `{n}`: `{path}`{env} (commit {i['commit'] or 'n/a'}; flash_attn_cuda {i['version']} from "
            f"`{i['file']}`; autograd node {i['grad_fn'] or 'n/a'})"
        )
    lines += [
        "",
        f"Host time per call in microseconds: time.perf_counter around the call, no synchronization inside "
        f"the timed region, torch.cuda.synchronize every {meta['params']['sync_every']} calls outside it; "
        f"{meta['params']['warmup']} untimed warm-up calls, then {meta['params']['n']} timed calls per round. "
        f"Each build runs in its own process per round, the order alternating ({', '.join(meta['order'])}). "
        "A cell is the median over rounds of the per-round medians, with the lowest and highest round median "
        "in parentheses. "
        + (
            f"Bar: `{'`, `'.join(others)}` may be slower than `{base}` by at most max({BAR_REL:.0%} of {base}, "
            f"{BAR_ABS_US:g} us). "
            if others
            else ""
        )
        + "Reference rows: the trivial op aten.add on 8 elements at the start and end of "
        "each process, the host's speed.",
        "",
        "Shapes (bf16, head dim 128): " + "; ".join(f"`{k}`: {v[0]}" for k, v in SHAPES.items()) + ". Modes: "
        "`fwd_nograd` flash_attn_func under no_grad; `fwd_grad` inputs requiring grad, the forward call and "
        "the release of its graph (`del out`) timed apart; `fwd_bwd` the forward call and `out.backward(dout)`; "
        "`op_alone` torch.ops.flash_attn2.fwd under no_grad; `op_below` the fwd and bwd ops dispatched below "
        "autograd (the op library alone).",
        "",
    ]
    head = "| shape | mode | phase | " + " | ".join(f"{n} us" for n in names)
    head += "".join(f" | {o}-{base} us | {o}-{base} % | allowed us | {o} |" for o in others) or " |"
    lines += [head, "|---" * (3 + len(names) + 4 * len(others)) + "|"]
    for r in rows:
        cells_txt = []
        for n in names:
            c = r["impls"].get(n)
            cells_txt.append(
                "n/a"
                if c is None
                else f"{c['median']:.2f} ({c['round_min']:.2f}-{c['round_max']:.2f})"
                if c["rounds"] > 1
                else f"{c['median']:.2f}"
            )
        line = f"| {r['shape']} | {r['mode']} | {r['phase']} | " + " | ".join(cells_txt)
        for o in others:
            vs = r["vs"][o]
            if "diff_us" in vs:
                allowed = "-" if r["shape"] == REF_SHAPE else f"{vs['allowed_us']:.2f}"
                line += f" | {vs['diff_us']:+.2f} | {vs['diff_pct']:+.1f}% | {allowed} | {vs['verdict']} |"
            else:
                line += f" | n/a | n/a | n/a | {vs['verdict']} |"
        lines.append(line if others else line + " |")
    lines.append("")
    if others:
        n_rows = sum(1 for r in rows if r["shape"] != REF_SHAPE) * len(others)
        overall = "FAIL" if failing else "INCOMPLETE" if missing else "PASS"
        lines.append(
            f"**Bar: {overall}** ({n_rows - len(failing) - len(missing)}/{n_rows} rows measured and within it"
            + (f"; {len(missing)} not measured" if missing else "")
            + ("; over it: " + ", ".join(failing) if failing else "")
            + ")."
        )
    if meta["failures"]:
        lines += ["", "Worker failures: " + "; ".join(meta["failures"])]
    return "\n".join(lines) + "\n", rows, failing + missing


def run_driver(a, parser):
    if not a.impl:
        parser.error(
            "give at least one --impl NAME=DIR (the first is the baseline), e.g. --impl old=DIR --impl new=DIR"
        )
    names = [n for n, _ in a.impl]
    if len(set(names)) != len(names):
        parser.error("--impl names must differ")
    for n, path in a.impl:
        if not os.path.isfile(os.path.join(path, "flash_attn_cuda", "__init__.py")):
            parser.error(f"--impl {n}={path}: no flash_attn_cuda/__init__.py there")
    t0 = time.perf_counter()
    per_impl = {n: [] for n in names}
    failures, order = [], []
    with tempfile.TemporaryDirectory(prefix="call_overhead_") as tmp:
        for r in range(a.rounds):
            # Round r starts with the r-th build: old new, new old, ... so that neither always runs first.
            k = r % len(a.impl)
            for name, path in a.impl[k:] + a.impl[:k]:
                order.append(name)
                res, err = run_one(a, name, path, r, tmp)
                if res is not None:
                    per_impl[name].append(res)
                if err:
                    failures.append(err)

    import common  # imports torch (no CUDA context in this process): after the workers, off their clock

    first = next((res for results in per_impl.values() for res in results), None)
    st = first["stamp"] if first else {}
    gpu = st.get("gpu", "unknown")
    meta = {
        "title": "Per-call host overhead",
        "gpu": gpu,
        "commit": common.git_commit(),
        "date": common.utc_now(),
        "torch": st.get("torch"),
        "cuda": st.get("cuda"),
        "rounds": a.rounds,
        "order": order,
        "params": {"n": a.n, "warmup": a.warmup, "sync_every": a.sync_every},
        "shapes": {
            k: {"desc": v[0], "q": v[1], "kv": v[2], "causal": v[3]} for k, v in SHAPES.items() if k in a.shapes
        },
        "bar": {"rel": BAR_REL, "abs_us": BAR_ABS_US},
        "failures": failures,
        "impls": {},
    }
    for n, path in a.impl:
        got = per_impl[n]
        meta["impls"][n] = {
            "dir": path,
            "commit": dir_commit(path),
            "env": IMPL_ENV.get(n, {}),
            "file": got[0]["file"] if got else None,
            "library": got[0]["library"] if got else None,
            "version": got[0]["version"] if got else None,
            "grad_fn": ", ".join(sorted(set(got[0]["grad_fn"].values()))) or None if got else None,
            "worker_wall_s": [round(g["process_wall_s"], 2) for g in got],
            "worker_errors": [e for g in got for e in g["errors"]],
        }
    cells = aggregate(per_impl)
    md, rows, failing = build_report(meta, a.impl, cells)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    out_dir = a.out_dir
    if out_dir is None:
        # Not under bench/results/ when there is nothing to keep: a smoke test, or no worker came back.
        out_dir = (
            os.path.join(tempfile.gettempdir(), "call_overhead_smoke" if a.cpu_smoke else "call_overhead_failed")
            if a.cpu_smoke or first is None
            else os.path.join(common.RESULTS, common.gpu_dir(gpu))
        )
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"call_overhead_{common.slug(gpu)}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "workers": per_impl}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(md)
    print("\n" + md)
    print(f"[call_overhead] {len(order)} workers in {meta['wall_s']:.1f} s; wrote {base}.json, .md")
    if failures:
        print(f"[call_overhead] {len(failures)} worker(s) failed: " + "; ".join(failures), file=sys.stderr)
        return 1
    if failing and a.strict:
        return 2
    return 0


# ============================================================================================== main


def csv_list(choices):
    def parse(text):
        items = [s for s in text.split(",") if s]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items

    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--impl",
        action="append",
        type=parse_impl,
        default=[],
        metavar="NAME=DIR",
        help="a build to time: NAME=directory holding its flash_attn_cuda package (repeat; the first is the baseline)",
    )
    p.add_argument("--rounds", type=int, default=3, help="worker processes per build, alternating (default 3)")
    p.add_argument("--n", type=int, default=300, help="timed calls per shape, mode and round (default 300)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls before them (default 50)")
    # Every call by default: the backward's GPU work outlasts its host side, and with GPU work queued, a call's
    # host time can include waiting on it (an allocation, the autograd engine); so every call starts idle.
    p.add_argument(
        "--sync-every",
        type=int,
        default=1,
        help="torch.cuda.synchronize every this many calls, outside the timed region (default 1)",
    )
    p.add_argument(
        "--shapes", type=csv_list(list(SHAPES)), default=list(SHAPES), help="default: all, " + ",".join(SHAPES)
    )
    p.add_argument("--modes", type=csv_list(list(MODES)), default=list(MODES), help="default: all, " + ",".join(MODES))
    p.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=None,
        help="default bench/results/<gpu>/, e.g. bench/results/h200/",
    )
    p.add_argument("--timeout", type=float, default=180, help="seconds one worker may take (default 180)")
    p.add_argument("--strict", action="store_true", help="exit 2 if a row fails the bar")
    p.add_argument("--verbose", action="store_true", help="print every worker's log")
    w = p.add_argument_group("worker mode (what the driver runs, one build per process)")
    w.add_argument("--worker", action="store_true", help="time the flash_attn_cuda found on sys.path")
    w.add_argument("--label", default="impl")
    w.add_argument("--expect-dir", default=None, help="fail unless flash_attn_cuda comes from under this directory")
    w.add_argument("--json-out", default=None, help="write the result here (default: a RESULT line on stdout)")
    # Testing without a GPU: meta tensors through the same code path; the times are meaningless.
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.n < 2 or a.warmup < 0 or a.sync_every < 1 or a.rounds < 1:
        p.error("need --n >= 2, --warmup >= 0, --sync-every >= 1, --rounds >= 1")
    if a.worker:
        return run_worker(a)
    return run_driver(a, p)


if __name__ == "__main__":
    sys.exit(main())
