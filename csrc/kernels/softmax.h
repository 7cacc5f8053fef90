// Online softmax over key blocks, kept in registers. Scores arrive unscaled; the softmax scale is
// folded into the exp2 argument (one FFMA per score), and the output accumulator stays
// unnormalized until finalize().
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "kernels/row_mod.h"
#include "kernels/utils.h"

namespace flash {

using namespace cute;

template <int kRows>
struct OnlineSoftmax {
    // Per thread: the rows it holds in its accumulator fragments.
    Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_max;
    Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_sum;  // partial: this thread's columns only
    float scale_log2;

    __forceinline__ __device__ explicit OnlineSoftmax(float softmax_scale_log2) : scale_log2(softmax_scale_log2) {
        fill(row_max, -INFINITY);
        fill(row_sum, 0.f);
    }

    // Turns scores (rows, cols) into unnormalized probabilities exp2(s*scale - max*scale),
    // rescaling acc_o (rows, head_dim cols) by how much each row's running max moved.
    // kSkipUnmoved: the warp rescales only when some row of one of its lanes moved its max (a vote). The
    // correction of an unmoved row is exp2(0) = 1 exactly, so skipping changes no bit. In the mma.sync forward
    // ptxas predicates the rescale on the vote instead of branching around it, so its FMULs issue either way; but
    // it then interleaves them with the P V MMAs, and at head dim 128 that kernel spills half as much (84 bytes of
    // stores against 176) and runs 2-7% faster than with the unconditional rescale, on an H200. The vote is per
    // warp, so a warp's lanes must hold whole rows, as in the mma.sync kernel.
    template <bool kSkipUnmoved = false, class ScoreTensor, class AccOTensor>
    __forceinline__ __device__ void update(ScoreTensor& scores, AccOTensor& acc_o) {
        static_assert(decltype(size<0>(scores))::value == kRows);
        float max_scaled[kRows];
        float correction[kRows];
        bool moved = false;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const float block_max = running_max(scores, r);
            max_scaled[r] = scaled_max(block_max);
            correction[r] = exp2f(row_max(r) * scale_log2 - max_scaled[r]);
            moved |= block_max != row_max(r);
            row_max(r) = block_max;
        }
        if (!kSkipUnmoved || __any_sync(0xffffffffu, moved)) {
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) {
                row_sum(r) *= correction[r];
                CUTE_UNROLL
                for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= correction[r]; }
            }
        }
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float sum = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                scores(r, c) = exp2f(scores(r, c) * scale_log2 - max_scaled[r]);
                sum += scores(r, c);
            }
            row_sum(r) += sum;
        }
    }

    // update() in two halves, for a kernel whose previous P V MMA still accumulates into acc_o while this block's
    // softmax runs: exp_scores takes the new maxes, the exps and the row sums, and returns each row's correction,
    // which rescale() applies to acc_o once that MMA has completed.
    template <class ScoreTensor>
    __forceinline__ __device__ auto exp_scores(ScoreTensor& scores) {
        static_assert(decltype(size<0>(scores))::value == kRows);
        Tensor correction = make_tensor<float>(Shape<Int<kRows>>{});
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const float block_max = running_max_tree(scores, r);
            const float max_scaled = scaled_max(block_max);
            correction(r) = exp2f(row_max(r) * scale_log2 - max_scaled);
            row_max(r) = block_max;
            float sum = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                scores(r, c) = exp2f(scores(r, c) * scale_log2 - max_scaled);
                sum += scores(r, c);
            }
            row_sum(r) = row_sum(r) * correction(r) + sum;
        }
        return correction;
    }
    template <class AccOTensor, class CorrectionTensor>
    __forceinline__ __device__ static void rescale(AccOTensor& acc_o, const CorrectionTensor& correction) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= correction(r); }
        }
    }

    // Divides acc_o by the row sums once (and multiplies it by out_scale: dropout's 1 / (1 - p)) and returns each
    // row's natural-log LSE; score_scale is the factor that scale_log2 holds times log2(e).
    // Rows that saw no key get output 0 and LSE +inf (so a later exp(s - lse) is 0).
    template <class AccOTensor>
    __forceinline__ __device__ auto finalize(AccOTensor& acc_o, float score_scale, float out_scale) {
        Tensor lse = make_tensor<float>(Shape<Int<kRows>>{});
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const float sum = quad_allreduce(row_sum(r), [](float a, float b) { return a + b; });
            const bool empty = sum == 0.f;
            const float inv_sum = empty ? 0.f : out_scale / sum;
            lse(r) = empty ? INFINITY : row_max(r) * score_scale + __logf(sum);
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= inv_sum; }
        }
        return lse;
    }

    // Folds a row modifier's terms (row_mod.h) into rows that finalize finished: lse holds each of the thread's rows'
    // natural-log LSE and acc_o its output, normalized; head_of(r) is the query head of its row r. Kept apart from
    // finalize, behind the caller's one uniform branch (or, in the warp-specialized kernel, a form of its own), so
    // that finalize's code stays as it was: folded into it, the fold moved that kernel's main loop
    // (docs/design-notes.md, 'Learnable sinks'). It costs a call with a modifier one more multiply per output value.
    template <class RowMod, class AccOTensor, class LseTensor, class HeadOf>
    __forceinline__ __device__ static void fold_row_terms(AccOTensor& acc_o, LseTensor& lse, const RowMod& mod,
                                                          HeadOf head_of) {
        static_assert(decltype(size<0>(acc_o))::value == kRows && decltype(size(lse))::value == kRows);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const RowResult row = fold_into_lse(mod, lse(r), RowCoord{head_of(r)});
            lse(r) = row.lse;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o); ++c) { acc_o(r, c) *= row.o_scale; }
        }
    }

  private:
    // Row r's max over the keys seen so far and this block's scores (its quad's four threads together).
    template <class ScoreTensor>
    __forceinline__ __device__ float running_max(const ScoreTensor& scores, int r) const {
        float block_max = row_max(r);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) { block_max = fmaxf(block_max, scores(r, c)); }
        return quad_allreduce(block_max, [](float a, float b) { return fmaxf(a, b); });
    }
    // The same maximum, taken in a tree of pairs instead of a chain: the exps wait on it, and a chain of one max
    // after another is as long as the row (32 dependent instructions for a 128-key block), where a tree is 5 deep.
    // The order of a max does not change its value.
    template <class ScoreTensor>
    __forceinline__ __device__ float running_max_tree(const ScoreTensor& scores, int r) const {
        constexpr int kCols = decltype(size<1>(scores))::value;
        float partial[kCols];
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) { partial[c] = scores(r, c); }
        CUTE_UNROLL
        for (int width = 1; width < kCols; width *= 2) {
            CUTE_UNROLL
            for (int c = 0; c + width < kCols; c += 2 * width) { partial[c] = fmaxf(partial[c], partial[c + width]); }
        }
        return quad_allreduce(fmaxf(row_max(r), partial[0]), [](float a, float b) { return fmaxf(a, b); });
    }
    // The exp2 offset of a row max. A row that has seen only masked keys keeps max = -inf; subtracting 0
    // instead keeps exp2(-inf) = 0 rather than NaN.
    __forceinline__ __device__ float scaled_max(float row_max_value) const {
        return row_max_value == -INFINITY ? 0.f : row_max_value * scale_log2;
    }
};

}  // namespace flash
