"""The benchmarks' summary arithmetic (bench/common.py), on made-up rows: the geometric means of our speed over each
other implementation and over the faster of cuDNN and FlashAttention-4 in each cell."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import common  # noqa: E402


def row(seqlen, **tflops):
    return {"pass": "fwd", "hdim": 128, "causal": False, "seqlen": seqlen, "tflops": tflops, "ratios": {}}


ROWS = [
    row(512, ours=400.0, flash=200.0, cudnn=500.0, fa4=400.0),
    row(1024, ours=600.0, flash=300.0, cudnn=500.0, fa4=750.0),
    row(2048, ours=660.0, flash=330.0, cudnn=600.0, fa4=None),
]


def test_speed_over_each_implementation():
    text = "\n".join(common.ratio_lines(ROWS))
    assert "flash 2.000 (2.000-2.000, 3 cells)" in text
    cudnn = math.exp((math.log(0.8) + math.log(1.2) + math.log(1.1)) / 3)
    assert f"cudnn {cudnn:.3f} (0.800-1.200, 3 cells)" in text
    # fa4 failed in the last cell: its mean covers the two cells it ran.
    assert f"fa4 {math.sqrt(1.0 * 0.8):.3f} (0.800-1.000, 2 cells)" in text


def test_faster_of_the_leaders_per_cell():
    text = "\n".join(common.ratio_lines(ROWS))
    # Cells where both ran: 400 over max(500, 400) = 0.8, 600 over max(500, 750) = 0.8.
    assert "ours over the faster of cudnn and fa4 in each cell: 0.800 (0.800-0.800) over 2 cells, 2 below 0.90." in text


@pytest.mark.parametrize("leaders", [("cudnn",), ("fa4",)])
def test_no_leader_line_with_one_leader(leaders):
    rows = [row(512, ours=400.0, **{k: 500.0 for k in leaders})]
    text = "\n".join(common.ratio_lines(rows))
    assert "faster of" not in text
    assert f"{leaders[0]} 0.800" in text


def test_nothing_to_compare():
    assert common.ratio_lines([row(512, ours=400.0)]) == []
