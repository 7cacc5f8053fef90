// The backward's recompute of P from the saved LSE, and of dS from dP: one pair of functions for the three
// backward paths (the mma.sync kernel, and both Hopper kernels, whose narrow one works on transposed S^T and
// dP^T tiles and issues the dV GEMM between the two calls). Accumulators come as (rows, cols) views with a
// matching coordinate view; kQueryIsRow says which coordinate is the query. The loops run queries outer and
// keys inner in either orientation, so each query's LSE and D are read once.
#pragma once

#include <cute/tensor.hpp>

#include "mask.h"
#include "score_mod.h"

namespace flash {

using namespace cute;

// Where compute_p hides the masked elements (P = 0 either way; both are exact):
// - kBeforeExp: masked tiles get -inf scores before the exp (TileMask::apply), behind one branch per tile.
//   The mma.sync kernel, which has registers to spare.
// - kInExp: the exp loop selects 0 past the diagonal (TileMask::hides_past_diagonal), and keys past the
//   sequence end get P = 0 in a fix-up after it (TileMask::hide_keys_past_end). The Hopper kernels run at
//   the register limit: in this form their exp loops keep their registers (perf log 36; a key-end test in
//   the exp loop made the hdim 128 kernel spill in the step loop).
enum class HideP { kBeforeExp, kInExp };

// s: the scores S (or S^T), overwritten with P = exp2(s * scale_log2 - lse_log2_of(q)), where lse_log2_of(q)
// is the LSE of tile query q times log2(e). coords: the tile positions of s's values; mask: this tile's
// TileMask; score_mod applies first, at the tile's absolute position pos.
template <bool kQueryIsRow, HideP kHide, class ScoreMod, class Mask, class STensor, class CoordTensor, class LseLog2Of>
__forceinline__ __device__ void compute_p(STensor& s, const CoordTensor& coords, const Mask& mask,
                                          const ScoreMod& score_mod, const ScorePos& pos, float scale_log2,
                                          LseLog2Of lse_log2_of) {
    static_assert(decltype(size(s))::value == decltype(size(coords))::value, "one coordinate per value");
    apply_score_mod<kQueryIsRow>(score_mod, s, coords, pos);
    if constexpr (kHide == HideP::kBeforeExp) {
        if (mask.needs_mask()) { mask.template apply<kQueryIsRow>(s, coords); }
    }
    CUTE_UNROLL
    for (int qi = 0; qi < query_extent<kQueryIsRow>(s); ++qi) {
        const int q = query_of<kQueryIsRow>(coords, kQueryIsRow ? qi : 0, kQueryIsRow ? 0 : qi);
        const float lse_log2 = lse_log2_of(q);
        CUTE_UNROLL
        for (int ki = 0; ki < key_extent<kQueryIsRow>(s); ++ki) {
            const int i = kQueryIsRow ? qi : ki;
            const int j = kQueryIsRow ? ki : qi;
            if constexpr (kHide == HideP::kInExp) {
                const bool hidden = mask.hides_past_diagonal(q, key_of<kQueryIsRow>(coords, i, j));
                s(i, j) = hidden ? 0.f : exp2f(s(i, j) * scale_log2 - lse_log2);
            } else {
                s(i, j) = exp2f(s(i, j) * scale_log2 - lse_log2);
            }
        }
    }
    if constexpr (kHide == HideP::kInExp) { mask.template hide_keys_past_end<kQueryIsRow>(s, coords); }
}

// dp: dP (or dP^T), overwritten with dS = P (dP - dsum_of(q)), the gradient of the scaled scores, where
// dsum_of(q) is D = rowsum(dO * O) of tile query q. p: P from compute_p, in the same orientation.
template <bool kQueryIsRow, class DpTensor, class PTensor, class CoordTensor, class DsumOf>
__forceinline__ __device__ void compute_ds(DpTensor& dp, const PTensor& p, const CoordTensor& coords, DsumOf dsum_of) {
    static_assert(decltype(size(dp))::value == decltype(size(p))::value &&
                  decltype(size(dp))::value == decltype(size(coords))::value, "dP, P and coords of one tile");
    CUTE_UNROLL
    for (int qi = 0; qi < query_extent<kQueryIsRow>(dp); ++qi) {
        const float dsum = dsum_of(query_of<kQueryIsRow>(coords, kQueryIsRow ? qi : 0, kQueryIsRow ? 0 : qi));
        CUTE_UNROLL
        for (int ki = 0; ki < key_extent<kQueryIsRow>(dp); ++ki) {
            const int i = kQueryIsRow ? qi : ki;
            const int j = kQueryIsRow ? ki : qi;
            dp(i, j) = p(i, j) * (dp(i, j) - dsum);
        }
    }
}

}  // namespace flash
