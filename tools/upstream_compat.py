"""Runs flash-attn's own test file against this package, as a drop-in check.

flash-attn's tests import `flash_attn`, `flash_attn.bert_padding`, `flash_attn.flash_attn_interface` and
`flash_attn.layers.rotary`. This tool writes a small package of that name into a temporary directory, whose
functions are this package's (the rotary embedding is a PyTorch one, computed in fp32 as flash-attn's kernel
does), copies the test file next to it and runs pytest there. Nothing of flash-attn is installed or imported.

    python tools/upstream_compat.py path/to/flash-attention/tests/test_flash_attn.py --every 20 -- -n 8 -x

--every N keeps one test in N, chosen by a hash of the test's id, so the sample is the same on every run and
spread over the parametrizations; arguments after `--` go to pytest. flash-attn's S_dmask holds each key block's
exp(score - running row max), which its tests rescale with their helper normalize_flash_attn_S; this package
returns the probabilities themselves, so the run replaces that helper with the identity.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PACKAGE = {
    "__init__.py": """
from flash_attn_cuda import *  # noqa: F401,F403  (flash-attn's seven attention functions among them)

__version__ = "2.8.3"
""",
    "bert_padding.py": """
from flash_attn_cuda.padding import pad_input, unpad_input
""",
    "flash_attn_interface.py": """
from flash_attn_cuda import *  # noqa: F401,F403


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    # Imported by the tests for their S_dmask helper normalize_flash_attn_S, which this run replaces (CONFTEST).
    return 64
""",
    "layers/__init__.py": "",
    "layers/rotary.py": '''
import torch

from flash_attn_cuda.reference import apply_rotary


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, nheads, headdim); row i of sequence b sits at position seqlen_offsets[b] + i (or the
    int seqlen_offsets + i); cos, sin (seqlen_ro, rotary_dim / 2). Computed in fp32, rounded once to x's dtype."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb: cu_seqlens")
    batch, seqlen = x.shape[:2]
    rows = torch.arange(seqlen, device=x.device)
    if isinstance(seqlen_offsets, torch.Tensor):
        positions = seqlen_offsets.to(x.device).long()[:, None] + rows[None, :]
    else:
        positions = (int(seqlen_offsets) + rows)[None, :].expand(batch, seqlen)
    out = apply_rotary(x.float(), cos.float(), sin.float(), positions, interleaved).to(x.dtype)
    if inplace:
        x.copy_(out)
        return x
    return out
''',
}

CONFTEST = """
import os
import zlib

EVERY = int(os.environ.get("UPSTREAM_COMPAT_EVERY", "1"))


def probabilities_as_returned(attn_unnorm, *args, **kwargs):
    # flash-attn's S_dmask holds each key block's exp(score - running row max), which its tests' helper
    # normalize_flash_attn_S rescales to probabilities; this package's S_dmask holds the probabilities already.
    return attn_unnorm


def pytest_collection_modifyitems(config, items):
    for item in items:
        if hasattr(item.module, "normalize_flash_attn_S"):
            item.module.normalize_flash_attn_S = probabilities_as_returned
    if EVERY > 1:
        keep = [zlib.crc32(item.nodeid.encode()) % EVERY == 0 for item in items]
        config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
        items[:] = [item for item, k in zip(items, keep) if k]
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path, help="flash-attn's tests/test_flash_attn.py")
    parser.add_argument("--every", type=int, default=1, help="keep one test in N (by a hash of its id)")
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not args.test_file.is_file():
        parser.error(f"test_file: {args.test_file} is not a file")
    if args.every < 1:
        parser.error("--every must be at least 1")
    with tempfile.TemporaryDirectory(prefix="upstream_compat_") as tmp:
        root = Path(tmp)
        for name, text in PACKAGE.items():
            path = root / "flash_attn" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.lstrip("\n"))
        (root / "conftest.py").write_text(CONFTEST.lstrip("\n"))
        (root / "pytest.ini").write_text("[pytest]\n")
        shutil.copy(args.test_file, root / args.test_file.name)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(REPO), env.get("PYTHONPATH")) if p)
        env["UPSTREAM_COMPAT_EVERY"] = str(args.every)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", args.test_file.name, *pytest_args]
        return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
