"""CPU tests of the serving-engine arguments (flash_attn_cuda.serving and the public functions that take them):
seqused_q / seqused_k, out= and lse_out=, num_splits and pack_gqa, get_scheduler_metadata with
scheduler_metadata=, and flash_attn_combine.

The attention ops are replaced by the float32 reference (per sequence, as the kernels read cu_seqlens) or by
recorders, so no GPU is needed; plans are computed for a given GPU (arch, num_sms) as in test_plan_cpu.py.
"""

import pytest
import torch

from flash_attn_cuda import (
    flash_attn_combine,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
    interface,
    reference,
    serving,
)
from flash_attn_cuda.plan import force_plan

H200 = {"arch": 90, "num_sms": 132}
H, HK, D = 4, 2, 16


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


def cumulative(lengths):
    return int32([0, *torch.tensor(lengths).cumsum(0).tolist()])


def randn(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- seqused_q, seqused_k


def test_used_sequences_splits_each_sequence_in_three():
    q = torch.empty(0)
    cu_q, cu_k = serving.used_sequences(q, int32([0, 5, 9]), int32([0, 7, 10]), int32([3, 9]), int32([7, -2]))
    # Sequence 0: queries 0..3 used, 3..5 not; keys 0..7 used. Sequence 1: seqused_q 9 is clamped to its 4 rows,
    # seqused_k -2 to 0 keys.
    assert cu_q.tolist() == [0, 3, 5, 5, 9, 9, 9]
    assert cu_k.tolist() == [0, 7, 7, 7, 7, 7, 10]
    assert cu_q.dtype == cu_k.dtype == torch.int32


def test_used_sequences_of_an_empty_batch():
    cu_q, cu_k = serving.used_sequences(torch.empty(0), int32([4]), int32([6]), int32([]), None)
    assert cu_q.tolist() == [4] and cu_k.tolist() == [6]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seqused_q": int32([1, 2, 3])}, "seqused_q"),
        ({"seqused_k": torch.tensor([1, 2])}, "seqused_k"),
        ({"cu_seqlens_k": int32([0, 7])}, "cu_seqlens_k"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 9])}, "cu_seqlens_q"),
    ],
)
def test_used_sequences_checks_its_arguments(kwargs, match):
    args = {
        "cu_seqlens_q": int32([0, 5, 9]),
        "cu_seqlens_k": int32([0, 7, 10]),
        "seqused_q": None,
        "seqused_k": int32([1, 1]),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        serving.used_sequences(torch.empty(0), **args)


class ReferenceVarlen:
    """Stands in for interface._ops: varlen_fwd as the kernels compute it, per sequence of cu_seqlens (a sequence
    without keys gives out 0 and LSE +inf), from the float32 reference rounded to the input dtype."""

    def __init__(self):
        self.calls = []

    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, det, plan, variants, compiling):
        self.calls.append((cu_q, cu_k, variants))
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
        for i in range(cu_q.numel() - 1):
            rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
                continue
            seq_out, seq_lse = reference.attention_ref(
                q[None, rows_q], k[None, rows_k], v[None, rows_k], scale, causal, window_size=variants[:2]
            )
            out[rows_q], lse[:, rows_q] = seq_out[0].to(q.dtype), seq_lse[0]
        return out, lse


@pytest.fixture
def reference_ops(monkeypatch):
    ops = ReferenceVarlen()
    monkeypatch.setattr(interface, "_ops", ops)
    return ops


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_attends_over_the_used_rows_only(reference_ops, causal):
    lens_q, lens_k = [5, 4, 3], [7, 3, 6]
    used_q, used_k = [3, 4, 0], [7, 1, 4]
    q, k, v = randn(12, H, D, seed=1), randn(16, HK, D, seed=2), randn(16, HK, D, seed=3)
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    out, lse, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        5,
        7,
        causal=causal,
        return_attn_probs=True,
        seqused_q=int32(used_q),
        seqused_k=int32(used_k),
    )
    for b in range(3):
        start_q, start_k = cu_q[b].item(), cu_k[b].item()
        rows_q, rows_k = slice(start_q, start_q + used_q[b]), slice(start_k, start_k + used_k[b])
        if used_q[b]:
            ref, ref_lse = reference.attention_ref(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal=causal)
            torch.testing.assert_close(out[rows_q].float(), ref[0], atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse[:, rows_q], ref_lse[0])
        unused = slice(start_q + used_q[b], start_q + lens_q[b])
        assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == float("inf")), b


def test_seqused_repeats_per_sequence_alibi_slopes(reference_ops):
    q, k, v = randn(9, H, D), randn(10, HK, D), randn(10, HK, D)
    slopes = torch.rand(2, H)
    flash_attn_varlen_func(
        q, k, v, int32([0, 5, 9]), int32([0, 7, 10]), 5, 7, alibi_slopes=slopes, seqused_k=int32([3, 3])
    )
    ((_, _, variants),) = reference_ops.calls
    assert torch.equal(variants.alibi_slopes, slopes.repeat_interleave(3, dim=0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dropout_p": 0.1, "seqused_k": int32([1, 1])}, "dropout_p"),
        ({"num_splits": 2}, "num_splits"),
        ({"cu_seqlens_k": None}, "cu_seqlens_k"),
    ],
)
def test_varlen_serving_arguments_refused(reference_ops, kwargs, match):
    q, k, v = randn(9, H, D), randn(10, HK, D), randn(10, HK, D)
    args = {"cu_seqlens_q": int32([0, 5, 9]), "cu_seqlens_k": int32([0, 7, 10]), "max_seqlen_q": 5, "max_seqlen_k": 7}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, **args)


class RecordingOps:
    """Stands in for torch.ops.flash_attn2's cache ops: records the arguments, returns zeros."""

    def __init__(self):
        self.calls = {}

    def op(self, name):
        def call(q, *args, **kwargs):
            self.calls[name] = (args, kwargs)
            lse = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
            return torch.zeros_like(q), torch.zeros(lse)

        return call


@pytest.fixture
def cache_ops(monkeypatch):
    ops = RecordingOps()
    monkeypatch.setattr(torch.ops.flash_attn2, "fwd_kvcache", ops.op("fwd_kvcache"), raising=False)
    recorded = ops.op("varlen_fwd_paged")
    monkeypatch.setattr(
        interface._ops, "varlen_fwd_paged", lambda *args, compiling, **kwargs: recorded(*args, **kwargs)
    )
    return ops


@pytest.mark.parametrize("cu_seqlens_k", [None, [0, 40, 45]])
def test_paged_seqused_k_gives_the_lengths(cache_ops, cu_seqlens_k):
    q = randn(9, H, D)
    cache = randn(8, 16, HK, D)
    block_table = int32([[0, 1, 2, 3], [4, 5, 6, 7]])
    cu_k = None if cu_seqlens_k is None else int32(cu_seqlens_k)
    with torch.no_grad():
        flash_attn_varlen_func(
            q, cache, cache, int32([0, 5, 9]), cu_k, 5, 64, block_table=block_table, seqused_k=int32([33, 20])
        )
    args, _ = cache_ops.calls["varlen_fwd_paged"]
    expected = [0, 33, 53] if cu_seqlens_k is None else [0, 33, 38]  # clamped to the given lengths, 40 and 5
    assert args[3].tolist() == expected and args[3].dtype == torch.int32


def test_paged_refuses_seqused_q(cache_ops):
    with pytest.raises(ValueError, match="seqused_q"):
        flash_attn_varlen_func(
            randn(9, H, D),
            randn(8, 16, HK, D),
            randn(8, 16, HK, D),
            int32([0, 5, 9]),
            int32([0, 5, 9]),
            5,
            64,
            block_table=int32([[0, 1], [2, 3]]),
            seqused_q=int32([1, 1]),
        )


# ---------------------------------------------------------------- out=, lse_out=


def test_out_and_lse_out_are_written_and_returned(reference_ops):
    q, k, v = randn(9, H, D), randn(10, HK, D), randn(10, HK, D)
    out = torch.full_like(q, float("nan"))
    lse_out = torch.full((H, 9), float("nan"))
    result, lse, _ = flash_attn_varlen_func(
        q, k, v, int32([0, 5, 9]), int32([0, 7, 10]), 5, 7, return_attn_probs=True, out=out, lse_out=lse_out
    )
    assert result is out and lse is lse_out
    fresh, fresh_lse, _ = flash_attn_varlen_func(
        q, k, v, int32([0, 5, 9]), int32([0, 7, 10]), 5, 7, return_attn_probs=True
    )
    assert torch.equal(out, fresh) and torch.equal(lse_out, fresh_lse)


@pytest.mark.parametrize(
    "out, lse_out, match",
    [
        (torch.empty(9, H, D + 8, dtype=torch.bfloat16), None, "out"),
        (torch.empty(9, H, D), None, "out"),
        (None, torch.empty(9, H), "lse_out"),
        (None, torch.empty(H, 9, dtype=torch.float16), "lse_out"),
    ],
)
def test_out_of_the_wrong_shape_or_dtype_is_refused(reference_ops, out, lse_out, match):
    q, k, v = randn(9, H, D), randn(10, HK, D), randn(10, HK, D)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, int32([0, 5, 9]), int32([0, 7, 10]), 5, 7, out=out, lse_out=lse_out)


def test_kvcache_out_pack_gqa_and_scheduler_metadata(cache_ops):
    q, cache = randn(2, 1, 8, D), randn(2, 64, 2, D)
    out = torch.empty_like(q)
    with torch.no_grad():
        assert flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, out=out) is out
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, pack_gqa=False)
        args, _ = cache_ops.calls["fwd_kvcache"]
        assert "gqa_pack=0" in args[-1]
        metadata = get_scheduler_metadata(2, 1, 64, 8, 2, D, num_splits=3, **H200)
        with force_plan(num_splits=2):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, num_splits=5, scheduler_metadata=metadata)
        args, _ = cache_ops.calls["fwd_kvcache"]
        assert args[-2] == metadata.num_splits and args[-1].endswith(metadata.plan_override)
        with pytest.raises(ValueError, match="scheduler_metadata"):
            flash_attn_with_kvcache(randn(2, 1, 4, D), cache, cache, cache_seqlens=5, scheduler_metadata=metadata)
        with pytest.raises(ValueError, match="scheduler_metadata"):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, scheduler_metadata="metadata")


# ---------------------------------------------------------------- get_scheduler_metadata


def test_scheduler_metadata_pins_the_plan():
    decode = get_scheduler_metadata(16, 1, 8192, 32, 4, 128, **H200)
    assert decode.plan.gqa_pack == 8 and "gqa_pack=1" in decode.plan_override
    assert decode.num_splits == decode.plan.num_splits >= 1
    assert f"kernel={decode.plan.kernel}" in decode.plan_override
    unpacked = get_scheduler_metadata(16, 1, 8192, 32, 4, 128, pack_gqa=False, **H200)
    assert unpacked.plan.gqa_pack == 1 and "gqa_pack=0" in unpacked.plan_override
    assert get_scheduler_metadata(2, 1, 8192, 8, 8, 64, num_splits=3, **H200).num_splits == 3
    paged = get_scheduler_metadata(2, 1, 8192, 8, 8, 64, page_size=256, **H200)
    assert paged.sizes == (2, 8, 8, 64, 64, torch.bfloat16)
    # Head dims the call pads (to the wider one, then to a multiple of 8) plan as padded; sizes keep the call's.
    odd = get_scheduler_metadata(2, 1, 1024, 8, 2, 100, headdim_v=36, **H200)
    assert odd.plan.kernel_head_dim == 128 and odd.sizes == (2, 8, 2, 100, 36, torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attention_chunk": 64}, "attention_chunk"),
        ({"sm_margin": 4}, "sm_margin"),
        ({"qkv_dtype": torch.float32}, "qkv_dtype"),
    ],
)
def test_scheduler_metadata_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_scheduler_metadata(2, 1, 512, 8, 8, 64, **kwargs, **H200)


# ---------------------------------------------------------------- flash_attn_combine


def split_attention(q, k, v, bounds, causal):
    """(out_partial, lse_partial) of attention over each [lo, hi) slice of the keys, float32: dense layout
    (num_splits, batch, seqlen, nheads, head_dim), with -inf LSE for rows that see none of a slice's keys."""
    outs, lses = [], []
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    for lo, hi in bounds:
        # Causal is bottom-right aligned over all keys: mask the slice against the full key positions.
        visible = reference.visible_mask(seqlen_q, seqlen_k, causal, (-1, -1), q.device)[:, lo:hi]
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k[:, lo:hi].float()) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(lse.unsqueeze(-1) == float("-inf"), 0.0))
        outs.append(torch.einsum("bhqk,bkhd->bqhd", probs, v[:, lo:hi].float()))
        lses.append(lse.transpose(1, 2))  # (batch, seqlen, nheads)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("empty_rows", ["-inf", "+inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_combine_equals_attention_over_all_keys(causal, empty_rows):
    q, k, v = randn(2, 9, H, D, seed=1), randn(2, 9, H, D, seed=2), randn(2, 9, H, D, seed=3)
    bounds = [(0, 3), (3, 4), (4, 9)]
    out_partial, lse_partial = split_attention(q, k, v, bounds, causal)
    if empty_rows == "+inf":
        lse_partial = lse_partial.masked_fill(lse_partial == float("-inf"), float("inf"))
    assert causal == bool((lse_partial.abs() == float("inf")).any())  # causal leaves rows without a slice's keys
    out, lse = flash_attn_combine(out_partial, lse_partial)
    ref, ref_lse = reference.attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_combine_rows_without_keys_and_varlen_layout():
    out_partial = randn(3, 7, H, D, dtype=torch.float32)
    lse_partial = randn(3, 7, H, dtype=torch.float32)
    lse_partial[:, 2] = float("-inf")  # row 2 saw no key in any split
    lse_partial[1, 4] = float("inf")  # split 1 saw no key for row 4
    out_partial[1, 4] = float("nan")  # and left its partial output unwritten
    out = torch.empty(7, H, D, dtype=torch.bfloat16)
    result, lse = flash_attn_combine(out_partial, lse_partial, out=out)
    assert result is out and torch.all(out[2] == 0) and torch.all(lse[2] == float("inf"))
    weights = torch.softmax(lse_partial[[0, 2], 4], dim=0)
    torch.testing.assert_close(
        out[4].float(), (weights.unsqueeze(-1) * out_partial[[0, 2], 4]).sum(0), atol=1e-2, rtol=1e-2
    )
    assert flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)[0].dtype == torch.float16


@pytest.mark.parametrize(
    "out_partial, lse_partial, match",
    [
        (torch.empty(3, 7, H), torch.empty(3, 7), "out_partial"),
        (torch.empty(3, 7, H, D), torch.empty(3, H, 7), "lse_partial"),
        (torch.empty(3, 7, H, D, dtype=torch.bfloat16), torch.empty(3, 7, H), "out_partial must be float32"),
    ],
)
def test_combine_checks_its_arguments(out_partial, lse_partial, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_combine(out_partial, lse_partial)
