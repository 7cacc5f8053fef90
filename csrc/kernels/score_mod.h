// Score modifiers: softcap and ALiBi, functions of each raw score (the Q K^T dot product, before the softmax
// scale) and its absolute position, applied before the mask. Both are runtime choices (FwdParams), tested once
// per tile: an inactive modifier costs its uniform branch and nothing in the element loops.
//
// The kernels' exp2 factor is FwdParams::softmax_scale_log2 = score_scale * log2(e), so a modifier returns the
// score in units of score_scale: without softcap, q.k itself minus slope / softmax_scale * distance; with
// softcap c, tanh(q.k * softmax_scale / c) minus slope / c * distance (score_scale = c), which is the
// flash-attn 2.x score c * tanh(scale * q.k / c) - slope * |p - j| divided by c.
//
// Positions are those of the kernel's key frame: a split-KV CTA sees its share of the keys re-based to key 0
// with seqlen_k shrunk by as much (BlockBounds::split_keys), so ALiBi's bottom-right aligned distance
// |q + seqlen_k - seqlen_q - k| is unchanged by it.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/block_info.h"
#include "launch/flash_params.h"
#include "kernels/mask.h"

namespace flash {

using namespace cute;

// The absolute position of a tile: its first query row and first key, and the query head.
struct ScorePos {
    int q0;
    int k0;
    int head;
};

// softcap's tanh: the hardware's (sm_75 and later), one MUFU operation, for both dtypes. PTX bounds its relative
// error by 2^-11; over every float32 input in [-16, 16] an H200 measured at most 1.1e-5 (2^-16.5), 45 times
// below that and below fp16's rounding, 2^-11 too (docs/design-notes.md, 'Softcap's tanh for fp16 inputs'). The
// float32-accurate form that fp16 took before, 1 - 2 / (1 + e^(2x)), cost an exp2 and a reciprocal: two MUFU
// operations.
__forceinline__ __device__ float softcap_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Softcap on every score of a tile: tanh(q.k * prescale), in units of the softcap (FwdParams::score_scale).
template <class ScoreTensor>
__forceinline__ __device__ void apply_softcap(ScoreTensor& scores, float prescale) {
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) { scores(i) = softcap_tanh(scores(i) * prescale); }
}

// The score modifiers of one sequence, for inputs of type Element_. It keeps a reference to the kernel's
// __grid_constant__ params, whose fields the modifiers read where they are used (constant-bank operands): a copy
// in registers, live through the main loops, made the register-bound backward kernels spill.
template <class Element_>
struct ScoreMod {
    using Element = Element_;
    const FwdParams& params;
    int batch_idx;
    int position_offset;  // seqlen_k - seqlen_q of the sequence: query q's position is q + position_offset

    __forceinline__ __device__ ScoreMod(const FwdParams& params_, int batch_idx_, const BlockInfo& binfo)
        : params(params_), batch_idx(batch_idx_), position_offset(binfo.seqlen_k - binfo.seqlen_q) {}

    __forceinline__ __device__ bool softcap() const { return params.softcap_prescale > 0.f; }
    __forceinline__ __device__ bool alibi() const { return params.alibi_slopes_ptr != nullptr; }
    // ALiBi's slope of query head `head`, in modified-score units (divided by score_scale).
    __forceinline__ __device__ float slope(int head) const {
        return params.alibi_slopes_ptr[batch_idx * params.alibi_batch_stride + head] / params.score_scale;
    }
};

// ALiBi's distances |q + position_offset - k| of a tile's elements, in float. Two elements a thread holds are a
// compile-time number of rows and columns apart (coords is a partitioned identity tensor), so the thread's first
// element's signed distance is computed once per tile and each element's is that plus a constant: one add, where
// the integer difference, its abs and an int-to-float conversion (a quarter-rate instruction, as exp2) were four.
// Exact while distances stay below 2^24.
template <bool kQueryIsRow, class CoordTensor>
struct TileDistances {
    const CoordTensor& coords;
    int q_first;
    int k_first;
    float first;  // the signed distance of the thread's first element

    template <class Element>
    __forceinline__ __device__ TileDistances(const ScoreMod<Element>& score_mod, const CoordTensor& coords_,
                                             const ScorePos& pos)
        : coords(coords_),
          q_first(query_of<kQueryIsRow>(coords_, 0, 0)),
          k_first(key_of<kQueryIsRow>(coords_, 0, 0)),
          first(float(pos.q0 + q_first + score_mod.position_offset - pos.k0 - k_first)) {}

    __forceinline__ __device__ float operator()(int i, int j) const {
        const int offset = (query_of<kQueryIsRow>(coords, i, j) - q_first) -
                           (key_of<kQueryIsRow>(coords, i, j) - k_first);
        return fabsf(first + float(offset));
    }
};

// Applies score_mod to every score of a tile. scores: (rows, cols) view of the accumulator; coords: the matching
// tile positions, the query along mode 0 when kQueryIsRow, else along mode 1.
template <bool kQueryIsRow, class Element, class ScoreTensor, class CoordTensor>
__forceinline__ __device__ void apply_score_mod(const ScoreMod<Element>& score_mod, ScoreTensor& scores,
                                                const CoordTensor& coords, const ScorePos& pos) {
    if (score_mod.softcap()) { apply_softcap(scores, score_mod.params.softcap_prescale); }
    if (score_mod.alibi()) {
        const float slope = score_mod.slope(pos.head);
        const TileDistances<kQueryIsRow, CoordTensor> distance(score_mod, coords, pos);
        CUTE_UNROLL
        for (int i = 0; i < size<0>(scores); ++i) {
            CUTE_UNROLL
            for (int j = 0; j < size<1>(scores); ++j) { scores(i, j) -= slope * distance(i, j); }
        }
    }
}

}  // namespace flash
