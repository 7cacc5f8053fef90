"""CPU tests of the pure-PyTorch side of the attention variants (sliding window, softcap, ALiBi, dropout): the
reference (flash_attn_cuda.reference) against a row-at-a-time transcription of the semantics and hand-checked
cases, and the dropout generator (flash_attn_cuda.dropout) against the Random123 known answers and a literal
transcription of the element mapping. None of it needs a GPU or the built ops."""

import importlib
import itertools
import math
from pathlib import Path

import pytest
import torch

try:
    importlib.import_module("flash_attn_cuda")
except ImportError:
    # The modules tested here are plain PyTorch: in a checkout whose extension is not built (run with
    # --noconftest, since conftest needs the extension), load them from the source tree under a bare package.
    import sys
    import types

    _package = types.ModuleType("flash_attn_cuda")
    _package.__path__ = [str(Path(__file__).resolve().parent.parent / "flash_attn_cuda")]
    sys.modules["flash_attn_cuda"] = _package

from flash_attn_cuda import dropout  # noqa: E402
from flash_attn_cuda.dropout import DROPOUT_ROUNDS, keep_mask, philox4x32, s_dmask, varlen_keep_mask  # noqa: E402
from flash_attn_cuda.reference import (  # noqa: E402
    attention_probs,
    attention_ref,
    dropout_keep_scale,
    effective_dropout_p,
    sink_grad_ref,
    visible_mask,
)

M32 = 0xFFFFFFFF


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


def qkv(b=2, sq=7, sk=9, h=4, hk=2, d=8, dtype=torch.float64):
    """Random q, k, v in the (batch, seqlen, heads, head_dim) layout."""
    return randn(b, sq, h, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- Philox4x32


def philox_python(counter, key, rounds):
    """Philox4x32 on Python ints, as written in the spec: the check of the int64 arithmetic of dropout.py."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


KNOWN_ANSWERS = [  # (counter, key, output) of Random123's philox4x32_10 known-answer tests
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    # Random123 publishes answers for 10 rounds; the rounds are one loop, so these check every round's arithmetic.
    assert tuple(int(w) for w in philox4x32(*counter, *key, rounds=10)) == expected
    assert philox_python(counter, key, 10) == expected


def test_dropout_draws_seven_rounds():
    # The kernels' dropout runs 7 rounds (dropout.h, as flash-attn 2.x): fewer rounds are a different function.
    assert DROPOUT_ROUNDS == 7
    words = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0)
    seven = tuple(int(w) for w in philox4x32(*words))
    assert seven == philox_python(words[:4], words[4:], 7)
    assert seven != philox_python(words[:4], words[4:], 10)
    with pytest.raises(ValueError, match="rounds"):
        philox4x32(*words, rounds=0)


def test_philox_matches_python_ints():
    # Random uint32 words, most of them above 2^31, where a plain int64 product would overflow; counters broadcast.
    n = 500
    words = torch.randint(0, 2**32, (6, n), dtype=torch.int64)
    words[:, :4] = torch.tensor([0, M32, 2**31, 2**31 - 1])  # the edges
    out = philox4x32(*words)
    assert all(w.dtype == torch.int64 and w.shape == (n,) for w in out)
    for idx in range(n):
        counter, key = words[:4, idx].tolist(), words[4:, idx].tolist()
        assert tuple(int(w[idx]) for w in out) == philox_python(counter, key, DROPOUT_ROUNDS), idx


# ---------------------------------------------------------------- keep_mask


def rng_state(seed, offset):
    """int64 (2,) [seed, offset] from unsigned 64-bit values (stored as their two's complement bit patterns)."""
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed, offset - 2**64 if offset >= 2**63 else offset])


def keep_mask_literal(seed, offset, dropout_p, batch, nheads, seqlen_q, seqlen_k):
    """The spec's element mapping written out for every entry, one Philox call per entry (no sharing of calls)."""
    seed, offset = seed % 2**64, offset % 2**64
    i = torch.arange(seqlen_q)[None, :, None]
    j = torch.arange(seqlen_k)[None, None, :]
    bh = torch.arange(batch * nheads)[:, None, None]
    words = philox4x32(i & ~8, j & ~25, bh, offset & M32, seed & M32, (seed >> 32) & M32, rounds=7)
    words = torch.stack(torch.broadcast_tensors(*words))
    which = (2 * ((i >> 3) & 1) + (j & 1)).expand(batch * nheads, -1, -1)
    word = words.gather(0, which[None])[0]
    byte = (word >> (8 * ((j >> 3) & 3))) & 0xFF
    threshold = min(max(math.floor(dropout_p * 256 + 0.5), 1), 255)
    return (byte >= threshold).view(batch, nheads, seqlen_q, seqlen_k)


@pytest.mark.parametrize(
    "seed, offset", [(0, 0), (12345, 678), (2**64 - 1, 2**64 - 1), (0x8000_0001_7FFF_FFFE, 2**40 + 3)]
)
@pytest.mark.parametrize("shape", [(2, 3, 37, 45), (1, 2, 16, 16), (1, 1, 1, 1), (2, 1, 5, 70), (1, 2, 33, 8)])
def test_keep_mask_matches_spec_mapping(seed, offset, shape):
    expected = keep_mask_literal(seed, offset, 0.3, *shape)
    ours = keep_mask(rng_state(seed, offset), 0.3, *shape)
    assert ours.dtype == torch.bool and ours.shape == shape
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("chunk", [256, 2048])
def test_keep_mask_chunks(monkeypatch, chunk):
    # Small chunks split the rows (in 16-row blocks) and the heads, with partial last chunks.
    state = rng_state(99, 7)
    whole = keep_mask(state, 0.5, 2, 5, 53, 21)
    monkeypatch.setattr(dropout, "_CHUNK_ENTRIES", chunk)
    assert torch.equal(keep_mask(state, 0.5, 2, 5, 53, 21), whole)
    assert torch.equal(varlen_keep_mask(state, 0.5, 5, [53, 20], [21, 3])[1], whole[1, :, :20, :3])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    n = 2 * 4 * 128 * 128
    kept = keep_mask(rng_state(2024, 11), p, 2, 4, 128, 128).double().mean().item()
    p_applied = effective_dropout_p(p)
    assert abs(p_applied - p) <= 1 / 512
    sigma = math.sqrt(p_applied * (1 - p_applied) / n)
    assert abs(kept - (1 - p_applied)) < 5 * sigma, (kept, 1 - p_applied, sigma)


# The drop fraction of a sample of masks against p' = effective_dropout_p(p): within 6 binomial standard deviations
# sqrt(p' (1 - p') / n). The binomial applies because the entries drop independently: tools/dropout_keep_stats.py
# finds the variance of the drops per 4-byte word and per 16-byte Philox call within 0.2% of the binomial's, and
# per mask within the 3% its 2000 draws resolve (docs/design-notes.md, "Dropout's drop fraction"). A correct mask
# then fails with probability 2e-9; the rng_states are fixed, so the test is deterministic besides.
FRACTION_STATES = [(2024, 11), (0x9E37_79B9_7F4A_7C15, 3), (7, 2**40 + 5), (2**64 - 1, 123456789)]
FRACTION_SHAPE = (2, 8, 128, 128)  # 262144 entries per state, 1048576 in all


def drop_fraction(dropout_p):
    """(fraction dropped, entries) over the masks of FRACTION_STATES at FRACTION_SHAPE."""
    dropped = sum(int((~keep_mask(rng_state(*state), dropout_p, *FRACTION_SHAPE)).sum()) for state in FRACTION_STATES)
    n = len(FRACTION_STATES) * math.prod(FRACTION_SHAPE)
    return dropped / n, n


def within_six_sigma(fraction, p_drop, n):
    return abs(fraction - p_drop) <= 6 * math.sqrt(p_drop * (1 - p_drop) / n)


@pytest.mark.parametrize("p", [0.17, 0.1])
def test_drop_fraction_is_effective_p(p):
    p_drop = effective_dropout_p(p)
    fraction, n = drop_fraction(p)
    assert within_six_sigma(fraction, p_drop, n), (fraction, p_drop, n)
    # The check can fail: masks drawn one threshold step off (p' -+ 1/256: 10.6 standard deviations at this n for
    # p = 0.17, 13.2 for p = 0.1; round(256 p) truncated instead of rounded is one of them at p = 0.17) are rejected.
    threshold = round(256 * p_drop)
    for wrong in (threshold - 1, threshold + 1):
        wrong_fraction, _ = drop_fraction(wrong / 256)
        assert not within_six_sigma(wrong_fraction, p_drop, n), (wrong, wrong_fraction, p_drop)


def test_effective_dropout_p():
    # Multiples of 1/256, rounded to nearest; at least 1/256 and at most 255/256 for p > 0.
    assert effective_dropout_p(0.0) == 0.0
    assert effective_dropout_p(0.1) == 26 / 256
    assert effective_dropout_p(0.5) == 0.5
    assert effective_dropout_p(1e-9) == 1 / 256
    assert effective_dropout_p(1 - 1e-9) == 255 / 256
    assert effective_dropout_p(3.49 / 256) == 3 / 256 and effective_dropout_p(3.51 / 256) == 4 / 256
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout_p"):
            effective_dropout_p(bad)


def test_dropout_keep_scale():
    # flash-attn 2.x's and PyTorch's scale, 1 / (1 - p) of the p asked for, not of the p the mask drops with.
    assert dropout_keep_scale(0.0) == 1.0
    assert dropout_keep_scale(0.17) == 1.0 / 0.83
    assert dropout_keep_scale(0.17) != 1.0 / (1.0 - effective_dropout_p(0.17))
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout_p"):
            dropout_keep_scale(bad)


def test_keep_mask_edges_of_p():
    state = rng_state(5, 6)
    assert keep_mask(state, 0.0, 1, 2, 40, 40).all()
    # Just under 1 the threshold is 255: only the byte 255 keeps an entry, 1 in 256.
    n = 2 * 64 * 64
    kept = keep_mask(state, 1 - 2**-40, 1, 2, 64, 64).sum().item()
    assert abs(kept - n / 256) < 5 * math.sqrt(n / 256), kept
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout_p"):
            keep_mask(state, bad, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="rng_state"):
        keep_mask(torch.tensor([1, 2], dtype=torch.int32), 0.5, 1, 1, 4, 4)


def test_keep_threshold_boundary():
    # Entry (b, h, i, j) = (1, 0, 9, 19) of a (2, 3) call reads byte 2 (bits 3-4 of j) of word 3 (bit 3 of i and bit
    # 0 of j set) of the call at counter (1, 2, 3, offset): it is kept at the threshold round(256 p) = byte and
    # dropped just above.
    seed, offset = 0x0123_4567_89AB_CDEF, 77
    word = int(philox4x32(1, 2, 3, offset, seed & M32, seed >> 32, rounds=7)[3])
    byte = (word >> 16) & 0xFF
    state = rng_state(seed, offset)
    if byte > 0:
        assert keep_mask(state, byte / 256, 2, 3, 10, 20)[1, 0, 9, 19]
    if byte < 255:
        assert not keep_mask(state, (byte + 1) / 256, 2, 3, 10, 20)[1, 0, 9, 19]


def test_keep_mask_is_a_function_of_rng_state():
    shape = (2, 3, 40, 40)
    base = keep_mask(rng_state(7, 1000), 0.5, *shape)
    assert torch.equal(keep_mask(rng_state(7, 1000), 0.5, *shape), base)
    # Each word of the state matters...
    assert not torch.equal(keep_mask(rng_state(7, 1001), 0.5, *shape), base)
    assert not torch.equal(keep_mask(rng_state(8, 1000), 0.5, *shape), base)
    assert not torch.equal(keep_mask(rng_state(7 + 2**32, 1000), 0.5, *shape), base)  # the seed's high word
    # ...except the offset's high 32 bits, which the counter does not hold.
    assert torch.equal(keep_mask(rng_state(7, 1000 + 2**32), 0.5, *shape), base)
    # A higher p drops a superset: the words do not depend on p.
    assert not (keep_mask(rng_state(7, 1000), 0.7, *shape) & ~base).any()


def test_keep_mask_layout():
    # An entry's decision depends on (b * nheads + h, i, j) only, not on the sizes of the call.
    state = rng_state(31337, 42)
    big = keep_mask(state, 0.5, 2, 3, 50, 70)
    assert torch.equal(keep_mask(state, 0.5, 2, 3, 20, 9), big[:, :, :20, :9])
    assert torch.equal(keep_mask(state, 0.5, 1, 6, 50, 70)[0], big.reshape(6, 50, 70))
    # Sequence b of a varlen call draws as batch row b, positions counted within the sequence.
    masks = varlen_keep_mask(state, 0.5, 3, [50, 0, 17], torch.tensor([70, 5, 0]))
    assert [tuple(m.shape) for m in masks] == [(3, 50, 70), (3, 0, 5), (3, 17, 0)]
    assert torch.equal(masks[0], big[0])
    assert torch.equal(varlen_keep_mask(state, 0.5, 3, [4, 6], [4, 9])[1], big[1, :, :6, :9])


# ---------------------------------------------------------------- reference: masks


def sees(p, j, left, right):
    """The spec's window rule for a query at key position p."""
    return (left < 0 or j >= p - left) and (right < 0 or j <= p + right)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, window, rows",
    [
        # rows: the keys each query row sees, written out by hand.
        (3, 5, False, (1, 0), [[1, 2], [2, 3], [3, 4]]),  # positions 2, 3, 4
        (3, 5, False, (-1, 1), [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]),
        (3, 5, False, (0, 0), [[2], [3], [4]]),
        (3, 5, True, (1, 3), [[1, 2], [2, 3], [3, 4]]),  # causal forces right = 0
        (3, 5, True, (-1, -1), [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]),
        (4, 2, True, (-1, -1), [[], [], [0], [0, 1]]),  # positions -2, -1, 0, 1
        (4, 2, False, (0, 0), [[], [], [0], [1]]),
        (4, 2, False, (-1, 0), [[], [], [0], [0, 1]]),
        (4, 2, False, (1, -1), [[0, 1], [0, 1], [0, 1], [0, 1]]),
        (2, 6, False, (2, 1), [[2, 3, 4, 5], [3, 4, 5]]),  # positions 4, 5
    ],
)
def test_visible_mask(seqlen_q, seqlen_k, causal, window, rows):
    expected = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    for i, keys in enumerate(rows):
        expected[i, keys] = True
    assert torch.equal(visible_mask(seqlen_q, seqlen_k, causal, window, "cpu"), expected)
    left, right = window[0], 0 if causal else window[1]
    literal = [[sees(i + seqlen_k - seqlen_q, j, left, right) for j in range(seqlen_k)] for i in range(seqlen_q)]
    assert expected.tolist() == literal


# ---------------------------------------------------------------- reference: against a row-at-a-time transcription


def naive_attention(
    q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None, keep=None, dropout_p=0.0, sink=None
):
    """One query row at a time with Python floats, each variant applied as the spec words it."""
    b, sq, h, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    left, right = window[0], 0 if causal else window[1]
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.empty(b, h, sq, dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        kv_head = hi // (h // hk)
        sink_h = None if sink is None else float(sink[hi])
        p = i + sk - sq
        keys = [j for j in range(sk) if sees(p, j, left, right)]
        if not keys:
            # No key: the sink, if any, takes the whole row (out 0, lse the sink).
            lse[bi, hi, i] = math.inf if sink_h is None else sink_h
            continue
        scores = []
        for j in keys:
            s = scale * float(q[bi, i, hi].double() @ k[bi, j, kv_head].double())
            if softcap > 0:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                slope = slopes[hi] if slopes.dim() == 1 else slopes[bi, hi]
                s -= float(slope) * abs(p - j)
            scores.append(s)
        # The sink joins the denominator (and the max) and adds no value.
        top = max(scores) if sink_h is None else max(*scores, sink_h)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights) + (0.0 if sink_h is None else math.exp(sink_h - top))
        lse[bi, hi, i] = top + math.log(total)
        for j, w in zip(keys, weights):
            prob = w / total
            if keep is not None:
                prob = prob * bool(keep[bi, hi, i, j]) * dropout_keep_scale(dropout_p)
            out[bi, i, hi] += prob * v[bi, j, kv_head].double()
    return out, lse


VARIANTS = {  # keyword arguments of attention_ref (and naive_attention, which spells them differently)
    "window": dict(window_size=(2, 1)),
    "window-left": dict(window_size=(3, -1)),
    "window-right": dict(window_size=(-1, 2)),
    "window-causal": dict(window_size=(2, 5), causal=True),
    "window-0-0": dict(window_size=(0, 0)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="heads"),
    "alibi-batch": dict(alibi_slopes="batch"),
    "dropout": dict(dropout_p=0.3),
    "all": dict(window_size=(3, 1), causal=True, softcap=2.0, alibi_slopes="batch", dropout_p=0.2),
    # Sinks far below, near and far above the rows' scores (standard-normal q, k and scale 0.4).
    "sink": dict(learnable_sink="mixed"),
    "sink-window-dropout": dict(window_size=(2, 0), learnable_sink="mixed", dropout_p=0.3),
    "sink-all": dict(window_size=(3, 1), causal=True, softcap=2.0, alibi_slopes="heads", learnable_sink="mixed"),
}
SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (2, 6, 6, 2, 2, 8),
    (1, 4, 9, 4, 2, 8),  # seqlen_q < seqlen_k, GQA
    (2, 9, 4, 3, 1, 4),  # seqlen_q > seqlen_k: rows that see no key under some windows, MQA
]


def variant_args(name, shape):
    """(attention_ref keyword arguments, naive_attention keyword arguments) of VARIANTS[name] for ``shape``."""
    b, sq, sk, h, _, _ = shape
    kwargs = dict(VARIANTS[name])
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = torch.rand(h) if kwargs["alibi_slopes"] == "heads" else torch.rand(b, h)
    if "dropout_p" in kwargs:
        kwargs["dropout_mask"] = torch.rand(b, h, sq, sk) >= kwargs["dropout_p"]
    if "learnable_sink" in kwargs:
        kwargs["learnable_sink"] = mixed_sinks(h)
    naive = dict(
        causal=kwargs.get("causal", False),
        window=kwargs.get("window_size", (-1, -1)),
        softcap=kwargs.get("softcap", 0.0),
        slopes=kwargs.get("alibi_slopes"),
        keep=kwargs.get("dropout_mask"),
        dropout_p=kwargs.get("dropout_p", 0.0),
        sink=kwargs.get("learnable_sink"),
    )
    return kwargs, naive


def mixed_sinks(h):
    """(h,) float32 sink logits: far below the scores, near them, far above, cycled over the heads."""
    return torch.tensor([-30.0, 0.5, 25.0, -1.0])[torch.arange(h) % 4] + 0.1 * torch.rand(h)


@pytest.mark.parametrize("shape", SHAPES, ids=["square", "gqa", "mqa-tall"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_matches_naive(name, shape):
    b, sq, sk, h, hk, d = shape
    q, k, v = qkv(b, sq, sk, h, hk, d)
    kwargs, naive = variant_args(name, shape)
    expect_out, expect_lse = naive_attention(q, k, v, 0.4, **naive)

    # upcast=False computes in the input dtype, here float64; lse is float32 by contract.
    out, lse = attention_ref(q, k, v, 0.4, upcast=False, **kwargs)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    torch.testing.assert_close(out, expect_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expect_lse.float(), rtol=1e-6, atol=1e-6)

    out32, lse32 = attention_ref(q, k, v, 0.4, **kwargs)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32, expect_out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse32, expect_lse.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- reference: hand-checked cases


@pytest.mark.parametrize(
    "window, causal, empty",
    [
        ((0, 0), False, 3),
        ((2, 0), True, 3),
        ((-1, 0), False, 3),
        ((5, 0), False, 3),
        ((-1, -1), True, 3),
        ((-1, -1), False, 0),
    ],
)
def test_reference_empty_rows(window, causal, empty):
    # seqlen_q 7 over seqlen_k 4: rows 0-2 stand at positions -3..-1, so a window with right = 0 leaves them
    # nothing. Rows with no key: out 0, lse +inf, probabilities 0.
    q, k, v = qkv(1, 7, 4, 2, 2, 8, torch.float32)
    out, lse = attention_ref(q, k, v, window_size=window, causal=causal)
    assert torch.all(out[:, :empty] == 0) and torch.all(torch.isposinf(lse[:, :, :empty]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, empty:]).all()
    probs = attention_probs(q, k, window_size=window, causal=causal)
    assert torch.all(probs[:, :, :empty] == 0)
    torch.testing.assert_close(probs[:, :, empty:].sum(-1), torch.ones(1, 2, 7 - empty))


def test_reference_diagonal_window():
    # window (0, 0) on a square matrix: each row sees its own key only, so out is that key's value and lse its score.
    q, k, v = qkv(2, 5, 5, 3, 3, 8)
    out, lse = attention_ref(q, k, v, 0.5, window_size=(0, 0), upcast=False)
    torch.testing.assert_close(out, v, rtol=0, atol=0)
    torch.testing.assert_close(lse, (0.5 * (q * k).sum(-1)).transpose(1, 2).float())


def test_reference_alibi_closed_form():
    # q = 0: every score is its ALiBi bias. One query row at position 2 over three keys: biases -2s, -s, 0.
    slope = 0.75
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    k = randn(1, 3, 1, 4, dtype=torch.float64)
    v = randn(1, 3, 1, 4, dtype=torch.float64)
    weights = [math.exp(-2 * slope), math.exp(-slope), 1.0]
    total = sum(weights)
    expect = sum(w / total * v[0, j, 0] for j, w in enumerate(weights))
    for slopes in (torch.tensor([slope]), torch.tensor([[slope]])):
        out, lse = attention_ref(q, k, v, alibi_slopes=slopes, upcast=False)
        torch.testing.assert_close(out[0, 0, 0], expect, rtol=1e-12, atol=1e-12)
        assert lse.item() == pytest.approx(math.log(total), rel=1e-6)


@pytest.mark.parametrize("upcast", [True, False])
def test_reference_sink_rows_without_keys(upcast):
    # As test_reference_empty_rows with a sink: rows 0-2 see no key under causal, so the sink takes the row:
    # out 0 and lse the sink. The other rows' probabilities sum to 1 minus the sink's share exp(sink - lse).
    q, k, v = qkv(1, 7, 4, 4, 2, 8, torch.float32)
    sink = mixed_sinks(4)
    out, lse = attention_ref(q, k, v, causal=True, learnable_sink=sink, upcast=upcast)
    assert torch.all(out[:, :3] == 0)
    torch.testing.assert_close(lse[0, :, :3], sink[:, None].expand(4, 3))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    probs = attention_probs(q, k, causal=True, learnable_sink=sink)
    assert torch.all(probs[:, :, :3] == 0)
    torch.testing.assert_close(probs.sum(-1), 1 - torch.exp(sink[None, :, None] - lse))
    with pytest.raises(ValueError, match="learnable_sink"):
        attention_ref(q, k, v, learnable_sink=torch.zeros(3))


def test_reference_sink_far_below_is_no_sink():
    # A sink 200 below every score is exp(-200) of a row's mass: the plain attention to float64 precision.
    q, k, v = qkv(2, 5, 6, 4, 2, 8)
    out, lse = attention_ref(q, k, v, upcast=False, learnable_sink=torch.full((4,), -200.0))
    expect_out, expect_lse = attention_ref(q, k, v, upcast=False)
    torch.testing.assert_close(out, expect_out, rtol=0, atol=1e-60)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["plain", "causal-gqa", "dropout", "all"])
def test_sink_grad_ref_matches_autograd(name):
    # sink_grad_ref's closed form, -sum_i exp(sink - lse_i) rowsum(dout_i * out_i), against autograd through the
    # float64 reference, with rows that see no key (causal, seqlen_q > seqlen_k) and dropout's kept mask.
    b, sq, sk, h, hk, d = (2, 9, 5, 4, 2, 8)
    q, k, v = qkv(b, sq, sk, h, hk, d)
    kwargs = {
        "plain": {},
        "causal-gqa": dict(causal=True),
        "dropout": dict(dropout_p=0.3, dropout_mask=torch.rand(b, h, sq, sk) >= 0.3),
        "all": dict(window_size=(2, 1), causal=True, softcap=2.0, alibi_slopes=torch.rand(h)),
    }[name]
    sink = mixed_sinks(h).double().requires_grad_()
    out, lse = attention_ref(q, k, v, 0.4, upcast=False, learnable_sink=sink, **kwargs)
    dout = randn(*out.shape, dtype=torch.float64)
    (expect,) = torch.autograd.grad(out, sink, dout)
    got = sink_grad_ref(out.detach(), dout, lse, sink.detach())
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got, expect.float(), rtol=1e-5, atol=1e-6)
    # It cannot pass vacuously: the sinks near the scores carry a gradient well away from 0.
    assert expect.abs().max() > 1e-3


@pytest.mark.parametrize("dv", [4, 16])
def test_reference_value_head_dim(dv):
    # V's head dim may differ from Q's and K's: out takes V's. Each output feature depends on its own V feature only,
    # so out equals the attention over a wider V (three more random features) with those features sliced off.
    q, k, _ = qkv(2, 6, 7, 4, 2, 8)
    v = randn(2, 7, 2, dv, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.shape == (2, 6, 4, dv)
    wide = torch.cat((v, randn(2, 7, 2, 3, dtype=torch.float64)), dim=-1)
    out_wide, lse_wide = attention_ref(q, k, wide, causal=True, upcast=False)
    torch.testing.assert_close(out, out_wide[..., :dv], rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, lse_wide, rtol=0, atol=0)


def test_reference_alibi_slope_shapes():
    q, k, v = qkv(2, 6, 8, 4, 2, 8)
    slopes = torch.rand(4)
    shared = attention_ref(q, k, v, alibi_slopes=slopes)
    per_batch = attention_ref(q, k, v, alibi_slopes=slopes.expand(2, 4).clone())
    for a, b in zip(shared, per_batch):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Row b of (batch, nheads) slopes applies to batch row b alone.
    rows = torch.rand(2, 4)
    out, lse = attention_ref(q, k, v, alibi_slopes=rows)
    for b in range(2):
        out_b, lse_b = attention_ref(q[b : b + 1], k[b : b + 1], v[b : b + 1], alibi_slopes=rows[b])
        torch.testing.assert_close(out[b : b + 1], out_b)
        torch.testing.assert_close(lse[b : b + 1], lse_b)
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention_ref(q, k, v, alibi_slopes=torch.rand(3))


def test_reference_softcap_formula():
    # Big scores: the cap keeps every score in (-c, c), so lse lies within c of log(seqlen_k).
    q, k, v = qkv(1, 5, 7, 2, 2, 16)
    q = q * 30
    c, scale = 3.0, 0.25
    scores = c * torch.tanh(scale * torch.einsum("bqhd,bkhd->bhqk", q, k) / c)
    expect_lse = torch.logsumexp(scores, dim=-1)
    expect_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    out, lse = attention_ref(q, k, v, scale, softcap=c, upcast=False)
    torch.testing.assert_close(out, expect_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expect_lse.float())
    assert torch.all((lse - math.log(7)).abs() < c)
    probs = attention_probs(q, k, scale, softcap=c)
    torch.testing.assert_close(probs, torch.softmax(scores, dim=-1).float())


def test_reference_dropout_mask():
    b, sq, sk, h = 2, 6, 10, 4
    q, k, v = qkv(b, sq, sk, h, 2, 8)
    mask = torch.rand(b, h, sq, sk) >= 0.25
    out, lse = attention_ref(q, k, v, window_size=(4, 2), dropout_p=0.25, dropout_mask=mask)
    out0, lse0 = attention_ref(q, k, v, window_size=(4, 2))
    # lse is that of the undropped softmax; out uses P * mask / (1 - p).
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0)
    probs = attention_probs(q, k, window_size=(4, 2)) * mask / 0.75
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", probs, v.float().repeat_interleave(2, dim=2)))
    # An all-kept mask at p = 0 is no dropout.
    out1, _ = attention_ref(q, k, v, window_size=(4, 2), dropout_mask=torch.ones_like(mask))
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_ref(q, k, v, dropout_p=0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["softcap", "alibi-batch", "window", "all"])
def test_reference_lowp(dtype, name):
    shape = (2, 9, 12, 4, 2, 16)
    q, k, v = qkv(*shape[:5], 16, dtype=dtype)
    kwargs, _ = variant_args(name, shape)
    out, lse = attention_ref(q, k, v, upcast=False, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # The logsumexp is taken in the input dtype: every finite lse is a value of that dtype.
    finite = torch.isfinite(lse)
    assert torch.equal(lse[finite], lse[finite].to(dtype).float())
    out32, lse32 = attention_ref(q, k, v, **kwargs)
    assert out32.dtype == torch.float32
    assert torch.equal(torch.isposinf(lse), torch.isposinf(lse32))
    # Same math, lower precision: close but not identical.
    torch.testing.assert_close(out.float(), out32, rtol=0, atol=0.05)
    torch.testing.assert_close(lse[finite], lse32[finite], rtol=0, atol=0.05)
    assert not torch.equal(lse[finite], lse32[finite])


# ---------------------------------------------------------------- S_dmask


def round_up(n):
    return -(-n // 128) * 128


def check_s_dmask(s, probs, keep, visible):
    """One (nheads, seqlen_q, seqlen_k) block of S_dmask: |S| = P, negative where dropped, +0 where masked."""
    torch.testing.assert_close(s.abs().float(), probs.to(s.dtype).float(), rtol=0, atol=0)
    assert torch.equal(s < 0, ~keep & (probs.to(s.dtype) > 0))
    assert not torch.signbit(s[:, ~visible]).any() and torch.all(s[:, ~visible] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_s_dmask_dense(dtype):
    b, sq, sk, h, hk = 2, 130, 40, 4, 2
    q, k, _ = qkv(b, sq, sk, h, hk, 16, dtype=dtype)
    q.requires_grad_()
    state, variants = rng_state(77, 3), dict(causal=True, window_size=(20, -1), softcap=5.0, alibi_slopes=torch.rand(h))
    s = s_dmask(q, k, None, dropout_p=0.4, rng_state=state, **variants)
    assert s.shape == (b, h, round_up(sq), round_up(sk)) and s.dtype == dtype and not s.requires_grad
    assert torch.all(s[:, :, sq:] == 0) and torch.all(s[:, :, :, sk:] == 0)
    probs = attention_probs(q, k, **variants)
    keep = keep_mask(state, 0.4, b, h, sq, sk)
    visible = visible_mask(sq, sk, True, (20, -1), "cpu")
    for bi in range(b):
        check_s_dmask(s[bi, :, :sq, :sk], probs[bi], keep[bi], visible)
    # Dropped entries are about 40% of the visible ones.
    dropped = (s < 0).sum().item() / (b * h * visible.sum().item())
    assert 0.3 < dropped < 0.5


def test_s_dmask_varlen():
    lens_q, lens_k, h, hk = [5, 0, 140, 3], [7, 4, 30, 0], 4, 1
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    q, k = randn(sum(lens_q), h, 16), randn(sum(lens_k), hk, 16)
    slopes = torch.rand(len(lens_q), h)
    state = rng_state(2**63 + 5, 2**33 + 9)
    variants = dict(causal=False, window_size=(-1, 3), softcap=0.0)
    s = s_dmask(
        q,
        k,
        0.3,
        alibi_slopes=slopes,
        dropout_p=0.5,
        rng_state=state,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=150,
        max_seqlen_k=30,
        **variants,
    )
    assert s.shape == (4, h, 256, 128) and s.dtype == torch.float32
    keeps = varlen_keep_mask(state, 0.5, h, lens_q, lens_k)
    for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        assert torch.all(s[b, :, len_q:] == 0) and torch.all(s[b, :, :, len_k:] == 0)
        q_b, k_b = q[cu_q[b] : cu_q[b + 1]][None], k[cu_k[b] : cu_k[b + 1]][None]
        probs = attention_probs(q_b, k_b, 0.3, alibi_slopes=slopes[b], **variants)[0]
        check_s_dmask(s[b, :, :len_q, :len_k], probs, keeps[b], visible_mask(len_q, len_k, False, (-1, 3), "cpu"))
    # The max_seqlen defaults are the longest sequences.
    s_default = s_dmask(
        q, k, 0.3, alibi_slopes=slopes, dropout_p=0.5, rng_state=state, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **variants
    )
    assert s_default.shape == (4, h, 256, 128) and torch.equal(s_default, s)
