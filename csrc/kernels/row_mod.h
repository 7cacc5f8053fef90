// Row modifiers: terms that join each query row's softmax denominator beside its keys' scores, and carry no
// value. ScoreMod (score_mod.h) changes each score from the score and its position; a row modifier changes a
// whole row's normalization once, where the row's softmax is finished. The example the interface is shaped for
// is a learnable attention sink: one extra logit sink_h per query head h that every row of that head sees,
// so that row i's softmax is over its keys and the sink,
//
//     LSE_i = log(exp(sink_h) + sum_j exp(s_ij)),    O_i = sum_j exp(s_ij - LSE_i) V_j,
//
// and whose gradient is its own: d sink_h = -sum_i exp(sink_h - LSE_i) * D_i, with D_i = rowsum(dO_i * O_i),
// summed over every row of head h in every sequence. The backward's P_ij = exp(s_ij - LSE_i) and
// dS_ij = P_ij * (dP_ij - D_i) hold unchanged with that LSE and D, so its main loops need nothing from a row
// modifier: only the step that computes D does (hook c).
//
// Two modifiers exist: NoRowMod, which adds nothing, and LearnableSink. Where the kernels call the hooks, and
// what each receives and returns:
//
//   (a) fold: OnlineSoftmax::fold_row_terms (softmax.h), in the forward kernels, after finalize, for a row that
//       saw at least one key, with its finished LSE as the max and 1 as the sum (natural-log units). Called only
//       where the CTA writes the final output: a split-KV CTA (FwdTile::is_split) writes its split's own LSE and
//       gets no terms (FwdTile::fold_row_mod). The warp-specialized Hopper kernel folds them in a form of its own
//       (kSink), so that its plain form keeps its code.
//   (b) fold again, at the split-KV combine (flash_fwd_combine.cu), for a row that some split saw a key of, with
//       the max and sum of the splits' LSEs: the terms join once, here. The splits' weights exp(lse_s - LSE) then
//       normalize the output by themselves.
//   (c) grad_term: the backward's D = rowsum(dO * O) kernel (dot_do_o_kernel in flash_bwd_aux.cu), which reads
//       each row's LSE beside its dO and O, writes each row's share of the modifier's gradient to a buffer laid
//       out as D, and the host sums that buffer per head with a torch reduction: the same order in every run,
//       so the gradient is bitwise repeatable, deterministic mode or not.
//   (d) empty_row_lse: (a) and (b) for a row that saw no key (finalize: LSE +inf; combine: every split's LSE
//       -inf). The row's output is 0 either way; its LSE is what this returns.
//
// A modifier that needs parameters reads them from the kernel's __grid_constant__ params where used, as ScoreMod
// does, so it holds no registers through the main loops.
#pragma once

#include <cmath>
#include <concepts>

#include <cute/config.hpp>

namespace flash {

// One row's softmax as the hooks see it, in natural-log units: its LSE is max + log(sum).
struct RowStats {
    float max;  // the row's largest term so far (its keys' LSE, or a split's); finite
    float sum;  // sum over the row's terms t of exp(t - max), >= 1
};

// Which row a hook is called for: what a modifier keys its terms by.
struct RowCoord {
    int head;  // the query head; under GQA packing the packed row's own head (FwdTile::query_head)
};

// What the kernels require of a row modifier. The hooks are const: a modifier holds no per-row state.
template <class RowMod>
concept RowModifier = requires(const RowMod& mod, RowStats& row, const RowCoord& coord, float value) {
    // Whether the kernels call the hooks at all (NoRowMod compiles to no code, not even a multiply by 1).
    { RowMod::kActive } -> std::convertible_to<bool>;
    // (a), (b) Folds the modifier's terms into a row's max and sum (updated in place) and returns the factor that
    //     the row's output accumulator takes besides 1 / sum: exp(old max - new max), which is 1 unless a term
    //     raised the max (the accumulator holds values relative to the old one).
    { mod.fold(row, coord) } -> std::same_as<float>;
    // (c) A row's share of the modifier's gradient from its D = rowsum(dO * O) and its natural-log LSE (the
    //     forward's, with the terms folded in).
    { mod.grad_term(value, value, coord) } -> std::same_as<float>;
    // (d) The LSE of a row that saw no key: the log of the modifier's terms alone.
    { mod.empty_row_lse(coord) } -> std::same_as<float>;
};

// No row terms: flash-attn's softmax. A row that sees no key gets output 0 and LSE +inf, so that a later
// exp(s - LSE) is 0.
struct NoRowMod {
    static constexpr bool kActive = false;

    CUTE_HOST_DEVICE float fold(RowStats&, const RowCoord&) const { return 1.f; }
    CUTE_HOST_DEVICE float grad_term(float /*dsum*/, float /*lse*/, const RowCoord&) const { return 0.f; }
    CUTE_HOST_DEVICE float empty_row_lse(const RowCoord&) const { return INFINITY; }
};

static_assert(RowModifier<NoRowMod>);

// A learnable sink per query head (FwdParams::learnable_sink_ptr), or none when the pointer is null: a runtime
// choice (the forward kernels test it once, FwdTile::fold_row_mod; the warp-specialized one's launcher picks its
// kSink form), so that calls with and without sinks share kernels and neither pays in its main loop.
struct LearnableSink {
    static constexpr bool kActive = true;
    const float* sink;  // (query heads,) natural-log logits, or nullptr

    CUTE_DEVICE float fold(RowStats& row, const RowCoord& coord) const {
        if (sink == nullptr) { return 1.f; }
        const float s = sink[coord.head];
        const float max = fmaxf(row.max, s);
        const float factor = __expf(row.max - max);
        row.sum = row.sum * factor + __expf(s - max);
        row.max = max;
        return factor;
    }
    // d sink_h = -sum over rows of exp(sink_h - LSE_i) * D_i. A sink of -inf has no share (rather than the NaN of
    // -inf - -inf at a row that saw no key, whose LSE it is).
    CUTE_DEVICE float grad_term(float dsum, float lse, const RowCoord& coord) const {
        const float s = sink[coord.head];
        return s == -INFINITY ? 0.f : -__expf(s - lse) * dsum;
    }
    // A row with no key has the sink alone; with a sink of -inf, flash-attn's +inf, so that the backward's
    // exp(s - LSE) of the row's masked scores stays 0 rather than exp(-inf - -inf).
    CUTE_DEVICE float empty_row_lse(const RowCoord& coord) const {
        if (sink == nullptr) { return INFINITY; }
        const float s = sink[coord.head];
        return s == -INFINITY ? INFINITY : s;
    }
};

static_assert(RowModifier<LearnableSink>);

// A row with its modifier's terms folded in: its natural-log LSE, and the factor its output takes.
struct RowResult {
    float lse;
    float o_scale;
};

// Hooks (a) and (d) as OnlineSoftmax::fold_row_terms applies them to one row that finalize finished: lse its
// natural-log LSE over its keys (+inf for a row that saw none, whose output is 0). Returns the row's LSE with the
// modifier's terms, and the factor its normalized output takes: exp(lse - LSE), the share of the row's mass that
// its keys keep (0 for a row that saw no key).
template <class RowMod>
CUTE_DEVICE RowResult fold_into_lse(const RowMod& mod, float lse, const RowCoord& coord) {
    static_assert(RowModifier<RowMod>);
    if (lse == INFINITY) { return {mod.empty_row_lse(coord), 0.f}; }
    RowStats row{lse, 1.f};
    const float factor = mod.fold(row, coord);
    return {row.max + __logf(row.sum), factor / row.sum};
}

// Hooks (b) and (d) as the combine applies them to one row: `row` over its splits (max -inf when no split saw a
// key). Returns the row's natural-log LSE, from which each split's weight is exp(lse_s - LSE): 0 for the splits
// that saw no key, and for every split of a row that saw none.
template <class RowMod>
CUTE_DEVICE float finish_split_row(const RowMod& mod, RowStats row, const RowCoord& coord) {
    static_assert(RowModifier<RowMod>);
    if (row.max == -INFINITY) { return mod.empty_row_lse(coord); }
    if constexpr (RowMod::kActive) { mod.fold(row, coord); }
    return row.max + logf(row.sum);
}

}  // namespace flash
