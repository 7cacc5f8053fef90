// Which blocks of a sequence's (query, key) plane a kernel visits: the one owner of block ranges, for both
// passes and both kernel families. A forward CTA asks which key blocks a query block (or a range of its
// rows) visits; a backward CTA asks which query blocks a key block is seen by; both ask which tiles need
// element-wise masking (mask.h masks them), and the forward re-bases a split-KV share of the keys here.
//
// The visibility rule is written once, in last_visible_key: every bound below derives from it. A sliding
// window (flash-attn's window_size = (left, right), causal being (-1, 0)) would add a kLocal flag and the two
// ints, a first_visible_key(q), lower bounds for the ranges that are 0 today (n_block_begin*), upper bounds
// for those that are m_blocks() today (m_block_end), and the left edge in TileMask's tests (mask.h); the
// kernels already loop over [begin, end).
#pragma once

#include <cute/tensor.hpp>

#include "block_info.h"
#include "flash_params.h"

namespace flash {

// Key blocks [begin, end) of a key range: empty when end <= begin.
struct BlockRange {
    int begin;
    int end;
};

template <int kBlockM, int kBlockN, bool kCausal>
struct BlockBounds {
    static_assert(kBlockM > 0 && kBlockN > 0);

    int seqlen_q;
    int seqlen_k;

    __forceinline__ __device__ BlockBounds(int seqlen_q_, int seqlen_k_) : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_) {}

    // The bounds of the sequence binfo describes: where every kernel gets its bounds, so that a window's sizes
    // would be read from params here and nowhere else.
    __forceinline__ __device__ static BlockBounds of_sequence(const FwdParams& /*params*/, const BlockInfo& binfo) {
        return BlockBounds(binfo.seqlen_q, binfo.seqlen_k);
    }

    // The rule. Causal is bottom-right aligned (the flash-attn 2.x convention for seqlen_q != seqlen_k): query
    // row q sees key j iff j <= q + seqlen_k - seqlen_q. May be negative: no key visible. Without kCausal
    // every key is visible; the bounds below then ignore it.
    __forceinline__ __device__ int last_visible_key(int q) const { return q + seqlen_k - seqlen_q; }

    __forceinline__ __device__ int m_blocks() const { return (seqlen_q + kBlockM - 1) / kBlockM; }
    __forceinline__ __device__ int n_blocks() const { return (seqlen_k + kBlockN - 1) / kBlockN; }

    // One past the last key block that query rows up to last_row visit (<= 0: none).
    __forceinline__ __device__ int n_block_end_for_rows(int last_row) const {
        if constexpr (!kCausal) {
            return n_blocks();
        } else {
            const int last_key = last_visible_key(last_row);
            return last_key < 0 ? 0 : min(n_blocks(), last_key / kBlockN + 1);
        }
    }
    // The first key block that query rows from first_row on visit: 0 without a left window bound.
    __forceinline__ __device__ int n_block_begin_for_rows(int /*first_row*/) const { return 0; }
    // The same for query block m_block.
    __forceinline__ __device__ int n_block_end(int m_block) const {
        return n_block_end_for_rows((m_block + 1) * kBlockM - 1);
    }
    __forceinline__ __device__ int n_block_begin(int m_block) const {
        return n_block_begin_for_rows(m_block * kBlockM);
    }

    // The first query block with a row that sees a key of block n_block (the first row q with
    // last_visible_key(q) >= n_block * kBlockN), and one past the last.
    __forceinline__ __device__ int m_block_begin(int n_block) const {
        if constexpr (kCausal) {
            const int first_row = n_block * kBlockN - last_visible_key(0);
            return first_row <= 0 ? 0 : min(first_row / kBlockM, m_blocks());
        } else {
            return 0;
        }
    }
    __forceinline__ __device__ int m_block_end(int /*n_block*/) const { return m_blocks(); }

    // Tile (m_block, n_block) in tile-relative positions: query q < kBlockM, key k < kBlockN.
    // Causal: k is hidden from q iff k - q > diag(m_block, n_block).
    __forceinline__ __device__ int diag(int m_block, int n_block) const {
        return last_visible_key(m_block * kBlockM) - n_block * kBlockN;
    }
    // Keys k >= key_end(n_block) lie past the sequence end.
    __forceinline__ __device__ int key_end(int n_block) const { return seqlen_k - n_block * kBlockN; }
    // True when the tile's keys reach past the diagonal of its first query row (kBlockN - 1 > diag, in
    // absolute positions: in that form the mma.sync backward keeps its spills at hdim 64).
    __forceinline__ __device__ bool crosses_diagonal(int m_block, int n_block) const {
        return kCausal && (n_block + 1) * kBlockN - 1 > last_visible_key(m_block * kBlockM);
    }
    // True when tile (m_block, n_block) has any invisible element (the sequence end, or the diagonal).
    __forceinline__ __device__ bool tile_needs_mask(int m_block, int n_block) const {
        return (n_block + 1) * kBlockN > seqlen_k || crosses_diagonal(m_block, n_block);
    }

    // Split-KV: split `split` of num_splits takes an equal share of key blocks `blocks` (a query block's,
    // so under a causal mask only those it sees). Returns the share as blocks of the re-based keys, and when
    // it is not empty re-bases the keys: the share's first key becomes key 0 and seqlen_k shrinks by as much
    // (the caller moves its key pointer by first_key). The rule is unchanged by this (key j + first_key <=
    // q + seqlen_k - seqlen_q iff j <= q + (seqlen_k - first_key) - seqlen_q), so the main loops run over
    // [0, end) as without splits and keep no split offset in a register.
    __forceinline__ __device__ BlockRange split_keys(BlockRange blocks, int split, int num_splits, int& first_key) {
        const int per_split = (max(blocks.end - blocks.begin, 0) + num_splits - 1) / num_splits;
        const int begin = blocks.begin + split * per_split;
        const int end = min(blocks.end - begin, per_split);
        first_key = 0;
        if (end > 0) {
            first_key = begin * kBlockN;
            seqlen_k -= first_key;
        }
        return {0, end};
    }
};

}  // namespace flash
