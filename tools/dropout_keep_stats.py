"""How the dropout mask's drop fraction is distributed, on the CPU, and whether its generator shows bias at small
sizes. Needs the package (flash_attn_cuda.dropout), no GPU.

The kernels' mask is a pure function of the call's rng_state (seed, offset) and the entries' coordinates, rebuilt
by flash_attn_cuda.dropout: one Philox4x32-7 call per sixteen entries, an entry dropped iff its byte is below
round(256 p), so it drops with p' = round(256 p) / 256 (0.171875 for p = 0.17). For many rng_states, drawn as the
wrappers draw them (two uniform int64), this script draws the masks of a few small shapes like those of
flash-attn 2.x's dropout tests and reports:

- the drop fraction per draw: its mean against p and p', its standard deviation against the binomial
  sqrt(p' (1 - p') / n) of independent entries, and how often |fraction - p| > 0.01, the bound flash-attn 2.x's
  tests assert, against the exact binomial rate with p' and with p itself;
- dependence: the variance of the drops per 32-bit word (four bytes of one Philox output word) and per Philox
  call (sixteen bytes) against the binomial variance; bytes that share a draw would inflate it;
- bias: drop frequencies per output word and per byte position of a word, a chi-square over the 256 byte values
  pooled across draws, one over the bytes of each draw's first Philox call (the smallest counters), and one over
  the entries' positions (does any (row, column) drop more often?).

The raw bytes come from flash_attn_cuda.dropout.philox4x32 with the counters of the layout that dropout.py's
docstring describes, and are checked against keep_mask / varlen_keep_mask entry for entry in every draw.

    python tools/dropout_keep_stats.py                      # 2000 draws, p = 0.17
    python tools/dropout_keep_stats.py --draws 500 --p 0.1 --dense-draws 10
"""

import argparse
import dataclasses
import math
import time

import torch

from flash_attn_cuda import dropout
from flash_attn_cuda.reference import effective_dropout_p

BOUND = 0.01  # flash-attn 2.x's |dropout_fraction - dropout_p| bound, without a local window


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    nheads: int
    seqlen_q: int
    seqlen_k: int
    random_lengths: bool  # lengths as flash-attn 2.x's generate_random_padding_mask(mode="random") draws them
    raw: bool  # also draw the raw bytes (small cases only)


CASES = [
    # test_flash_attn_varlen_output at (seqlen_q, seqlen_k) = (1, 147), batch 4, 6 heads: the one dropout case of
    # flash-attn 2.x's tests with a few thousand entries (4 sequences of 127 to 147 keys, 3048 to 3528 entries).
    Case("varlen 4x6 1x147, keys 127-147", 4, 6, 1, 147, True, True),
    Case("dense 4x6 1x147", 4, 6, 1, 147, False, True),
    # Whole Philox calls: every byte of every call is an entry (16 rows x 32 columns per head).
    Case("dense 4x6 16x32", 4, 6, 16, 32, False, True),
    # test_flash_attn_output's smallest dropout case, (113, 203) at batch 4, 6 heads: 550536 entries.
    Case("dense 4x6 113x203", 4, 6, 113, 203, False, False),
]


def random_lengths(count, max_len, generator):
    """flash-attn 2.x's padding lengths (mode "random"): uniform in [max(1, max_len - 20), max_len]."""
    return torch.randint(max(1, max_len - 20), max_len + 1, (count,), generator=generator).tolist()


def entry_layout(seqlen_q, seqlen_k):
    """Per entry (i, j), from dropout.py's layout: the Philox call's first two counter words (row, column), the
    output word and the byte of that word. Returns (row counter (Q,), column counter (K,), word (Q, K), byte (K,))."""
    i, j = torch.arange(seqlen_q), torch.arange(seqlen_k)
    row_counter = 16 * (i // 16) + i % 8
    col_counter = 32 * (j // 32) + 2 * ((j % 8) // 2)
    word = 2 * ((i[:, None] >> 3) & 1) + (j[None, :] & 1)
    return row_counter, col_counter, word, (j >> 3) & 3


def raw_draws(states, heads, seqlen_q, seqlen_k, rounds=dropout.DROPOUT_ROUNDS):
    """The bytes that decide the entries, (draws, heads, seqlen_q, seqlen_k) uint8, and every byte of the calls
    that cover them, (draws, heads, row calls, column calls, word, byte) uint8. states: (draws, 2) int64."""
    row_counter, col_counter, word, byte = entry_layout(seqlen_q, seqlen_k)
    rows, row_index = torch.unique(row_counter, return_inverse=True)
    cols, col_index = torch.unique(col_counter, return_inverse=True)
    seed, offset = states[:, 0], states[:, 1]
    shape = (-1, 1, 1, 1)
    key0, key1 = (seed & 0xFFFFFFFF).view(shape), ((seed >> 32) & 0xFFFFFFFF).view(shape)
    words = dropout.philox4x32(
        rows.view(1, 1, -1, 1),
        cols.view(1, 1, 1, -1),
        torch.arange(heads).view(1, -1, 1, 1),
        (offset & 0xFFFFFFFF).view(shape),
        key0,
        key1,
        rounds,
    )
    words = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # (draws, heads, rows, cols, word)
    calls = ((words[..., None] >> (8 * torch.arange(4))) & 0xFF).to(torch.uint8)  # (..., word, byte)
    entries = calls[:, :, row_index[:, None], col_index[None, :], word, byte[None, :]]
    return entries, calls


def draw_case(case, states, p, generator, rounds=dropout.DROPOUT_ROUNDS):
    """Per draw: (dropped, entries) of the case's mask from flash_attn_cuda.dropout, and, for raw cases, the bytes
    (raw_draws) and the valid-entry mask (draws, heads, seqlen_q, seqlen_k), checked against the masks."""
    heads = case.batch * case.nheads
    dropped, counts, valid = [], [], []
    for state in states:
        if case.random_lengths:
            lens_q = random_lengths(case.batch, case.seqlen_q, generator)
            lens_k = random_lengths(case.batch, case.seqlen_k, generator)
            masks = dropout.varlen_keep_mask(state, p, case.nheads, lens_q, lens_k)
            keep = torch.ones(case.batch, case.nheads, case.seqlen_q, case.seqlen_k, dtype=torch.bool)
            here = torch.zeros_like(keep)
            for b, mask in enumerate(masks):
                keep[b, :, : lens_q[b], : lens_k[b]] = mask
                here[b, :, : lens_q[b], : lens_k[b]] = True
        else:
            keep = dropout.keep_mask(state, p, case.batch, case.nheads, case.seqlen_q, case.seqlen_k)
            here = torch.ones_like(keep)
        dropped.append(int((~keep & here).sum()))
        counts.append(int(here.sum()))
        if case.raw:
            valid.append((keep.reshape(heads, case.seqlen_q, case.seqlen_k), here.reshape(heads, *keep.shape[2:])))
    result = dict(dropped=torch.tensor(dropped, dtype=torch.float64), n=torch.tensor(counts, dtype=torch.float64))
    if case.raw:
        entries, calls = raw_draws(states, heads, case.seqlen_q, case.seqlen_k, rounds)
        keep = torch.stack([k for k, _ in valid])
        here = torch.stack([h for _, h in valid])
        threshold = round(256 * effective_dropout_p(p))
        mismatches = int(((entries >= threshold) != keep)[here].sum())
        if mismatches and rounds == dropout.DROPOUT_ROUNDS:
            raise SystemExit(
                f"{case.name}: the raw bytes disagree with flash_attn_cuda.dropout in {mismatches} entries"
            )
        result.update(entries=entries, calls=calls, here=here)
    return result


def binomial_pmf(n, p):
    k = torch.arange(n + 1, dtype=torch.float64)
    log_pmf = (
        math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    )
    return torch.exp(log_pmf)


def outside_rate(n, p_drop, p_target, bound=BOUND):
    """P(|K / n - p_target| > bound) for K ~ Binomial(n, p_drop)."""
    k = torch.arange(n + 1, dtype=torch.float64)
    return float(binomial_pmf(n, p_drop)[(k / n - p_target).abs() > bound].sum())


def length_sum_distribution(count, max_len):
    """{sum: probability} of the sum of `count` lengths drawn as random_lengths draws them."""
    low = max(1, max_len - 20)
    one = {n: 1.0 / (max_len - low + 1) for n in range(low, max_len + 1)}
    total = {0: 1.0}
    for _ in range(count):
        nxt = {}
        for a, pa in total.items():
            for b, pb in one.items():
                nxt[a + b] = nxt.get(a + b, 0.0) + pa * pb
        total = nxt
    return total


def expected_outside(case, p_drop, p_target):
    """The exact binomial rate of |fraction - p_target| > BOUND for the case's entry count (averaged over the
    lengths when they are random)."""
    per_row = case.nheads * case.seqlen_q
    if not case.random_lengths:
        return outside_rate(case.batch * per_row * case.seqlen_k, p_drop, p_target)
    if case.seqlen_q != 1:
        raise ValueError("random key lengths are modelled for one query row only")
    return sum(
        prob * outside_rate(per_row * total, p_drop, p_target)
        for total, prob in length_sum_distribution(case.batch, case.seqlen_k).items()
    )


def chi_square(counts, expected):
    """(statistic, degrees of freedom, p-value) of observed counts against expected counts (the probabilities are
    known, not fitted)."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1 if math.isclose(float(counts.sum()), float(expected.sum())) else counts.numel()
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))
    return stat, dof, pvalue


def variance_ratio(x, size, p_drop):
    """Var(x) / (size p' (1 - p')) for x the drops of groups of `size` entries, and its standard error (from the
    fourth central moment of x): 1 for independent entries, above 1 when they are positively correlated."""
    x = x.double().flatten()
    centred = x - x.mean()
    m2, m4 = (centred**2).mean(), (centred**4).mean()
    binomial = size * p_drop * (1 - p_drop)
    return float(m2 / binomial), float(torch.sqrt((m4 - m2**2) / x.numel()) / binomial)


def table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=2000, help="rng_states (seed, offset) per small case")
    parser.add_argument("--dense-draws", type=int, default=100, help="rng_states of the 113 x 203 case (0: skip it)")
    parser.add_argument("--p", type=float, default=0.17, help="dropout_p")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws of the rng_states and the lengths")
    parser.add_argument(
        "--rounds",
        type=int,
        default=dropout.DROPOUT_ROUNDS,
        help="Philox rounds of the raw bytes (a control: the kernels use 7; with 1 or 2 the bias tests should fail); "
        "the drop fractions always come from the masks",
    )
    a = parser.parse_args()
    # The masks are drawn one small call at a time, where splitting each op across threads costs more than it
    # saves (several times more on a busy machine).
    torch.set_num_threads(1)
    p, p_drop = a.p, effective_dropout_p(a.p)
    threshold = round(256 * p_drop)
    generator = torch.Generator().manual_seed(a.seed)
    print(f"p = {p}, p' = round(256 p) / 256 = {threshold}/256 = {p_drop:.6f} (p' - p = {p_drop - p:+.6f}); ", end="")
    print(f"rng_states and lengths drawn from torch.Generator().manual_seed({a.seed}), fresh ones per case\n")

    results = {}
    for case in CASES:
        draws = a.draws if case.raw else a.dense_draws
        if draws == 0:
            continue
        # As the wrappers draw an rng_state (_ops.rng_state): two uniform int64, the seed and the offset.
        states = torch.randint(-(2**63), 2**63 - 1, (draws, 2), dtype=torch.int64, generator=generator)
        start = time.perf_counter()
        results[case] = draw_case(case, states, p, generator, a.rounds)
        results[case]["seconds"] = time.perf_counter() - start

    print("Drop fraction per draw (mean, sd over draws; binomial sd = sqrt(p'(1-p')/n); z = (mean - p') / se)")
    rows = []
    for case, r in results.items():
        fraction = r["dropped"] / r["n"]
        draws = fraction.numel()
        z_scores = (fraction - p_drop) / torch.sqrt(p_drop * (1 - p_drop) / r["n"])
        binomial_sd = math.sqrt(p_drop * (1 - p_drop) / float(r["n"].mean()))
        sd = float(fraction.std()) if draws > 1 else float("nan")
        outside = float(((fraction - p).abs() > BOUND).double().mean())
        rows.append(
            (
                case.name,
                draws,
                f"{float(r['n'].mean()):.0f}",
                f"{float(fraction.mean()):.6f}",
                f"{float(z_scores.mean()) * math.sqrt(draws):+.2f}",
                f"{sd:.6f}",
                f"{binomial_sd:.6f}",
                f"{float(z_scores.std()) if draws > 1 else float('nan'):.3f}",
                f"{float(fraction.min()):.4f}..{float(fraction.max()):.4f}",
                f"{outside:.4f}",
                f"{expected_outside(case, p_drop, p):.4f}",
                f"{expected_outside(case, p, p):.4f}",
                f"{r['seconds']:.1f}",
            )
        )
    table(
        [
            "case",
            "draws",
            "n",
            "mean",
            "z(mean-p')",
            "sd",
            "binom sd",
            "sd(z)",
            "range",
            "|f-p|>0.01",
            "binom p'",
            "binom p",
            "s",
        ],
        rows,
    )
    print(
        "|f-p|>0.01: fraction of draws outside flash-attn 2.x's bound; binom p': the exact binomial rate of that with\n"
        "independent entries dropped with p'; binom p: the same were p' equal to p. sd(z): the sd of the per-draw\n"
        "standardized fraction, 1 for independent entries (its standard error about 1/sqrt(2 draws)).\n"
    )

    if a.rounds != dropout.DROPOUT_ROUNDS:
        print(f"The tables below draw the raw bytes with {a.rounds} Philox rounds, not the kernels' 7.\n")
    print("Dependence: variance of the drops per group against the binomial variance (1 = independent)")
    rows = []
    for case, r in results.items():
        if "calls" not in r:
            continue
        drops = (r["calls"] < threshold).to(torch.int16)  # (draws, heads, rows, cols, word, byte)
        for label, x, size in (
            ("a word's 4 bytes", drops.sum(-1), 4),
            ("a call's 16 bytes", drops.sum((-1, -2)), 16),
        ):
            ratio, se = variance_ratio(x, size, p_drop)
            rows.append((case.name, label, x.numel(), f"{ratio:.4f}", f"{se:.4f}", f"{(ratio - 1) / se:+.2f}"))
    table(["case", "group", "groups", "var ratio", "se", "z"], rows)
    print("(A whole draw's entries: sd(z)^2 of the first table.)\n")

    print("Bias at small sizes: drop frequency per output word and byte position (all bytes of the calls drawn)")
    rows = []
    for case, r in results.items():
        if "calls" not in r:
            continue
        drops = (r["calls"] < threshold).double()
        for label, dims in (("word", (0, 1, 2, 3, 5)), ("byte", (0, 1, 2, 3, 4))):
            freq = drops.mean(dims)
            count = drops.numel() / freq.numel()
            se = math.sqrt(p_drop * (1 - p_drop) / count)
            cells = "  ".join(f"{i}: {float(f):.5f} ({(float(f) - p_drop) / se:+.1f})" for i, f in enumerate(freq))
            rows.append((case.name, label, f"{count:.0f}", cells))
    table(["case", "by", "bytes each", "frequency (z) per index"], rows)

    print(
        "Chi-square tests (p-value: the chance of a statistic at least this large from an unbiased generator; near 0\n"
        "is too uneven, near 1 too even, both a sign of a weak generator)"
    )
    rows = []
    for case, r in results.items():
        if "calls" not in r:
            continue
        calls = r["calls"]
        values = torch.bincount(calls.flatten().long(), minlength=256)
        rows.append(
            (case.name, "256 byte values, every byte", *chi_square(values, torch.full((256,), calls.numel() / 256)))
        )
        first = calls[:, 0, 0, 0].flatten().long()  # each draw's call (0, 0, 0, offset): the smallest counters
        values = torch.bincount(first, minlength=256)
        rows.append(
            (case.name, "256 byte values, first call", *chi_square(values, torch.full((256,), first.numel() / 256)))
        )
        here = r["here"]
        dropped = ((r["entries"] < threshold) & here).sum(0).double()  # per (head, row, column), over draws
        present = here.sum(0).double()
        keep_cells = present > 0
        expected = present[keep_cells] * p_drop
        observed = dropped[keep_cells]
        # Drops at each entry position against p' times its presence: a binomial cell each, so the statistic
        # sums (observed - expected)^2 / (expected (1 - p')).
        stat = float(((observed - expected) ** 2 / (expected * (1 - p_drop))).sum())
        dof = int(keep_cells.sum())
        pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2)))
        rows.append((case.name, "drops per entry position", stat, dof, pvalue))
    table(
        ["case", "test", "chi2", "dof", "p-value"],
        [(c, t, f"{s:.1f}", d, f"{pv:.3f}") for c, t, s, d, pv in rows],
    )


if __name__ == "__main__":
    main()
