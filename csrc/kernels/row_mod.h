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
// NoRowMod, which adds nothing, is the only modifier, and no kernel calls these hooks yet. Where they will be
// called, and what each receives and returns:
//
//   (a) fold_into_row: OnlineSoftmax::finalize (softmax.h), in both forward kernels, for a row that saw at least
//       one key, after the row sum's quad reduction (every thread that holds the row calls it with the same
//       values) and before the LSE and the output scale are computed from the row's max and sum. Called only
//       where the CTA writes the final output: a split-KV CTA (FwdTile::is_split) writes its split's own LSE,
//       and the terms join once, in the combine (b), not once per split.
//   (b) fold_into_split_row: the split-KV combine (flash_fwd_combine.cu), for a row that some split saw a key
//       of, after the reduction of the splits' LSEs and before the row's LSE and the splits' weights
//       exp(lse_s - LSE) are computed from them. The weights then normalize the output by themselves.
//   (c) grad_term and add_grad: the backward's D = rowsum(dO * O) kernel (dot_do_o_kernel in flash_bwd_aux.cu),
//       which reads each row's LSE beside its dO and O: grad_term gives the row's share of the modifier's own
//       gradient, the CTA sums its rows' shares, and one thread per CTA hands the sum to add_grad (one global
//       atomic per CTA, not per row).
//   (d) empty_row_lse: the same three places, for a row that saw no key (finalize: row sum 0; combine: every
//       split's LSE -inf). The row's output is 0 either way; its LSE is what this returns.
//
// Kernels call the hooks under `if constexpr (RowMod::kActive)` (and (c) under kHasGrad), so NoRowMod compiles
// to no code at all, not even a multiply by 1. A modifier that needs parameters reads them from the kernel's
// __grid_constant__ params where used, as ScoreMod does, so it holds no registers through the main loops.
#pragma once

#include <cmath>
#include <concepts>

#include <cute/config.hpp>

namespace flash {

// One row's softmax at finalize (hook a), in the kernel's units: scores are modified scores (score_mod.h),
// of which score_scale gives natural-log units and scale_log2 (= score_scale * log2(e)) the exp2 argument.
struct RowStats {
    float max;  // the row's largest score seen; finite (a row that saw no key goes to empty_row_lse instead)
    float sum;  // sum_j exp2((s_j - max) * scale_log2) over the row's keys, > 0
};

// One row over its key splits at the combine (hook b), in natural-log units.
struct SplitRowStats {
    float max;  // the largest LSE of the splits that saw a key; finite
    float sum;  // sum_s exp(lse_s - max) over the splits, >= 1
};

// Which row a hook is called for: what a modifier keys its terms by.
struct RowCoord {
    int batch;  // the sequence (its index in the call, past any batch chunking: sequence_of_cta)
    int head;   // the query head; under GQA packing the packed row's own head, head_idx * gqa_pack + row
    int row;    // the query row in its sequence (0 under GQA packing, whose rows are heads of query 0)
};

// The kernel's factors between score units and the softmax's: the LSE is max * score_scale + log(sum), and
// exp2 takes (s - max) * scale_log2 (FwdParams::score_scale, FwdParams::softmax_scale_log2).
struct RowScales {
    float score_scale;
    float scale_log2;
};

// What the kernels require of a row modifier. The hooks are const: a modifier holds no per-row state.
template <class RowMod>
concept RowModifier = requires(const RowMod& mod, RowStats& row, SplitRowStats& split_row, const RowCoord& coord,
                               const RowScales& scales, float value, int index) {
    // Whether the kernels call hooks (a), (b) and (d) at all.
    { RowMod::kActive } -> std::convertible_to<bool>;
    // Whether the modifier has a gradient of its own, and so whether the D step calls hook (c).
    { RowMod::kHasGrad } -> std::convertible_to<bool>;
    // (a) Folds the modifier's terms into a row's max and sum (updated in place) and returns the factor that the
    //     row's output accumulator takes besides 1 / sum: exp2((old max - new max) * scale_log2) when the fold
    //     raised the max (the accumulator holds values relative to the old one), else 1.
    { mod.fold_into_row(row, coord, scales) } -> std::same_as<float>;
    // (b) Folds the terms into a row's max and sum over its splits (updated in place), in natural-log units.
    { mod.fold_into_split_row(split_row, coord) } -> std::same_as<void>;
    // (c) A row's share of the modifier's gradient from its D = rowsum(dO * O) and its natural-log LSE (the
    //     forward's, with the terms folded in; +inf for a row with neither keys nor terms, whose share is 0).
    { mod.grad_term(value, value, coord) } -> std::same_as<float>;
    // (c) add_grad(total, batch, head): adds one CTA's sum of grad_term over its rows, all of one sequence and
    //     one query head, to the modifier's gradient.
    { mod.add_grad(value, index, index) } -> std::same_as<void>;
    // (d) The LSE of a row that saw no key: the log of the modifier's terms alone.
    { mod.empty_row_lse(coord) } -> std::same_as<float>;
};

// No row terms: flash-attn's softmax. A row that sees no key gets output 0 and LSE +inf, so that a later
// exp(s - LSE) is 0.
struct NoRowMod {
    static constexpr bool kActive = false;
    static constexpr bool kHasGrad = false;

    CUTE_HOST_DEVICE float fold_into_row(RowStats&, const RowCoord&, const RowScales&) const { return 1.f; }
    CUTE_HOST_DEVICE void fold_into_split_row(SplitRowStats&, const RowCoord&) const {}
    CUTE_HOST_DEVICE float grad_term(float /*dsum*/, float /*lse*/, const RowCoord&) const { return 0.f; }
    CUTE_HOST_DEVICE void add_grad(float /*total*/, int /*batch*/, int /*head*/) const {}
    CUTE_HOST_DEVICE float empty_row_lse(const RowCoord&) const { return INFINITY; }
};

static_assert(RowModifier<NoRowMod>);
static_assert(!NoRowMod::kActive && !NoRowMod::kHasGrad, "the plain softmax calls no hook");

// What a row's finalize produces: its natural-log LSE, and the factor its output accumulator takes.
struct RowResult {
    float lse;
    float o_scale;
};

// Hooks (a) and (d) as OnlineSoftmax::finalize will apply them to one row: `row` as it holds it (max -inf and
// sum 0 for a row that saw no key), out_scale its factor on the output (dropout's 1 / (1 - p)). A row that saw
// no key gets output 0 and empty_row_lse; any other, the LSE of its keys and the modifier's terms and
// out_scale / sum times fold_into_row's factor. With NoRowMod this is finalize's arithmetic as it stands.
template <class RowMod>
CUTE_DEVICE RowResult finish_row(const RowMod& mod, RowStats row, const RowCoord& coord, const RowScales& scales,
                                 float out_scale) {
    static_assert(RowModifier<RowMod>);
    if (row.sum == 0.f) { return {mod.empty_row_lse(coord), 0.f}; }
    float o_scale = out_scale;
    if constexpr (RowMod::kActive) { o_scale *= mod.fold_into_row(row, coord, scales); }
    return {row.max * scales.score_scale + __logf(row.sum), o_scale / row.sum};
}

// Hooks (b) and (d) as the combine will apply them to one row: `row` over its splits (max -inf when no split saw
// a key). Returns the row's natural-log LSE, from which each split's weight is exp(lse_s - LSE): 0 for the
// splits that saw no key, and for every split of a row that saw none.
template <class RowMod>
CUTE_DEVICE float finish_split_row(const RowMod& mod, SplitRowStats row, const RowCoord& coord) {
    static_assert(RowModifier<RowMod>);
    if (row.max == -INFINITY) { return mod.empty_row_lse(coord); }
    if constexpr (RowMod::kActive) { mod.fold_into_split_row(row, coord); }
    return row.max + logf(row.sum);
}

}  // namespace flash
