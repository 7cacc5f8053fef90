"""Shared pytest configuration and helpers for the flash_attn_cuda tests.

Helpers live here (rather than in a package) so test modules can ``from conftest import ...``
under pytest's default import mode.
"""

import pytest
import torch

MARKERS = {
    "gpu": "needs a CUDA device; skipped when none is present",
    "exhaustive": "full configuration matrix; deselected unless --exhaustive or -m exhaustive",
}

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def require_fwd_bwd_kernels(head_dim, dtype, causal):
    """Skips the calling test unless this build has the forward and backward kernels for the configuration."""
    import flash_attn_cuda

    if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True):
        pytest.skip(f"kernels for head_dim={head_dim} {dtype} causal={causal} not compiled")


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        default=False,
        help="also run tests marked 'exhaustive' (the full configuration matrix)",
    )


def pytest_configure(config):
    # pytest.ini registers the same markers; skip those already known to avoid duplicates.
    known = {line.split(":", 1)[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in known:
            config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config, items):
    # An explicit "-m ...exhaustive..." selection is honoured as is.
    if config.getoption("--exhaustive") or "exhaustive" in (config.getoption("markexpr") or ""):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("exhaustive") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def poison_allocator(device, nbytes=512 << 20):
    """Fill every free block of the CUDA caching allocator (current stream) with NaN.

    The op allocates its outputs itself, so they cannot be pre-filled; instead the memory they
    will be carved from is filled with NaN first, and any element the kernel forgets to write
    shows up as NaN. A single big NaN tensor is not enough: the allocator hands out the smallest
    cached block that fits, so the free remainders of segments holding live tensors (the inputs)
    would be picked first. Hence every free block is allocated at its exact size and filled,
    a fresh ``nbytes`` block and a few whole small-pool segments are added, and all of it is
    freed again. ``nbytes`` must exceed the total size of the outputs bigger than 1 MiB.
    """
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()  # drops wholly free segments: fewer blocks to fill
    stream = torch.cuda.current_stream(index).cuda_stream

    mib = 1 << 20  # requests up to 1 MiB use the small pool (2 MiB segments), larger ones not
    small, large = [], []
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) != index or segment["stream"] != stream:
            continue
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        (small if segment["segment_type"] == "small" else large).extend(free)
    # A small-pool block over 1 MiB can only be reached by requests of at most 1 MiB: cut it
    # into 1 MiB plus the remainder, requested after all exact-size requests so that each
    # request still lands on a block of exactly its size.
    over = [n for n in small if n > mib]
    sizes = large + [n for n in small if n <= mib] + [mib] * len(over) + [n - mib for n in over]
    # A new large segment with no leftover: requests over 10 MiB get a segment of their size
    # rounded up to 2 MiB (smaller ones share a 20 MiB segment).
    nbytes = max(nbytes, 16 * mib)
    sizes.append(-(-nbytes // (2 * mib)) * (2 * mib))
    sizes += [mib] * 16  # eight new small segments, each filled by two requests
    with torch.cuda.device(index):
        # All-ones bytes are NaN as float32, float16 and bfloat16 alike (a float32 NaN would
        # read as 0 in every other float16 slot). Block sizes are multiples of 512 bytes, so
        # int32 tensors can match them exactly.
        held = [torch.full((n // 4,), -1, dtype=torch.int32, device=device) for n in sizes]
    del held  # back to the cache, not the driver; stream order runs the fills first


def _max_abs_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_close(name, ours, ref, ref_lowp, atol=1e-5):
    """Assert the correctness rule: max|ours - ref| <= 2 * max|ref_lowp - ref| + atol.

    ``ref`` is the float32 reference, ``ref_lowp`` the same computation in the input dtype.
    Entries where ``ref`` is +inf (the lse of rows that see no key) must be +inf in ``ours`` and
    are excluded from the numeric comparison. ``ours`` must contain no NaN at all.
    """
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    n_nan = torch.isnan(ours).sum().item()
    assert n_nan == 0, f"{name}: {n_nan} NaN of {ours.numel()} entries"

    ref_inf = torch.isposinf(ref)
    if ref_inf.any():
        n_bad = (~torch.isposinf(ours[ref_inf])).sum().item()
        assert n_bad == 0, f"{name}: {n_bad} entries should be +inf (rows with no visible key)"
        finite = ~ref_inf
        ours, ref, ref_lowp = ours[finite], ref[finite], ref_lowp[finite]

    err = _max_abs_diff(ours, ref)
    lowp_err = _max_abs_diff(ref_lowp, ref)
    bound = 2 * lowp_err + atol
    assert err <= bound, (
        f"{name}: max|ours - ref| = {err:.3e} > bound {bound:.3e} "
        f"(max|ref_lowp - ref| = {lowp_err:.3e}, atol = {atol:.0e})"
    )
