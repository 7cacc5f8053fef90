// Which elements of one (query block, key block) tile are hidden, and hiding them. Every kernel builds a
// TileMask from its BlockBounds (block.h, the one place the visibility rule lives) and hands it the
// accumulator as a (rows, cols) view with the matching coordinate view. kQueryIsRow says which coordinate
// is the query: true for S = Q K^T tiles, false for the Hopper backward's transposed S^T = K Q^T tiles.
// Coordinates are tile-relative; the mask adds the tile's origin where a test needs absolute positions. The
// window's two edges (BlockBounds) are tested only in tiles that cross them, which each test decides per tile.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "kernels/block.h"

namespace flash {

using namespace cute;

// (query, key) tile position of value (i, j) of a (rows, cols) coordinate view.
template <bool kQueryIsRow, class CoordTensor>
__forceinline__ __device__ int query_of(const CoordTensor& coords, int i, int j) {
    return kQueryIsRow ? get<0>(coords(i, j)) : get<1>(coords(i, j));
}
template <bool kQueryIsRow, class CoordTensor>
__forceinline__ __device__ int key_of(const CoordTensor& coords, int i, int j) {
    return kQueryIsRow ? get<1>(coords(i, j)) : get<0>(coords(i, j));
}
template <bool kQueryIsRow, class T>
__forceinline__ __device__ constexpr int query_extent(const T& t) {
    return kQueryIsRow ? int(size<0>(t)) : int(size<1>(t));
}
template <bool kQueryIsRow, class T>
__forceinline__ __device__ constexpr int key_extent(const T& t) {
    return kQueryIsRow ? int(size<1>(t)) : int(size<0>(t));
}

template <int kBlockM, int kBlockN, bool kCausal, bool kWindow = false>
struct TileMask {
    BlockBounds<kBlockM, kBlockN, kCausal, kWindow> bounds;
    int m_block;
    int n_block;

    __forceinline__ __device__ TileMask(const BlockBounds<kBlockM, kBlockN, kCausal, kWindow>& bounds_, int m_block_,
                                        int n_block_)
        : bounds(bounds_), m_block(m_block_), n_block(n_block_) {}

    // Whether the tile hides anything at all; tiles that do not skip the element tests.
    __forceinline__ __device__ bool needs_mask() const { return bounds.tile_needs_mask(m_block, n_block); }

    // Key k is hidden from query q by a window edge (k - q > BlockBounds::diag, or k - q < left_diag): the test
    // of kernels that handle the sequence end apart (hide_keys_past_end). Whether the tile crosses each edge is
    // tile-uniform, so tiles inside the window skip the per-element tests; the left edge is never crossed
    // under a causal mask.
    __forceinline__ __device__ bool hides_past_diagonal(int q, int k) const {
        const int diag = bounds.diag(m_block, n_block);
        const bool right = kCausal && kBlockN - 1 > diag && k - q > diag;
        if constexpr (!kWindow) {
            return right;
        } else {
            const int left_diag = bounds.left_diag(m_block, n_block);
            return right || (left_diag > 1 - kBlockM && k - q < left_diag);
        }
    }

    // Whether hides_past_diagonal can hide anything in this tile: its tile-uniform half. Exp loops that test per
    // element take a loop without the test when it is false.
    __forceinline__ __device__ bool may_hide_past_diagonal() const {
        const bool right = kCausal && kBlockN - 1 > bounds.diag(m_block, n_block);
        if constexpr (!kWindow) {
            return right;
        } else {
            return right || bounds.left_diag(m_block, n_block) > 1 - kBlockM;
        }
    }

    // Sets every hidden score of the tile (outside the window or past the sequence end) to -inf, so the softmax
    // gives it weight 0. scores: (rows, cols) view of the accumulator; coords: the matching tile positions.
    // Each query's visible keys [key_begin, key_limit) are formed from its absolute row (capped at the sequence)
    // and compared with absolute keys: in the mma.sync backward the same test in tile-relative positions
    // (against diag) cost a spill.
    template <bool kQueryIsRow, class ScoreTensor, class CoordTensor>
    __forceinline__ __device__ void apply(ScoreTensor& scores, const CoordTensor& coords) const {
        static_assert(decltype(size(scores))::value == decltype(size(coords))::value, "one coordinate per score");
        const int q0 = m_block * kBlockM;
        const int k0 = n_block * kBlockN;
        const bool left_edge = kWindow && bounds.crosses_left_edge(m_block, n_block);
        CUTE_UNROLL
        for (int qi = 0; qi < query_extent<kQueryIsRow>(scores); ++qi) {
            const int q = q0 + query_of<kQueryIsRow>(coords, kQueryIsRow ? qi : 0, kQueryIsRow ? 0 : qi);
            const int key_limit = kCausal ? min(bounds.seqlen_k, bounds.last_visible_key(q) + 1) : bounds.seqlen_k;
            const int key_begin = left_edge ? bounds.first_visible_key(q) : 0;
            CUTE_UNROLL
            for (int ki = 0; ki < key_extent<kQueryIsRow>(scores); ++ki) {
                const int i = kQueryIsRow ? qi : ki;
                const int j = kQueryIsRow ? ki : qi;
                const int k = k0 + key_of<kQueryIsRow>(coords, i, j);
                if (k >= key_limit || (kWindow && k < key_begin)) { scores(i, j) = -INFINITY; }
            }
        }
    }

    // Sets p to 0 for keys past the sequence end: a fix-up after the exp for kernels that test only the
    // diagonal inside it (hides_past_diagonal). Such keys read as zeros, which gives them P = exp(-lse); for a
    // row whose LSE is far below zero (a few large-magnitude keys) that overflows, to inf in fp16 or even fp32,
    // and dQ = dS K then computes inf * 0 = NaN. p and coords: (rows, cols) views, walked in the same order.
    // Only the key block that holds the sequence end runs the loop, after the exp, so the exp loops keep their
    // registers (a key-end test inside them made the hdim 128 Hopper backward spill in its step loop).
    // The same for query rows past the sequence end, for kernels whose tiles there hold another sequence's rows (the
    // warp-specialized backward's TMA loads of variable-length batches): their probabilities become 0, and so does
    // everything computed from them.
    template <bool kQueryIsRow, class PTensor, class CoordTensor>
    __forceinline__ __device__ void hide_queries_past_end(PTensor& p, const CoordTensor& coords) const {
        static_assert(decltype(size(p))::value == decltype(size(coords))::value, "one coordinate per value");
        const int query_end = bounds.seqlen_q - m_block * kBlockM;
        if (query_end >= kBlockM) { return; }
        CUTE_UNROLL
        for (int i = 0; i < size(p); ++i) {
            if ((kQueryIsRow ? get<0>(coords(i)) : get<1>(coords(i))) >= query_end) { p(i) = 0.f; }
        }
    }

    template <bool kQueryIsRow, class PTensor, class CoordTensor>
    __forceinline__ __device__ void hide_keys_past_end(PTensor& p, const CoordTensor& coords) const {
        static_assert(decltype(size(p))::value == decltype(size(coords))::value, "one coordinate per value");
        const int key_end = bounds.key_end(n_block);
        if (key_end >= kBlockN) { return; }
        CUTE_UNROLL
        for (int i = 0; i < size(p); ++i) {
            if ((kQueryIsRow ? get<1>(coords(i)) : get<0>(coords(i))) >= key_end) { p(i) = 0.f; }
        }
    }
};

// The mask of a tile known to hide nothing: kernels whose step loops run the masked tiles apart pass it to the
// others, so they carry no mask code.
struct NoTileMask {
    __forceinline__ __device__ static constexpr bool needs_mask() { return false; }
    template <bool kQueryIsRow, class ScoreTensor, class CoordTensor>
    __forceinline__ __device__ void apply(ScoreTensor&, const CoordTensor&) const {}
};

}  // namespace flash
