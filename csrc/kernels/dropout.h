// Attention dropout: which probabilities a call drops, and dropping them. The mask is a pure function of the
// call's rng_state (two int64 on the device: a seed and an offset, drawn by the Python side from torch's
// generator for each call) and of each element's (sequence, query head, query row, key), so the backward
// regenerates exactly the forward's mask, in any kernel and either orientation, and a CUDA graph replay that
// redraws rng_state gets a fresh one. flash_attn_cuda/dropout.py computes the same mask in PyTorch.
//
// The random bits come from Philox4x32-10 (Salmon et al., SC 2011): key = the seed, counter = (row with bit 3
// cleared, key with bits 0, 3 and 4 cleared, sequence * num_heads + head, the offset's low word). One call yields
// sixteen bytes, one for each element of {row, row + 8} x {key, key + 1} x {key + 8 g : g < 4}: element (q, k)
// takes byte (k >> 3) & 3 of word 2 * bit3(q) + bit0(k). In the accumulator layouts of mma.sync and wgmma a
// thread holds rows 8 apart, adjacent column pairs and every 8-column group of its columns, so where a warp owns
// 32 consecutive keys (the forward kernels) every byte of a call is used. The mma.sync backward's warps own
// 8-column groups 32 or 16 keys apart and use four or eight bytes of a call; the Hopper backward's transposed
// S^T (keys as rows) gives a thread keys 8 apart and queries 8 apart, four bytes of a call. An element is dropped
// when its byte is below FwdParams::dropout_threshold (8 bits of resolution on p, as flash-attn 2.x).
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
        auto bits = [&](int q, uint32_t key_counter) {
            return philox4x32_10(uint32_t(q) & ~8u, key_counter, stream, offset, key0, key1);
        };
        // Drops x when byte (k >> 3) & 3 of its word is below the threshold.
        auto drop = [&](float& x, uint32_t word, int k) {
            if (((word >> ((uint32_t(k) & 24u))) & 0xFFu) < threshold) { x = kNegate ? -x : 0.f; }
        };
        if constexpr (kQueryIsRow) {
            // Rows r, r + 1 are queries q, q + 8; columns c, c + 1 keys k, k + 1. Consecutive column pairs whose
            // keys differ only in bits 3 and 4 share a call: it is made again only when the key counter changes,
            // which for a given pair happens alike in every thread of a warp.
            CUTE_UNROLL
            for (int r = 0; r < size<0>(p); r += 2) {
                const int q = q0 + query_of<true>(coords, r, 0);
                uint4 w = make_uint4(0u, 0u, 0u, 0u);
                uint32_t current = ~0u;  // no key counter: bit 0 is always clear in one
                CUTE_UNROLL
                for (int c = 0; c < size<1>(p); c += 2) {
                    const int k = k0 + key_of<true>(coords, r, c);
                    const uint32_t key_counter = uint32_t(k) & ~25u;
                    if (key_counter != current) {
                        w = bits(q, key_counter);
                        current = key_counter;
                    }
                    drop(p(r, c), w.x, k);
                    drop(p(r, c + 1), w.y, k);
                    drop(p(r + 1, c), w.z, k);
                    drop(p(r + 1, c + 1), w.w, k);
                }
            }
        } else {
            // Rows r, r + 1 are keys k, k + 8; columns c and c + 2 queries q, q + 8 (c in an even 8-column group).
            // Keys k and k + 1 are another thread's: one call gives this thread the four bytes of (k, k + 8) x
            // (q, q + 8), in the word pair of k's bit 0.
            CUTE_UNROLL
            for (int r = 0; r < size<0>(p); r += 2) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(p); c += ((c & 1) == 0 ? 1 : 3)) {
                    const int key = k0 + key_of<false>(coords, r, c);
                    const uint4 w = bits(q0 + query_of<false>(coords, r, c), uint32_t(key) & ~25u);
                    const bool odd = (key & 1) != 0;
                    drop(p(r, c), odd ? w.y : w.x, key);
                    drop(p(r, c + 2), odd ? w.w : w.z, key);
                    drop(p(r + 1, c), odd ? w.y : w.x, key + 8);
                    drop(p(r + 1, c + 2), odd ? w.w : w.z, key + 8);
                }
            }
        }
    }
};

}  // namespace flash
