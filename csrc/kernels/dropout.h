// Attention dropout: which probabilities a call drops, and dropping them. The mask is a pure function of the
// call's rng_state (two int64 on the device: a seed and an offset, drawn by the Python side from torch's
// generator for each call) and of each element's (sequence, query head, query row, key), so the backward
// regenerates exactly the forward's mask, in any kernel and either orientation, and a CUDA graph replay that
// redraws rng_state gets a fresh one. flash_attn_cuda/dropout.py computes the same mask in PyTorch.
//
// The random bits come from Philox4x32 with 7 rounds (Salmon et al., SC 2011, find Philox4x32 Crush-resistant
// from 7 rounds and take 10 for a safety margin; flash-attn 2.x draws its dropout with 7, and a call is the
// integer work dropout adds per sixteen elements): key = the seed, counter = (row with bit 3 cleared, key with
// bits 0, 3 and 4 cleared, sequence * num_heads + head, the offset's low word). One call yields sixteen bytes,
// one for each element of {row, row + 8} x {key, key + 1} x {key + 8 g : g < 4}: element (q, k) takes byte
// (k >> 3) & 3 of word 2 * bit3(q) + bit0(k). In the accumulator layouts of mma.sync and wgmma a thread holds
// rows 8 apart, adjacent column pairs and every 8-column group of its columns, so where a warp owns 32
// consecutive keys every byte of a call is used: the forward kernels, and the mma.sync backward's variants
// kernel, whose warps own runs of 32 consecutive keys (16, and eight bytes of a call, in key blocks of 64; see
// kernel_traits_bwd.h). The Hopper backward's transposed S^T (keys as rows) gives a thread keys 8 apart and
// queries 8 apart, four bytes of a call, and the lane holding the neighbouring key four more (apply shares each
// call between the two). An element is dropped when its byte is below FwdParams::dropout_threshold (8 bits of
// resolution on p, as flash-attn 2.x).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "launch/flash_params.h"
#include "kernels/mask.h"  // query_of, key_of

namespace flash {

using namespace cute;

// Philox4x32 with kRounds rounds on counter (c0, c1, c2, c3) and key (k0, k1).
template <int kRounds>
__forceinline__ __device__ uint4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                            uint32_t k1) {
    CUTE_UNROLL
    for (int round = 0; round < kRounds; ++round) {
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

// The rounds of the dropout's Philox (flash_attn_cuda/dropout.py computes the same draw).
inline constexpr int kDropoutPhiloxRounds = 7;

// The dropout of one (sequence, query head). Like ScoreMod it reads the __grid_constant__ params where used and
// the seed and offset only inside apply, so that without dropout it holds no registers in the main loops.
struct Dropout {
    const FwdParams& params;
    int batch_idx;
    int head_idx;

    __forceinline__ __device__ Dropout(const FwdParams& params_, int batch_idx_, int head_idx_)
        : params(params_), batch_idx(batch_idx_), head_idx(head_idx_) {}

    __forceinline__ __device__ bool active() const { return params.dropout_threshold != 0u; }

    // The calls of this (sequence, head): operator()(q, key_counter) is the call of query rows q & ~8 and q | 8 at
    // the given key counter. Read from params (seed and offset from the device) where the draw starts.
    struct PhiloxStream {
        uint32_t key0, key1, offset, stream;

        __forceinline__ __device__ explicit PhiloxStream(const Dropout& dropout) {
            const uint64_t seed = uint64_t(dropout.params.rng_state_ptr[0]);
            key0 = uint32_t(seed);
            key1 = uint32_t(seed >> 32);
            offset = uint32_t(uint64_t(dropout.params.rng_state_ptr[1]));
            stream = uint32_t(dropout.batch_idx) * uint32_t(dropout.params.num_heads) + uint32_t(dropout.head_idx);
        }
        __forceinline__ __device__ uint4 operator()(int q, uint32_t key_counter) const {
            return philox4x32<kDropoutPhiloxRounds>(uint32_t(q) & ~8u, key_counter, stream, offset, key0, key1);
        }
    };

    // The draws of a tile whose rows are queries (t: its (rows, cols) view, coords its positions): visit(r, c, w,
    // key) for rows r, r + 1 (queries q, q + 8) and columns c, c + 1 (keys k, k + 1), with w the four words of
    // their call (x, y for row r; z, w for row r + 1) and key the bits of k that place their byte in each word
    // (byte (key >> 3) & 3).
    // In the MMA accumulator layouts a thread's position and a value's index select different bits of the key
    // within the tile (the thread's first key sets bits 1-2 and some of 3-6, a value's offset bit 0 and the
    // others), and tiles start at multiples of 32 keys. So every key a thread holds is its first key with a
    // compile-time offset d, the offset's bits below 32 ORed in and its multiple of 32 added (a tile's first key
    // need not be a multiple of a larger power of two: 96-key blocks): which elements share a call, and the word
    // and byte each takes, follow from d at compile time and from the first key's bits 3 and 4 at run time. With the
    // test (key & ~25) != current at run time instead, ptxas emitted a Philox body for each column pair, under
    // branches, and shifted by a computed amount per element.
    template <class Tile, class CoordTensor, class Visit>
    __forceinline__ __device__ static void for_each_draw_by_rows(const PhiloxStream& philox, const Tile& t,
                                                                 const CoordTensor& coords, int q0, int k0,
                                                                 const Visit& visit) {
        static_assert(decltype(size<0>(t))::value % 2 == 0 && decltype(size<1>(t))::value % 4 == 0);
        const int first = key_of<true>(coords, 0, 0);
        const uint32_t key_base = uint32_t(k0 + first);
        CUTE_UNROLL
        for (int r = 0; r < size<0>(t); r += 2) {
            const int q = q0 + query_of<true>(coords, r, 0);
            uint4 w;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(t); c += 2) {
                const uint32_t d = uint32_t(key_of<true>(coords, r, c) - first);
                const uint32_t d_prev = c == 0 ? ~0u : uint32_t(key_of<true>(coords, r, c - 2) - first);
                const uint32_t key = (key_base | (d & 31u)) + (d & ~31u);
                if ((d & ~25u) != (d_prev & ~25u)) { w = philox(q, key & ~25u); }
                visit(r, c, w, key);
            }
        }
    }

    // Zeroes the dropped values of a tile of P already converted to a 16-bit Element, as the mma.sync forward feeds
    // it to the P V GEMM. rp: (rows, cols) view of the converted accumulator (mma.sync or wgmma layout, query rows),
    // coords, q0 and k0 as in apply. Each 32-bit register holds a column pair (c, c + 1), whose two bytes sit at
    // the same position of words x and y (rows r) or z and w (rows r + 8): one PRMT gathers them into the low
    // bytes of two 16-bit lanes, and one f16x2 comparison of those lanes (small integers, which compare as f16
    // subnormals do) with the threshold yields a 0 / 0xffff mask per lane to AND into the pair. Two instructions a
    // value fewer than apply's shift, mask, compare and select on float32 values.
    template <class RPTensor, class CoordTensor>
    __forceinline__ __device__ void apply_converted(RPTensor& rp, const CoordTensor& coords, int q0, int k0) const {
        static_assert(sizeof(typename RPTensor::value_type) == 2, "pairs of 16-bit values");
        const PhiloxStream philox(*this);
        const uint32_t threshold2 = params.dropout_threshold * 0x00010001u;
        uint32_t* pairs = reinterpret_cast<uint32_t*>(raw_pointer_cast(rp.data()));
        // The kept-lane mask of a column pair whose bytes are byte `sel` of lo and of hi.
        auto keep = [&](uint32_t lo, uint32_t hi, uint32_t sel) {
            const uint32_t bytes = __byte_perm(lo, hi, sel) & 0x00FF00FFu;
            uint32_t mask;
            asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(mask) : "r"(bytes), "r"(threshold2));
            return mask;
        };
        for_each_draw_by_rows(philox, rp, coords, q0, k0, [&](int r, int c, const uint4& w, uint32_t key) {
            // Byte b of the first word to lane 0's low byte, of the second (PRMT index 4 + b) to lane 1's.
            const uint32_t b = (key >> 3) & 3u;
            const uint32_t sel = b | ((b + 4u) << 8);
            pairs[rp.layout()(r, c) / 2] &= keep(w.x, w.y, sel);
            pairs[rp.layout()(r + 1, c) / 2] &= keep(w.z, w.w, sel);
        });
    }

    // Drops from P and dP in one pass, for the mma.sync backward, where both are complete when P is: p (P, query
    // rows, as in apply) is left with its kept values and 0 for the dropped ones, for dV; dp (dP, same layout) is
    // overwritten with dS = P (kept ? dP / (1 - p) - D : -D), compute_ds's dropout form, with dsum_of(row) D of
    // tile row `row`. The keep test runs on whole words: a byte b is kept when b + (256 - threshold) carries out
    // of its 8 bits, and the carries of a word's four bytes come from one add of their low 7 bits (which cannot
    // carry into the next byte) and a majority of three (LOP3). A value's kept mask, all ones or zeros, is then
    // its byte's carry bit replicated by one PRMT, and it is ANDed into P and dP: with dS's FMA and multiply five
    // instructions a value and three a word, where apply's sign mark (three), compute_ds's dropout loop (five) and
    // the kept P's max with 0 took nine a value.
    template <class PTensor, class DpTensor, class CoordTensor, class DsumOf>
    __forceinline__ __device__ void apply_with_ds(PTensor& p, DpTensor& dp, const CoordTensor& coords, int q0, int k0,
                                                  DsumOf dsum_of) const {
        static_assert(decltype(size(p))::value == decltype(size(dp))::value, "P and dP of one tile");
        const PhiloxStream philox(*this);
        const uint32_t add = (256u - params.dropout_threshold) * 0x01010101u;  // threshold in [1, 255]
        const float keep_scale = params.dropout_keep_scale;
        // Bit 7 of each byte of the result: whether that byte of word is kept (its other bits are not used).
        auto kept_bits = [&](uint32_t word) {
            const uint32_t low7 = (word & 0x7F7F7F7Fu) + (add & 0x7F7F7F7Fu);
            return (word & add) | ((word | add) & low7);  // majority of word, add and low7: the carry out of bit 7
        };
        auto drop = [&](int r, int c, uint32_t mask, float dsum) {
            const float pv = p(r, c);
            const float dpv = __uint_as_float(__float_as_uint(dp(r, c)) & mask);
            p(r, c) = __uint_as_float(__float_as_uint(pv) & mask);
            dp(r, c) = pv * fmaf(dpv, keep_scale, -dsum);
        };
        // All ones where bit 7 of byte `sel & 3` of bits is set, else 0: PTX's prmt replicates a byte's bit 7 when
        // its selector nibble has bit 3 set (CUDA's __byte_perm keeps only the low three bits of each nibble).
        auto spread = [](uint32_t bits, uint32_t sel) {
            uint32_t mask;
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mask) : "r"(bits), "r"(0u), "r"(sel));
            return mask;
        };
        for_each_draw_by_rows(philox, p, coords, q0, k0, [&](int r, int c, const uint4& w, uint32_t key) {
            // The selector of byte (key >> 3) & 3 in all four nibbles, each with bit 3 set.
            const uint32_t sel = (((key >> 3) & 3u) | 8u) * 0x1111u;
            const float dsum = dsum_of(query_of<true>(coords, r, 0));
            const float dsum_8 = dsum_of(query_of<true>(coords, r + 1, 0));
            drop(r, c, spread(kept_bits(w.x), sel), dsum);
            drop(r, c + 1, spread(kept_bits(w.y), sel), dsum);
            drop(r + 1, c, spread(kept_bits(w.z), sel), dsum_8);
            drop(r + 1, c + 1, spread(kept_bits(w.w), sel), dsum_8);
        });
    }

    // Marks the dropped values of a tile of P in float32. p: (rows, cols) view of an accumulator in the mma.sync or
    // wgmma layout (mode 0 of the rows: +8 rows; mode 0 of the cols: +1 column; then 8-column groups), coords its
    // tile positions, kQueryIsRow as in mask.h (false: rows are keys and columns are queries, the Hopper
    // backward's S^T). q0 and k0: the tile's first query row and key within the sequence. kNegate: dropped values
    // are negated (the backward keeps P for dS and tells dropped from kept by the sign, see bwd_p_ds.h), else set
    // to 0 (the Hopper forward).
    template <bool kQueryIsRow, bool kNegate, class PTensor, class CoordTensor>
    __forceinline__ __device__ void apply(PTensor& p, const CoordTensor& coords, int q0, int k0) const {
        static_assert(decltype(size<0>(p))::value % 2 == 0 && decltype(size<1>(p))::value % 4 == 0);
        const PhiloxStream philox(*this);
        const uint32_t threshold = params.dropout_threshold;
        // Drops x when byte `shift` / 8 of its word is below the threshold.
        auto drop = [&](float& x, uint32_t word, uint32_t shift) {
            if (((word >> shift) & 0xFFu) < threshold) { x = kNegate ? -x : 0.f; }
        };
        if constexpr (kQueryIsRow) {
            for_each_draw_by_rows(philox, p, coords, q0, k0, [&](int r, int c, const uint4& w, uint32_t key) {
                const uint32_t shift = key & 24u;
                drop(p(r, c), w.x, shift);
                drop(p(r, c + 1), w.y, shift);
                drop(p(r + 1, c), w.z, shift);
                drop(p(r + 1, c + 1), w.w, shift);
            });
        } else {
            // Rows r, r + 1 are keys k, k + 8; columns c and c + 2 queries q, q + 8 (c in an even 8-column group).
            // A call gives this thread four of its sixteen bytes, those of (k, k + 8) x (q, q + 8), in the word
            // pair of k's bit 0. The thread holding key k ^ 1 (lane ^ 4: rows are lane / 4) needs the same call's
            // other word pair, so the two split each pair of calls: each makes one and passes the other the
            // two words of its parity, which halves the calls.
            const int first = key_of<false>(coords, 0, 0);
            const bool odd = ((k0 + first) & 1) != 0;
            CUTE_UNROLL
            for (int r = 0; r < size<0>(p); r += 2) {
                const int key = k0 + key_of<false>(coords, r, 0);
                const uint32_t key_counter = uint32_t(key) & ~25u;
                const uint32_t shift = uint32_t(key) & 24u;
                const uint32_t shift_8 = uint32_t(key + 8) & 24u;
                // Column pairs (c, c + 1) in the order (0, 1), (4, 5), (8, 9), ...: queries q and q + 1.
                CUTE_UNROLL
                for (int c = 0; c < size<1>(p); c += 4) {
                    const int qa = q0 + query_of<false>(coords, r, c);
                    const int qb = q0 + query_of<false>(coords, r, c + 1);
                    const uint4 w = philox(odd ? qb : qa, key_counter);
                    // This thread's words of its own call, and the partner's words of this thread's parity.
                    const uint32_t own0 = odd ? w.y : w.x, own1 = odd ? w.w : w.z;
                    const uint32_t got0 = __shfl_xor_sync(0xffffffffu, odd ? w.x : w.y, 4);
                    const uint32_t got1 = __shfl_xor_sync(0xffffffffu, odd ? w.z : w.w, 4);
                    const uint32_t a0 = odd ? got0 : own0, a1 = odd ? got1 : own1;  // query qa's call
                    const uint32_t b0 = odd ? own0 : got0, b1 = odd ? own1 : got1;  // query qb's call
                    drop(p(r, c), a0, shift);
                    drop(p(r, c + 2), a1, shift);
                    drop(p(r + 1, c), a0, shift_8);
                    drop(p(r + 1, c + 2), a1, shift_8);
                    drop(p(r, c + 1), b0, shift);
                    drop(p(r, c + 3), b1, shift);
                    drop(p(r + 1, c + 1), b0, shift_8);
                    drop(p(r + 1, c + 3), b1, shift_8);
                }
            }
        }
    }
};

}  // namespace flash
