"""The extensions share libtorch's C++ runtime (csrc/cxx_runtime.py, setup.py's shared_cxx_runtime_args): the check
that setup.py runs after each link, on small libraries linked both ways and on the extensions of this build, and
the link argument setup.py chooses. No GPU needed."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CSRC

import flash_attn_cuda

SOURCE = '#include <stdexcept>\nextern "C" void fail() { throw std::runtime_error("failed"); }\n'


def load_checker():
    if not (CSRC / "cxx_runtime.py").is_file():
        pytest.skip("no csrc/ next to the tests")
    spec = importlib.util.spec_from_file_location("flash_attn_cxx_runtime", CSRC / "cxx_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def link(tmp_path, name, *args):
    """A shared library of SOURCE linked with g++ and `args`, or None where this g++ cannot link it so."""
    source = tmp_path / "fail.cpp"
    source.write_text(SOURCE)
    library = tmp_path / f"{name}.so"
    result = subprocess.run(
        ["g++", "-shared", "-fPIC", "-O2", str(source), "-o", str(library), *args], capture_output=True, text=True
    )
    return library if result.returncode == 0 else None


@pytest.fixture(scope="module")
def checker():
    return load_checker()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_check_tells_a_static_runtime_from_the_shared_one(tmp_path, checker):
    shared = link(tmp_path, "shared")
    assert shared is not None
    assert checker.carries_cxx_runtime(shared) is False
    static = link(tmp_path, "static", "-static-libstdc++")
    if static is None:
        pytest.skip("this g++ has no static libstdc++")
    assert checker.carries_cxx_runtime(static) is True
    # setup.py's remedy: an explicit -lstdc++ among the arguments, ahead of the compiler's own, wins over
    # -static-libstdc++.
    remedied = link(tmp_path, "remedied", "-lstdc++", "-static-libstdc++")
    assert remedied is not None
    assert checker.carries_cxx_runtime(remedied) is False


def test_check_makes_no_claim_on_other_files(tmp_path, checker):
    text = tmp_path / "not_elf.so"
    text.write_text("not a library")
    assert checker.carries_cxx_runtime(text) is None


def test_built_extensions_use_the_shared_runtime(checker):
    libraries = sorted(Path(flash_attn_cuda.__file__).parent.glob("*.so"))
    if not libraries:
        pytest.skip("no built extension")
    for library in libraries:
        assert checker.carries_cxx_runtime(library) is False, library.name


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_setup_links_the_shared_runtime_where_the_toolchain_finds_only_the_static_one(tmp_path, monkeypatch):
    # A toolchain like one seen on a GPU host: its g++ links libstdc++ statically, and its own library directory
    # (searched first, through -B) holds only libstdc++.a, so that -lstdc++ finds the static library there.
    setup_py = CSRC.parent / "setup.py"
    static = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not setup_py.is_file() or not Path(static).is_file():
        pytest.skip("no setup.py next to the tests, or no static libstdc++")
    toolchain = tmp_path / "toolchain"
    toolchain.mkdir()
    (toolchain / "libstdc++.a").symlink_to(static)
    monkeypatch.setenv("CXX", f"g++ -static-libstdc++ -B{toolchain}/")
    spec = importlib.util.spec_from_file_location("flash_attn_setup", setup_py)
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    assert setup.shared_cxx_runtime_args() == ["-l:libstdc++.so.6"]
    monkeypatch.setenv("CXX", "g++")
    assert setup.shared_cxx_runtime_args() == ["-lstdc++"]
