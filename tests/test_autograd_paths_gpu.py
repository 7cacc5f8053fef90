"""The two homes of autograd agree: the C++ library built for the running torch minor version and the Python
registration that every other torch uses (flash_attn_cuda/_ops.py). The Python path runs in a subprocess with
FLASH_ATTN2_PYTHON_AUTOGRAD=1 (read at import); deterministic mode makes the gradients comparable bitwise."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import require_fwd_bwd_kernels, requires_gpu

import flash_attn_cuda
from flash_attn_cuda import _ops

pytestmark = [pytest.mark.gpu, requires_gpu]

# Dense GQA with odd lengths, and a varlen batch; each returns out and the three gradients.
CASES = textwrap.dedent("""
    import torch
    from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func

    def run_cases():
        results = []
        g = torch.Generator(device="cuda").manual_seed(0)
        def rand(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        q, k, v = rand(2, 77, 8, 64), rand(2, 131, 2, 64), rand(2, 131, 2, 64)
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        results += [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
        cu = torch.tensor([0, 40, 41, 140], device="cuda", dtype=torch.int32)
        q, k, v = rand(140, 4, 64), rand(140, 4, 64), rand(140, 4, 64)
        out = flash_attn_varlen_func(q, k, v, cu, cu, 99, 99, causal=True, deterministic=True)
        # Varlen outputs are tensors of their own, not views: a view would turn in-place edits into errors.
        assert out._base is None
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        results += [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
        # The op itself is differentiable too (torch.library.register_autograd on the Python path).
        q, k, v = rand(1, 33, 2, 64), rand(1, 33, 2, 64), rand(1, 33, 2, 64)
        out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, False, True)
        results += [out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))]
        return results
""")


def test_python_autograd_matches_cpp(tmp_path):
    require_fwd_bwd_kernels(64, torch.bfloat16, True)
    require_fwd_bwd_kernels(64, torch.bfloat16, False)
    if not _ops.AUTOGRAD.startswith("C++"):
        pytest.skip(f"no C++ autograd library for torch {torch.__version__} in this build: both runs would be Python")
    namespace = {}
    exec(CASES, namespace)
    expected = namespace["run_cases"]()
    saved = tmp_path / "python_autograd.pt"
    script = CASES + textwrap.dedent(f"""
        from flash_attn_cuda import _ops
        assert _ops.AUTOGRAD == "Python", _ops.AUTOGRAD
        torch.save([t.cpu() for t in run_cases()], {str(saved)!r})
        q, k, v = (torch.randn(2, 65, 4, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        torch.library.opcheck(torch.ops.flash_attn2.fwd.default, (q, k, v, 0.125, True))
        import flash_attn_cuda
        compiled = torch.compile(lambda q, k, v: flash_attn_cuda.flash_attn_func(q, k, v, causal=True), fullgraph=True)
        compiled(q, k, v).sum().backward()
    """)
    env = dict(os.environ, FLASH_ATTN2_PYTHON_AUTOGRAD="1")
    # Run from the directory that holds the imported package, so the subprocess imports the same build.
    cwd = os.path.dirname(os.path.dirname(flash_attn_cuda.__file__))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(saved)
    names = [f"{case} {name}" for case in ("dense", "varlen", "op") for name in ("out", "dq", "dk", "dv")]
    assert len(expected) == len(got) == len(names)
    for name, a, b in zip(names, expected, got):
        assert torch.equal(a.cpu(), b), name
