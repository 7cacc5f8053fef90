// Which blocks of a sequence's (query, key) plane a kernel visits: the one owner of block ranges, for both
// passes and both kernel families. A forward CTA asks which key blocks a query block (or a range of its
// rows) visits; a backward CTA asks which query blocks a key block is seen by; both ask which tiles need
// element-wise masking (mask.h masks them), and the forward re-bases a split-KV share of the keys here.
//
// The visibility rule is written once, in first_visible_key and last_visible_key: every bound below derives
// from them. kCausal selects the masked kernels. Without kWindow their rule is causal (bottom-right aligned,
// no left edge), as compiled; with kWindow (the variants kernels) it is a window (flash-attn's window_size =
// (left, right)) read at run time, causal being (unbounded, 0), and an unbounded side holds a bound past every
// key (FwdParams::window_left), so one arithmetic serves all windows with no test for -1. Without kCausal every
// key is visible and the window is never read.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "kernels/block_info.h"
#include "launch/flash_params.h"

namespace flash {

// Key blocks [begin, end) of a key range: empty when end <= begin.
struct BlockRange {
    int begin;
    int end;
};

template <int kBlockM, int kBlockN, bool kCausal, bool kWindow = false>
struct BlockBounds {
    static_assert(kBlockM > 0 && kBlockN > 0);
    static_assert(kCausal || !kWindow, "a window runs the masked kernels");

    int seqlen_q;
    int seqlen_k;
    int window_left;   // kWindow only: see FwdParams::window_left
    int window_right;

    __forceinline__ __device__ BlockBounds(int seqlen_q_, int seqlen_k_, int window_left_, int window_right_)
        : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), window_left(window_left_), window_right(window_right_) {}

    // The bounds of the sequence binfo describes: where every kernel gets its bounds, so that the window's
    // sizes are read from params here and nowhere else.
    __forceinline__ __device__ static BlockBounds of_sequence(const FwdParams& params, const BlockInfo& binfo) {
        return kWindow ? BlockBounds(binfo.seqlen_q, binfo.seqlen_k, params.window_left, params.window_right)
                       : BlockBounds(binfo.seqlen_q, binfo.seqlen_k, 0, 0);
    }

    // The rule. Query row q has position q + seqlen_k - seqlen_q (bottom-right aligned, the flash-attn 2.x
    // convention for seqlen_q != seqlen_k) and sees keys [first_visible_key(q), last_visible_key(q)]. Either may
    // lie outside [0, seqlen_k); an empty range means no key is visible. Without kCausal every key is visible
    // and the bounds below ignore these.
    __forceinline__ __device__ int last_visible_key(int q) const {
        return q + seqlen_k - seqlen_q + (kWindow ? window_right : 0);
    }
    __forceinline__ __device__ int first_visible_key(int q) const { return q + seqlen_k - seqlen_q - window_left; }

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
    // The first key block that query rows from first_row on visit.
    __forceinline__ __device__ int n_block_begin_for_rows(int first_row) const {
        if constexpr (!kWindow) {
            return 0;
        } else {
            return max(0, first_visible_key(first_row)) / kBlockN;
        }
    }
    // The same for query block m_block.
    __forceinline__ __device__ int n_block_end(int m_block) const {
        return n_block_end_for_rows((m_block + 1) * kBlockM - 1);
    }
    __forceinline__ __device__ int n_block_begin(int m_block) const {
        return n_block_begin_for_rows(m_block * kBlockM);
    }

    // The query blocks that visit key block n_block, [m_block_begin, m_block_end): exactly the m_block with
    // n_block_begin(m_block) <= n_block < n_block_end(m_block), so both passes agree on every tile (the
    // deterministic backward counts on it). The first: the block holding the first row whose last visible key
    // reaches the key block. One past the last: past the last row whose first visible key lies in or before it.
    __forceinline__ __device__ int m_block_begin(int n_block) const {
        if constexpr (kCausal) {
            const int first_row = n_block * kBlockN - last_visible_key(0);
            return first_row <= 0 ? 0 : min(first_row / kBlockM, m_blocks());
        } else {
            return 0;
        }
    }
    __forceinline__ __device__ int m_block_end(int n_block) const {
        if constexpr (kWindow) {
            const int last_row = (n_block + 1) * kBlockN - 1 - first_visible_key(0);
            return last_row < 0 ? 0 : min(last_row / kBlockM + 1, m_blocks());
        } else {
            return m_blocks();
        }
    }

    // Tile (m_block, n_block) in tile-relative positions: query q < kBlockM, key k < kBlockN. k is hidden from
    // q past the right edge, k - q > diag(m_block, n_block), and before the left edge, k - q < left_diag(...).
    __forceinline__ __device__ int diag(int m_block, int n_block) const {
        return last_visible_key(m_block * kBlockM) - n_block * kBlockN;
    }
    __forceinline__ __device__ int left_diag(int m_block, int n_block) const {
        return first_visible_key(m_block * kBlockM) - n_block * kBlockN;
    }
    // Keys k >= key_end(n_block) lie past the sequence end.
    __forceinline__ __device__ int key_end(int n_block) const { return seqlen_k - n_block * kBlockN; }
    // True when the tile's keys reach past the right edge of its first query row (kBlockN - 1 > diag, in
    // absolute positions: in that form the mma.sync backward keeps its spills at hdim 64).
    __forceinline__ __device__ bool crosses_diagonal(int m_block, int n_block) const {
        return kCausal && (n_block + 1) * kBlockN - 1 > last_visible_key(m_block * kBlockM);
    }
    // True when the tile's first key lies before the left edge of its last query row (0 < left_diag of that
    // row). Never for causal: its left bound lies before key 0.
    __forceinline__ __device__ bool crosses_left_edge(int m_block, int n_block) const {
        return kWindow && n_block * kBlockN < first_visible_key((m_block + 1) * kBlockM - 1);
    }
    // True when tile (m_block, n_block) has any invisible element (the sequence end, or a window edge).
    __forceinline__ __device__ bool tile_needs_mask(int m_block, int n_block) const {
        return (n_block + 1) * kBlockN > seqlen_k || crosses_diagonal(m_block, n_block) ||
               crosses_left_edge(m_block, n_block);
    }

    // Split-KV: split `split` of num_splits takes an equal share of key blocks `blocks` (a query block's,
    // so under a mask only those it sees). Returns the share as blocks of the re-based keys, and when
    // it is not empty re-bases the keys: the share's first key becomes key 0 and seqlen_k shrinks by as much
    // (the caller moves its key pointer by first_key). The rule is unchanged by this (both window edges are
    // offsets from seqlen_k - seqlen_q: key j + first_key <= q + seqlen_k - seqlen_q + right iff
    // j <= q + (seqlen_k - first_key) - seqlen_q + right, and likewise on the left), so the main loops run over
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

// Visits blocks from `from` towards `to` (excluded) in steps of kStep (+1 or -1), calling step(block, masked):
// masked is std::true_type while needs_mask(block) holds and std::false_type from the first block that needs
// none. The plain kernels visit their masked tiles (the sequence end, the causal diagonal) first, so the steps
// after them can be compiled without mask code. With kSplit false every block gets std::true_type.
template <int kStep, bool kSplit, class NeedsMask, class Step>
__forceinline__ __device__ void visit_masked_first(int from, int to, const NeedsMask& needs_mask, const Step& step) {
    static_assert(kStep == 1 || kStep == -1);
    auto more = [&](int block) { return kStep > 0 ? block < to : block > to; };
    int block = from;
    if constexpr (kSplit) {
        for (; more(block) && needs_mask(block); block += kStep) { step(block, std::true_type{}); }
    }
    for (; more(block); block += kStep) { step(block, std::bool_constant<!kSplit>{}); }
}

}  // namespace flash
