// Attention dropout: which probabilities a call drops, and dropping them. The mask is a pure function of the
// call's rng_state (two int64 on the device: a seed and an offset, drawn by the Python side from torch's
// generator for each call) and of each element's (sequence, query head, query row, key), so the backward
// regenerates exactly the forward's mask, in any kernel and either orientation, and a CUDA graph replay that
// redraws rng_state gets a fresh one. flash_attn_cuda/dropout.py computes the same mask in PyTorch.
//
// The random bits come from Philox4x32-10 (Salmon et al., SC 2011): key = the seed, counter = (row with bit 3
// cleared, key with bit 0 cleared, sequence * num_heads + head, the offset's low word). One call yields four
// 32-bit words, one for each element of {row, row + 8} x {key, key + 1}: in the accumulator layouts of mma.sync
// and wgmma a thread holds exactly such groups (rows 8 apart, adjacent column pairs), so every word is used. Only
// the Hopper backward's transposed S^T (keys as rows) gives a thread half of each group, which costs it twice the
// calls per element. An element is dropped when its word is below FwdParams::dropout_threshold (32 bits of
// resolution on p).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "launch/flash_params.h"
#include "kernels/mask.h"  // query_of, key_of

namespace flash {

using namespace cute;

// Philox4x32 with 10 rounds on counter (c0, c1, c2, c3) and key (k0, k1).
__forceinline__ __device__ uint4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                               uint32_t k1) {
    CUTE_UNROLL
    for (int round = 0; round < 10; ++round) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

// The dropout of one (sequence, query head). Like ScoreMod it reads the __grid_constant__ params where used and
// the seed and offset only inside apply, so that without dropout it holds no registers in the main loops.
struct Dropout {
    const FwdParams& params;
    int batch_idx;
    int head_idx;

    __forceinline__ __device__ Dropout(const FwdParams& params_, int batch_idx_, int head_idx_)
        : params(params_), batch_idx(batch_idx_), head_idx(head_idx_) {}

    __forceinline__ __device__ bool active() const { return params.dropout_threshold != 0u; }

    // Marks the dropped values of a tile. p: (rows, cols) view of an accumulator in the mma.sync or wgmma
    // layout (mode 0 of the rows: +8 rows; mode 0 of the cols: +1 column; then 8-column groups), coords its tile
    // positions, kQueryIsRow as in mask.h (false: rows are keys and columns are queries, the Hopper backward's
    // S^T). q0 and k0: the tile's first query row and key within the sequence. kNegate: dropped values are
    // negated (the backward keeps P for dS and tells dropped from kept by the sign, see bwd_p_ds.h), else set to 0.
    template <bool kQueryIsRow, bool kNegate, class PTensor, class CoordTensor>
    __forceinline__ __device__ void apply(PTensor& p, const CoordTensor& coords, int q0, int k0) const {
        static_assert(decltype(size<0>(p))::value % 2 == 0 && decltype(size<1>(p))::value % 4 == 0);
        const uint64_t seed = uint64_t(params.rng_state_ptr[0]);
        const uint32_t key0 = uint32_t(seed), key1 = uint32_t(seed >> 32);
        const uint32_t offset = uint32_t(uint64_t(params.rng_state_ptr[1]));
        const uint32_t stream = uint32_t(batch_idx) * uint32_t(params.num_heads) + uint32_t(head_idx);
        const uint32_t threshold = params.dropout_threshold;
        auto bits = [&](int row, int key) {
            return philox4x32_10(uint32_t(row) & ~8u, uint32_t(key) & ~1u, stream, offset, key0, key1);
        };
        auto drop = [&](float& x, uint32_t word) {
            if (word < threshold) { x = kNegate ? -x : 0.f; }
        };
        if constexpr (kQueryIsRow) {
            // Rows r, r + 1 are queries q, q + 8; columns c, c + 1 keys k, k + 1: one group each.
            CUTE_UNROLL
            for (int r = 0; r < size<0>(p); r += 2) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(p); c += 2) {
                    const uint4 w = bits(q0 + query_of<true>(coords, r, c), k0 + key_of<true>(coords, r, c));
                    drop(p(r, c), w.x);
                    drop(p(r, c + 1), w.y);
                    drop(p(r + 1, c), w.z);
                    drop(p(r + 1, c + 1), w.w);
                }
            }
        } else {
            // Rows r, r + 1 are keys k, k + 8; columns c and c + 2 queries q, q + 8 (c in an even 8-column group).
            // Keys k and k + 1 are another thread's, so each group gives this thread two of its four words.
            CUTE_UNROLL
            for (int r = 0; r < size<0>(p); ++r) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(p); c += ((c & 1) == 0 ? 1 : 3)) {
                    const int key = k0 + key_of<false>(coords, r, c);
                    const uint4 w = bits(q0 + query_of<false>(coords, r, c), key);
                    const bool odd = (key & 1) != 0;
                    drop(p(r, c), odd ? w.y : w.x);
                    drop(p(r, c + 2), odd ? w.w : w.z);
                }
            }
        }
    }
};

}  // namespace flash
