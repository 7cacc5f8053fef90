// Score modifiers: a function of each raw score (the Q K^T dot product, before the softmax scale) and its
// absolute position, applied before the mask. This is where softcap and ALiBi go. Positions are those of the
// kernel's key frame: a split-KV CTA sees its share of the keys re-based to key 0 with seqlen_k shrunk by
// as much (BlockBounds::split_keys), so functions of k - q - (seqlen_k - seqlen_q), as ALiBi's bottom-right
// aligned distance, are unchanged by it. A modifier declares kIdentity = true to be compiled out entirely.
#pragma once

#include <cute/tensor.hpp>

#include "mask.h"

namespace flash {

using namespace cute;

// The absolute position of a tile: its first query row and first key, and the query head.
struct ScorePos {
    int q0;
    int k0;
    int head;
};

struct NoScoreMod {
    static constexpr bool kIdentity = true;
    __forceinline__ __device__ float operator()(float score, int /*q*/, int /*k*/, int /*head*/) const { return score; }
};

// scores: (rows, cols) view of the accumulator; coords: the matching tile positions, the query along mode 0
// when kQueryIsRow, else along mode 1.
template <bool kQueryIsRow, class ScoreMod, class ScoreTensor, class CoordTensor>
__forceinline__ __device__ void apply_score_mod(const ScoreMod& score_mod, ScoreTensor& scores,
                                                const CoordTensor& coords, const ScorePos& pos) {
    if constexpr (!ScoreMod::kIdentity) {
        CUTE_UNROLL
        for (int i = 0; i < size<0>(scores); ++i) {
            CUTE_UNROLL
            for (int j = 0; j < size<1>(scores); ++j) {
                scores(i, j) = score_mod(scores(i, j), pos.q0 + query_of<kQueryIsRow>(coords, i, j),
                                         pos.k0 + key_of<kQueryIsRow>(coords, i, j), pos.head);
            }
        }
    }
}

}  // namespace flash
