"""A call that runs out of GPU memory raises, and the process goes on: the buffers the ops allocate go through the
stable ABI's allocator shim, whose failure must reach Python as an exception (RuntimeError: the stable ABI carries
no exception types, so not torch.OutOfMemoryError), never as a crash. Each case runs in a subprocess, so that a
crash fails the case instead of the test worker, and so that its memory limit (torch's per-process fraction, which
makes the caching allocator refuse what would pass it) binds no other test."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import require_fwd_bwd_kernels, requires_gpu

import flash_attn_cuda

pytestmark = [pytest.mark.gpu, requires_gpu]

# argv: pass ("fwd" or "bwd"), deterministic ("0" or "1"). Prints "raised <type>" or "no error", then
# "recovered" once the same call has run again within the whole GPU's memory and given finite results.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from flash_attn_cuda import flash_attn_func

    pass_, deterministic = sys.argv[1], sys.argv[2] == "1"
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic) if pass_ == "bwd" else None
    dout = torch.randn_like(out) if pass_ == "bwd" else None

    def call():
        if pass_ == "bwd":
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return (flash_attn_func(q, k, v, causal=True),)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Room for 1 MiB beyond what the process holds. Every tensor here and every large one of the call (out, or dq,
    # dk, dv and the float32 dq accumulator) is 16 MiB or more, which the caching allocator gives a memory segment
    # of its own, sized to fit: no free space is left over in the segments the process holds, so the call's
    # first large tensor needs a new segment, which the limit refuses.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (1 << 20)) / total)
    try:
        call()
    except RuntimeError as e:
        print("raised", type(e).__name__, flush=True)
    else:
        print("no error", flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    results = call()
    torch.cuda.synchronize()
    assert all(bool(t.isfinite().all()) for t in results)
    print("recovered", flush=True)
""")


@pytest.mark.parametrize(
    "pass_, deterministic, python_autograd",
    [("fwd", False, False), ("bwd", False, False), ("bwd", True, False), ("bwd", False, True)],
    ids=["fwd", "bwd", "bwd-deterministic", "bwd-python-autograd"],
)
def test_out_of_memory_raises(pass_, deterministic, python_autograd):
    require_fwd_bwd_kernels(128, torch.bfloat16, True)
    env = dict(os.environ)
    if python_autograd:
        env["FLASH_ATTN2_PYTHON_AUTOGRAD"] = "1"
    # Run from the directory that holds the imported package, so the subprocess imports the same build.
    cwd = os.path.dirname(os.path.dirname(flash_attn_cuda.__file__))
    # -X faulthandler: a crash prints the Python frame it happened under into the report.
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", SCRIPT, pass_, "1" if deterministic else "0"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    lines = result.stdout.split()
    assert "raised" in lines, "the memory limit did not make the call fail:\n" + report
    assert "recovered" in lines, report
