// Which (query, key) pairs are visible. The kernel asks the mask for the key-block range of a
// query block, whether a tile needs element-wise masking, and to apply it; new variants (a sliding
// window, ALiBi or softcap score modifiers) are new functors with the same three members, so the
// main loop does not branch on them.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

// Key bound plus, when kCausal, a bottom-right aligned causal mask: query row i sees key j iff
// j <= i + seqlen_k - seqlen_q (the flash-attn 2.x convention for seqlen_q != seqlen_k).
template <int kBlockM, int kBlockN, bool kCausal>
struct CausalMask {
    int seqlen_q;
    int seqlen_k;

    __forceinline__ __device__ CausalMask(int seqlen_q_, int seqlen_k_) : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_) {}

    // Last key column visible to query row `row` (may be negative: no key visible).
    __forceinline__ __device__ int last_visible_col(int row) const { return row + seqlen_k - seqlen_q; }

    // One past the last key block that query rows up to `last_row` must visit (<= 0: they see no key).
    __forceinline__ __device__ int n_block_end_for_rows(int last_row) const {
        const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
        if constexpr (!kCausal) {
            return n_blocks;
        } else {
            const int last_col = last_visible_col(last_row);
            return last_col < 0 ? 0 : min(n_blocks, last_col / kBlockN + 1);
        }
    }
    // The same for query block m_block.
    __forceinline__ __device__ int n_block_end(int m_block) const { return n_block_end_for_rows((m_block + 1) * kBlockM - 1); }

    // True when tile (m_block, n_block) has any invisible element; other tiles skip apply().
    __forceinline__ __device__ bool tile_needs_mask(int m_block, int n_block) const {
        const int col_end = (n_block + 1) * kBlockN;
        if (col_end > seqlen_k) { return true; }
        return kCausal && col_end - 1 > last_visible_col(m_block * kBlockM);
    }

    // scores: (rows, cols) view of the accumulator; coords: the matching (row, col) positions
    // inside the tile.
    template <class ScoreTensor, class CoordTensor>
    __forceinline__ __device__ void apply(ScoreTensor& scores, const CoordTensor& coords, int m_block,
                                          int n_block) const {
        const int row0 = m_block * kBlockM;
        const int col0 = n_block * kBlockN;
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
            const int row = row0 + get<0>(coords(r, 0));
            const int col_limit = kCausal ? min(seqlen_k, last_visible_col(row) + 1) : seqlen_k;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(scores); ++c) {
                if (col0 + get<1>(coords(r, c)) >= col_limit) { scores(r, c) = -INFINITY; }
            }
        }
    }
};

}  // namespace flash
