"""``python -m flash_attn_cuda.info``: the kernel-image rule, the exit status, the rendering with and without build
metadata, and the self-test's arithmetic, all without a GPU; one GPU test runs the module for real."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import requires_gpu

import flash_attn_cuda
from flash_attn_cuda import info
from flash_attn_cuda.reference import attention_ref

# The subprocess runs from the folder holding the package these tests import (the checkout's root, or
# site-packages for an installed wheel), so that `-m` finds that same package first.
PACKAGE_PARENT = Path(flash_attn_cuda.__file__).resolve().parent.parent

# The _build_info.py that setup.py writes.
BUILD_INFO_TEXT = """\
VERSION = "0.2.0+cu13"
TORCH_VERSION = "2.14.1+cu130"     # torch the build compiled against
CUDA_VERSION = "13.0"              # nvcc's version
TORCH_TARGET_VERSION = "2.11"      # oldest torch the stable-ABI build runs on
ARCHS = ("80", "90a")              # SASS archs
PTX_ARCHS = ("80",)                # embedded PTX
MMA_SYNC_SM90_FROM_PTX = {"fwd": (64, 128), "bwd": (256,)}
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("fp16", "bf16")
"""

BUILD = {
    "version": "0.2.0+cu13",
    "torch_version": "2.14.1+cu130",
    "cuda_version": "13.0",
    "torch_target_version": "2.11",
    "archs": ["80", "90a"],
    "ptx_archs": ["80"],
    "mma_sync_sm90_from_ptx": {"fwd": [64, 128], "bwd": [256]},
    "head_dims": [32, 64, 96, 128, 160, 192, 224, 256],
    "dtypes": ["fp16", "bf16"],
}


def run_module(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "flash_attn_cuda.info", *args],
        cwd=PACKAGE_PARENT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---------------------------------------------------------------- the module as a user runs it


def test_module_without_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = run_module(env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("flash_attn_cuda "), result.stdout
    assert "no CUDA GPU found: self-test skipped" in lines, result.stdout
    assert f"torch {torch.__version__}" in result.stdout


@pytest.mark.gpu
@requires_gpu
def test_module_on_gpu():
    result = run_module()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernel image: none" not in result.stdout
    assert "self-test: PASS" in result.stdout, result.stdout
    assert result.stdout.count(" PASS") == 5, result.stdout  # out, dq, dk, dv and the summary


# ---------------------------------------------------------------- the kernel-image rule

SASS_80_90A = ("80", "90a")


@pytest.mark.parametrize(
    "capability, archs, ptx_archs, expected",
    [
        # sm_80 SASS runs on every 8.x at or above 8.0, never on another major.
        ((8, 0), ("80",), (), ("sass", "80")),
        ((8, 6), ("80",), (), ("sass", "80")),
        ((8, 9), ("80",), (), ("sass", "80")),
        ((9, 0), ("80",), (), None),
        ((9, 0), ("80",), ("80",), ("ptx", "80")),
        # Arch-specific 90a only on 9.0 exactly; elsewhere the PTX, if any.
        ((9, 0), SASS_80_90A, ("80",), ("sass", "90a")),
        ((9, 0), SASS_80_90A, (), ("sass", "90a")),
        ((9, 1), ("90a",), (), None),
        ((8, 6), ("90a",), (), None),
        # PTX compute_80 is JIT-compiled on anything newer.
        ((10, 0), SASS_80_90A, ("80",), ("ptx", "80")),
        ((12, 0), SASS_80_90A, ("80",), ("ptx", "80")),
        ((10, 0), SASS_80_90A, (), None),
        ((12, 0), SASS_80_90A, (), None),
        # The closest SASS wins; PTX never beats SASS.
        ((8, 6), ("80", "86"), ("80",), ("sass", "86")),
        ((8, 9), ("80", "86"), (), ("sass", "86")),
        ((8, 0), ("80", "86"), ("86",), ("sass", "80")),
        ((9, 0), ("80",), ("80", "90"), ("ptx", "90")),
        ((8, 6), (), ("80", "90"), ("ptx", "80")),
        # Family-specific SASS runs within its major, at or above its minor.
        ((10, 3), ("100f",), (), ("sass", "100f")),
        ((12, 0), ("100f",), (), None),
        # Below 8.0 nothing runs, whatever the build holds.
        ((7, 5), SASS_80_90A, ("80",), None),
        ((7, 5), ("75",), ("75",), None),
        ((7, 0), (), ("80",), None),
    ],
)
def test_kernel_image(capability, archs, ptx_archs, expected):
    assert info.kernel_image(capability, archs, ptx_archs) == expected


def test_describe_image():
    assert info.describe_image(("sass", "90a")) == "sm_90a SASS"
    assert info.describe_image(("sass", "80")) == "sm_80 SASS"
    assert info.describe_image(("ptx", "80")) == "compute_80 PTX, JIT-compiled at first use"


def test_parse_arch():
    assert info.parse_arch("90a") == (9, 0, "a")
    assert info.parse_arch("sm_86") == (8, 6, "")
    assert info.parse_arch("compute_120") == (12, 0, "")
    with pytest.raises(ValueError):
        info.parse_arch("hopper")


# ---------------------------------------------------------------- build metadata and versions


def test_class_images():
    # sm_80 SASS runs on every sm_8x GPU; sm_120 JIT-compiles the compute_80 PTX; Hopper takes its sm_90a SASS.
    rows = {row["capability"]: row for row in info.class_images(["80", "90a"], ["80"])}
    assert rows["8.0"]["image"] == ["sass", "80"] and "163 KiB tiles" in rows["8.0"]["text"]
    assert rows["8.6"]["image"] == ["sass", "80"] and "99 KiB tiles" in rows["8.6"]["text"]
    assert rows["8.9"]["image"] == ["sass", "80"] and "99 KiB tiles" in rows["8.9"]["text"]
    assert rows["9.0"]["image"] == ["sass", "90a"] and "wgmma" in rows["9.0"]["text"]
    assert rows["12.0"]["image"] == ["ptx", "80"] and "JIT" in rows["12.0"]["text"]
    # Hopper without sm_90a SASS runs the mma.sync kernels, JIT-compiled from the PTX (sm_80 SASS is for sm_8x).
    rows = {row["capability"]: row for row in info.class_images(["80"], ["80"])}
    assert rows["9.0"]["image"] == ["ptx", "80"] and "wgmma" not in rows["9.0"]["text"], rows["9.0"]
    # The release build leaves out the sm_90a SASS of the mma.sync kernels that Hopper runs only under an
    # override, and says which run from the PTX.
    rows = {row["capability"]: row for row in info.class_images(["80", "90a"], ["80"], {"fwd": (64,), "bwd": ()})}
    assert rows["9.0"]["image"] == ["sass", "90a"], rows["9.0"]
    assert "wgmma" in rows["9.0"]["text"] and "forward at head dims 64 from compute_80 PTX" in rows["9.0"]["text"]
    assert "PTX" not in info.class_images(["80", "90a"], ["80"], {"fwd": (), "bwd": ()})[4]["text"]
    # A Hopper-only build has nothing for the others.
    rows = {row["capability"]: row for row in info.class_images(["90a"], [])}
    assert rows["8.6"]["image"] is None and rows["8.6"]["text"] == "no kernel image in this build"


def test_load_build_info(tmp_path):
    path = tmp_path / "_build_info.py"
    path.write_text(BUILD_INFO_TEXT)
    assert info.load_build_info(path) == BUILD
    assert info.load_build_info(tmp_path / "missing.py") is None


@pytest.mark.parametrize(
    "torch_version, torch_cuda, build, expected",
    [
        ("2.14.1+cu130", "13.0", BUILD, []),
        ("2.11.0+cu130", "13.2", BUILD, []),
        ("2.10.0+cu130", "13.0", BUILD, ["older than 2.11"]),
        ("2.14.1+cu128", "12.8", BUILD, ["CUDA 13.x but torch uses CUDA 12.8"]),
        ("2.14.1+cpu", None, BUILD, ["without CUDA"]),
        # Without a stable-ABI minimum the build needs the torch minor it was compiled against.
        ("2.13.0+cu130", "13.0", {**BUILD, "torch_target_version": None}, ["only runs on that torch minor"]),
        ("2.14.0+cu130", "13.0", {**BUILD, "torch_target_version": None}, []),
        ("2.14.1+cu130", "13.0", None, []),
    ],
)
def test_version_problems(torch_version, torch_cuda, build, expected):
    runtime = {"torch_version": torch_version, "torch_cuda": torch_cuda}
    problems = info.version_problems(build, runtime)
    assert len(problems) == len(expected), problems
    for problem, text in zip(problems, expected):
        assert text in problem


# ---------------------------------------------------------------- exit status and main


def gpu(capability="9.0", image=("sass", "90a"), supported=True):
    return {
        "index": 0,
        "name": "Fake GPU",
        "capability": capability,
        "sm_count": 132,
        "smem_per_block_optin": 232448,
        "supported": supported,
        "image": list(image) if image else None,
        "image_text": info.describe_image(image) if image else "none: ...",
    }


def base_facts(**changes):
    facts = {
        "version": BUILD["version"],
        "build_info_found": True,
        "build": dict(BUILD),
        "runtime": {"python": "3.11", "torch_version": "2.14.1+cu130", "torch_cuda": "13.0", "driver_cuda": "13.0"},
        "extension": {
            "loaded": True,
            "error": None,
            "hints": [],
            "compiled": {"count": 4, "head_dims": [64], "dtypes": ["bf16"], "pairs": [[64, "bf16", True]]},
        },
        "warnings": [],
        "gpus": [],
        "device": None,
        "self_test": None,
    }
    facts.update(changes)
    return facts


def self_test_result(passed):
    """A self-test result as info.self_test returns it; with ``passed`` False, dq fails."""
    checks = [
        {
            "name": n,
            "error": 1e-3,
            "bound": 2e-3 if passed or n != "dq" else 5e-4,
            "nan": 0,
            "passed": passed or n != "dq",
        }
        for n in ("out", "dq", "dk", "dv")
    ]
    return {
        "ran": True,
        "device": "cuda:0",
        **info.SELF_TEST_SHAPE,
        "head_dim": 64,
        "dtype": "bf16",
        "causal": True,
        "checks": checks,
        "passed": passed,
        "call_s": 0.01,
        "total_s": 0.2,
    }


PASSED = self_test_result(True)
FAILED = self_test_result(False)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"self_test": {"ran": False, "skipped": "no CUDA GPU found"}}, info.EXIT_OK),
        ({"gpus": [gpu()], "device": 0, "self_test": PASSED}, info.EXIT_OK),
        ({"gpus": [gpu()], "device": 0, "self_test": FAILED}, info.EXIT_SELF_TEST_FAILED),
        (
            {"gpus": [gpu()], "device": 0, "self_test": {"ran": False, "passed": False, "error": "no kernels"}},
            info.EXIT_SELF_TEST_FAILED,
        ),
        ({"gpus": [gpu("10.0", None)], "device": 0}, info.EXIT_NO_KERNEL_IMAGE),
        ({"gpus": [gpu("7.5", None, supported=False)], "device": 0}, info.EXIT_NO_KERNEL_IMAGE),
        (
            {"extension": {"loaded": False, "error": "ImportError: x", "hints": [], "compiled": None}},
            info.EXIT_IMPORT_FAILED,
        ),
    ],
)
def test_exit_status(changes, expected):
    assert info.exit_status(base_facts(**changes)) == expected


def fake_collect(monkeypatch, facts):
    monkeypatch.setattr(info, "collect", lambda: (facts, object()))


@pytest.mark.parametrize("passed", [True, False])
def test_main_self_test_result(monkeypatch, capsys, passed):
    fake_collect(monkeypatch, base_facts(gpus=[gpu()], device=0))
    monkeypatch.setattr(info, "self_test", lambda package, compiled, device: self_test_result(passed))
    status = info.main([])
    out = capsys.readouterr().out
    assert status == (info.EXIT_OK if passed else info.EXIT_SELF_TEST_FAILED)
    assert "Fake GPU, compute capability 9.0, 132 SMs" in out
    assert "kernel image: sm_90a SASS" in out
    assert f"self-test: {'PASS' if passed else 'FAIL'}" in out
    assert ("dq   max|ours - ref| = 1.000e-03  bound 5.000e-04  FAIL" in out) != passed


def test_main_no_kernel_image(monkeypatch, capsys):
    fake_collect(monkeypatch, base_facts(gpus=[gpu("10.0", None)], device=0))
    monkeypatch.setattr(info, "self_test", lambda *a: pytest.fail("the self-test must not run"))
    assert info.main([]) == info.EXIT_NO_KERNEL_IMAGE
    assert "self-test skipped: no kernel image" in capsys.readouterr().out


def test_main_import_failure(monkeypatch, capsys):
    error = "ImportError: _C.abi3.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"
    monkeypatch.setattr(info, "import_package", lambda: (None, error))
    monkeypatch.setattr(info, "load_build_info", lambda: dict(BUILD))
    assert info.main([]) == info.EXIT_IMPORT_FAILED
    out = capsys.readouterr().out
    assert f"FAILED to import: {error}" in out
    assert "hint: the extension was built against another torch" in out
    assert "self-test skipped: the extension could not be imported" in out
    # The versions are still reported.
    assert "built with   torch 2.14.1+cu130, CUDA 13.0, runs on torch >= 2.11" in out
    assert "flash_attn_cuda 0.2.0+cu13" in out


def test_import_hints():
    runtime = {"torch_version": "2.14.1+cu128", "torch_cuda": "12.8"}
    hints = info.import_hints("ImportError: libcudart.so.13: cannot open shared object file", BUILD, runtime)
    assert "CUDA library is missing" in hints[0]
    assert any("install the flash_attn_cuda wheel for cu12" in h for h in hints)
    hints = info.import_hints("ModuleNotFoundError: No module named 'flash_attn_cuda._C'", None, runtime)
    assert "compiled extension is missing" in hints[0]
    hints = info.import_hints("ImportError: cannot import name '_C' from 'flash_attn_cuda'", BUILD, runtime)
    assert "compiled extension is missing" in hints[0]


def test_render_with_build_info(monkeypatch, capsys):
    monkeypatch.setattr(info, "load_build_info", lambda: dict(BUILD))
    assert info.main(["--no-self-test"]) == info.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("flash_attn_cuda 0.2.0+cu13\n")
    assert "archs        SASS sm_80, sm_90a; PTX embedded: yes, compute_80" in out
    assert "head dims    32 64 96 128 160 192 224 256" in out
    assert "dtypes       fp16 bf16" in out
    assert "self-test skipped (--no-self-test)" in out


def test_unreadable_build_info(monkeypatch, capsys):
    def broken():
        raise SyntaxError("invalid syntax")

    monkeypatch.setattr(info, "load_build_info", broken)
    assert info.main(["--no-self-test"]) == info.EXIT_OK
    out = capsys.readouterr().out
    assert "warning: could not read _build_info.py: SyntaxError" in out
    assert "built with   torch unknown" in out


def test_render_without_build_info(monkeypatch, capsys):
    monkeypatch.setattr(info, "load_build_info", lambda: None)
    info.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert "built with   torch unknown, CUDA unknown" in out
    assert "archs        SASS unknown; PTX embedded: unknown" in out
    assert "(from the compiled kernels)" in out


def test_json(monkeypatch, capsys):
    monkeypatch.setattr(info, "load_build_info", lambda: dict(BUILD))
    assert info.main(["--json", "--no-self-test"]) == info.EXIT_OK
    facts = json.loads(capsys.readouterr().out)
    assert facts["build"] == BUILD
    assert facts["runtime"]["torch_version"] == str(torch.__version__)
    assert facts["extension"]["loaded"] and facts["extension"]["compiled"]["count"] > 0
    assert facts["exit_status"] == 0


# ---------------------------------------------------------------- the self-test


@pytest.mark.parametrize(
    "pairs, expected",
    [
        ([[64, "bf16", True], [64, "fp16", True], [128, "bf16", True]], (64, "bf16", True)),
        ([[128, "bf16", True], [256, "bf16", True], [64, "fp16", True]], (128, "bf16", True)),
        ([[64, "fp16", False], [96, "fp16", True]], (96, "fp16", True)),
        ([[64, "bf16", False]], (64, "bf16", False)),
        ([], None),
    ],
)
def test_self_test_config(pairs, expected):
    assert info.self_test_config({"pairs": pairs}) == expected


class ReferencePackage:
    """Stands in for flash_attn_cuda on the CPU: attention in the input dtype, plus ``offset`` on the output."""

    def __init__(self, offset=0.0):
        self.offset = offset

    def flash_attn_func(self, q, k, v, causal=False):
        return attention_ref(q, k, v, causal=causal, upcast=False)[0] + self.offset


@pytest.mark.parametrize("offset", [0.0, 0.05])
def test_self_test_arithmetic(offset):
    result = info.self_test(ReferencePackage(offset), {"pairs": [[64, "bf16", True]]}, torch.device("cpu"))
    assert "error" not in result, result.get("traceback")
    assert [c["name"] for c in result["checks"]] == ["out", "dq", "dk", "dv"]
    passed = {c["name"]: c["passed"] for c in result["checks"]}
    # The low-precision reference itself is within the bound; an offset on the output is not (and leaves the
    # gradients alone).
    assert passed == {"out": offset == 0.0, "dq": True, "dk": True, "dv": True}
    assert result["passed"] == (offset == 0.0)
    lines = info.render_self_test(result)
    assert lines[-1].startswith(f"self-test: {'PASS' if offset == 0.0 else 'FAIL'} in ")


def test_self_test_error_is_a_failure():
    class Broken:
        def flash_attn_func(self, *args, **kwargs):
            raise RuntimeError("no kernel image is available for execution on the device")

    result = info.self_test(Broken(), {"pairs": [[64, "fp16", True]]}, torch.device("cpu"))
    assert not result["passed"] and "no kernel image" in result["error"]
    assert info.exit_status(base_facts(gpus=[gpu()], device=0, self_test=result)) == info.EXIT_SELF_TEST_FAILED
    assert any("error: RuntimeError" in line for line in info.render_self_test(result))


# ---------------------------------------------------------------- GPU discovery, with torch.cuda faked


def fake_gpu(monkeypatch, major, minor, name="Fake GPU"):
    props = SimpleNamespace(
        name=name, major=major, minor=minor, multi_processor_count=132, shared_memory_per_block_optin=227 * 1024
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(info, "driver_cuda_version", lambda: "13.0")


@pytest.mark.parametrize(
    "capability, build, image_text, status",
    [
        ((9, 0), BUILD, "sm_90a SASS", info.EXIT_OK),
        ((8, 6), BUILD, "sm_80 SASS", info.EXIT_OK),
        ((12, 0), BUILD, "compute_80 PTX, JIT-compiled at first use", info.EXIT_OK),
        (
            (12, 0),
            {**BUILD, "ptx_archs": []},
            "none: this build has SASS for sm_80, sm_90a and PTX for none, none of "
            "which runs on compute capability 12.0; rebuild with FLASH_ATTN2_CUDA_ARCHS including 120",
            info.EXIT_NO_KERNEL_IMAGE,
        ),
        ((7, 5), BUILD, "none: compute capability 7.5 is below 8.0", info.EXIT_NO_KERNEL_IMAGE),
        ((9, 0), None, "unknown (no build metadata); the self-test decides", info.EXIT_OK),
    ],
)
def test_gpu_discovery(monkeypatch, capsys, capability, build, image_text, status):
    fake_gpu(monkeypatch, *capability)
    monkeypatch.setattr(info, "load_build_info", lambda: dict(build) if build else None)
    ran = []
    monkeypatch.setattr(info, "self_test", lambda package, compiled, device: ran.append(device) or PASSED)
    assert info.main([]) == status
    out = capsys.readouterr().out
    major, minor = capability
    assert f"GPU 0: Fake GPU, compute capability {major}.{minor}, 132 SMs, 227 KiB shared memory per block" in out
    assert f"  kernel image: {image_text}" in out
    # The self-test runs on the current GPU unless no image can run there.
    assert ran == ([torch.device("cuda", 0)] if status == info.EXIT_OK else [])


def test_ptx_only_build_renders():
    facts = base_facts(build={**BUILD, "archs": []})
    assert "  archs        SASS none; PTX embedded: yes, compute_80" in info.render_setup(facts)
    facts = base_facts(build={**BUILD, "ptx_archs": []})
    assert "  archs        SASS sm_80, sm_90a; PTX embedded: no" in info.render_setup(facts)


@pytest.mark.parametrize(
    "gpu, driver, torch_cuda, build_cuda, warning",
    [
        ((12, 0), "13.0", "13.0", "13.0", None),
        ((9, 0), "12.8", "13.0", "13.0", "the driver supports CUDA 12.8, older than the CUDA 13.0 of torch"),
        # PTX from a newer nvcc than the driver knows (SASS does not care).
        ((12, 0), "13.0", "13.0", "13.2", "older than the CUDA 13.2 that wrote the PTX: JIT compilation may fail"),
        ((9, 0), "13.0", "13.0", "13.2", None),
        (None, "13.0", "13.0", "13.0", "a CUDA driver is installed but torch sees no GPU"),
        (None, None, "13.0", "13.0", None),
    ],
)
def test_driver_warnings(monkeypatch, capsys, gpu, driver, torch_cuda, build_cuda, warning):
    if gpu:
        fake_gpu(monkeypatch, *gpu)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(info, "driver_cuda_version", lambda: driver)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(info, "load_build_info", lambda: {**BUILD, "cuda_version": build_cuda})
    monkeypatch.setattr(info, "self_test", lambda package, compiled, device: PASSED)
    info.main([])
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  warning: ")]
    if warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warning in warnings[0], warnings
