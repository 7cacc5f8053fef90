// The backward's recompute of P from the saved LSE, and of dS from dP: one pair of functions for the three
// backward paths (the mma.sync kernel, and both Hopper kernels, whose narrow one works on transposed S^T and
// dP^T tiles and issues the dV GEMM between the two calls). Accumulators come as (rows, cols) views with a
// matching coordinate view; kQueryIsRow says which coordinate is the query. The loops run queries outer and
// keys inner in either orientation, so each query's LSE and D are read once. The variants enter through the
// ScoreMod (applied before the mask), Dropout (the kernels mark dropped values of P between the two calls, by
// sign; the mma.sync kernel's dropout without softcap instead drops from P and dP in one pass after compute_p,
// Dropout::apply_with_ds) and DsMods.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "kernels/mask.h"
#include "kernels/dropout.h"
#include "kernels/score_mod.h"
#include "kernels/utils.h"  // convert_fragment

namespace flash {

using namespace cute;

// Where compute_p hides the masked elements (P = 0 either way; both are exact):
// - kBeforeExp: masked tiles get -inf scores before the exp (TileMask::apply), behind one branch per tile.
//   The mma.sync kernel, which has registers to spare.
// - kInExp: the exp loop selects 0 past the diagonal (TileMask::hides_past_diagonal), and keys past the
//   sequence end get P = 0 in a fix-up after it (TileMask::hide_keys_past_end). The Hopper kernels run at
//   the register limit: in this form their exp loops keep their registers (a key-end test inside the exp
//   loop made the hdim 128 kernel spill in its step loop).
enum class HideP { kBeforeExp, kInExp };

// mask.hides_past_diagonal(q, k) where kTest, else false without naming it: the exp loops below take the test as a
// generic lambda's argument, and a call that does not depend on it would be checked against every mask type,
// NoTileMask included, which has no such test.
template <bool kTest, class Mask>
__forceinline__ __device__ bool hidden_past_diagonal(const Mask& mask, int q, int k) {
    if constexpr (kTest) {
        return mask.hides_past_diagonal(q, k);
    } else {
        return false;
    }
}

// Visits a tile queries outer and keys inner, in either orientation, so that what each query needs (its LSE, its
// D) is read once: per_query(q) for tile query q, then elem(i, j, q, that value) for each of its keys, (i, j) the
// value's index in the (rows, cols) view.
template <bool kQueryIsRow, class Tile, class CoordTensor, class PerQuery, class Elem>
__forceinline__ __device__ void for_each_by_query(const Tile& t, const CoordTensor& coords, const PerQuery& per_query,
                                                  const Elem& elem) {
    CUTE_UNROLL
    for (int qi = 0; qi < query_extent<kQueryIsRow>(t); ++qi) {
        const int q = query_of<kQueryIsRow>(coords, kQueryIsRow ? qi : 0, kQueryIsRow ? 0 : qi);
        const auto of_q = per_query(q);
        CUTE_UNROLL
        for (int ki = 0; ki < key_extent<kQueryIsRow>(t); ++ki) {
            elem(kQueryIsRow ? qi : ki, kQueryIsRow ? ki : qi, q, of_q);
        }
    }
}

// s: the scores S (or S^T), overwritten with P = exp2(s * scale_log2 - lse_log2_of(q)), where lse_log2_of(q)
// is the LSE of tile query q times log2(e). coords: the tile positions of s's values; mask: this tile's
// TileMask; score_mod applies first (kVariants only), at the tile's absolute position pos.
template <bool kQueryIsRow, HideP kHide, bool kVariants, class Mask, class STensor, class CoordTensor, class Element,
          class LseLog2Of>
__forceinline__ __device__ void compute_p(STensor& s, const CoordTensor& coords, const Mask& mask,
                                          const ScoreMod<Element>& score_mod, const ScorePos& pos, float scale_log2,
                                          LseLog2Of lse_log2_of) {
    static_assert(decltype(size(s))::value == decltype(size(coords))::value, "one coordinate per value");
    if constexpr (kVariants) { apply_score_mod<kQueryIsRow>(score_mod, s, coords, pos); }
    if constexpr (kHide == HideP::kBeforeExp) {
        if (mask.needs_mask()) { mask.template apply<kQueryIsRow>(s, coords); }
    }
    auto exp_loop = [&](auto test_diagonal) {
        for_each_by_query<kQueryIsRow>(s, coords, lse_log2_of, [&](int i, int j, int q, float lse_log2) {
            if constexpr (decltype(test_diagonal)::value) {
                const bool hidden = hidden_past_diagonal<decltype(test_diagonal)::value>(
                    mask, q, key_of<kQueryIsRow>(coords, i, j));
                s(i, j) = hidden ? 0.f : exp2f(s(i, j) * scale_log2 - lse_log2);
            } else {
                s(i, j) = exp2f(s(i, j) * scale_log2 - lse_log2);
            }
        });
    };
    if constexpr (kHide == HideP::kInExp) {
        // The kernels visit every tile with one step body, where the test was compares, a predicate op, a constant
        // reload and a predicated exp a value (ptxas if-converts it), in every tile: most tiles cross no edge.
        if (mask.may_hide_past_diagonal()) {
            exp_loop(std::true_type{});
        } else {
            exp_loop(std::false_type{});
        }
    } else {
        exp_loop(std::false_type{});
    }
    if constexpr (kHide == HideP::kInExp) { mask.template hide_keys_past_end<kQueryIsRow>(s, coords); }
}

// What compute_ds needs of the variants of a call, for query head `head`: read from params where used, as
// ScoreMod does.
template <class Element>
struct DsMods {
    const ScoreMod<Element>& score_mod;
    int head;

    __forceinline__ __device__ bool dropout() const { return score_mod.params.dropout_threshold != 0u; }
    __forceinline__ __device__ bool softcap() const { return score_mod.softcap(); }
    __forceinline__ __device__ bool any() const { return dropout() || softcap(); }
};

// dS of one tile with the variants of mods (compute_ds's branch; see there). Softcap without dropout never comes
// here: the kernels take compute_p_ds_softcap for it. Each form has a loop of its own: in one loop with the softcap
// factor behind a per-value test, ptxas if-converted that factor, so its log2, compare and multiplies issued for
// every value of a dropout-only call too (mma.sync head dim 128: 580 instructions for a thread's 32 values, where
// the dropout loop takes 5 a value).
template <bool kQueryIsRow, class DpTensor, class PTensor, class CoordTensor, class DsumOf, class Element,
          class LseLog2Of>
__forceinline__ __device__ void compute_ds_variants(DpTensor& dp, const PTensor& p, const CoordTensor& coords,
                                                    DsumOf dsum_of, const DsMods<Element>& mods, const ScorePos& pos,
                                                    LseLog2Of lse_log2_of) {
    const FwdParams& params = mods.score_mod.params;
    // 1 without dropout, where no P is negative: both loops then give the undropped dS.
    const float keep_scale = params.dropout_keep_scale;
    if (!mods.softcap()) {
        for_each_by_query<kQueryIsRow>(dp, coords, dsum_of, [&](int i, int j, int, float dsum) {
            const float pv = p(i, j);
            const float dpv = pv >= 0.f ? dp(i, j) * keep_scale : 0.f;
            dp(i, j) = fabsf(pv) * (dpv - dsum);
        });
        return;
    }
    const float inv_scale_log2 = 1.f / params.softmax_scale_log2;
    const float slope = mods.score_mod.alibi() ? mods.score_mod.slope(mods.head) : 0.f;
    const TileDistances<kQueryIsRow, CoordTensor> distance(mods.score_mod, coords, pos);
    // Each query's D (x) and LSE times log2(e) (y).
    auto dsum_lse_of = [&](int q) {
        const float dsum = dsum_of(q);
        return make_float2(dsum, lse_log2_of(q));
    };
    for_each_by_query<kQueryIsRow>(dp, coords, dsum_lse_of, [&](int i, int j, int, float2 of_q) {
        const float pv = fabsf(p(i, j));
        const float dpv = p(i, j) >= 0.f ? dp(i, j) * keep_scale : 0.f;
        float ds = pv * (dpv - of_q.x);
        if (pv > 0.f) {
            const float t = (__log2f(pv) + of_q.y) * inv_scale_log2 + slope * distance(i, j);
            ds *= 1.f - t * t;
        }
        dp(i, j) = ds;
    });
}

// dp: dP (or dP^T), overwritten with dS = P (dP - dsum_of(q)), the gradient of the scaled scores, where
// dsum_of(q) is D = rowsum(dO * O) of tile query q. p: P from compute_p, in the same orientation.
// In kVariants kernels, with the variants of mods (a uniform branch to compute_ds_variants):
// - dropout: O sums kept P / (1 - p) times V, so dP of a kept value is scaled by 1 / (1 - p) and a dropped
//   one's is 0, while D and P stay those of the undropped softmax: dS = |P| (kept ? dP / (1 - p) - D : -D).
// - softcap: the score is c tanh(x) with x = softmax_scale q.k / c, so dS picks up 1 - tanh^2. Without dropout
//   the kernels take compute_p_ds_softcap instead, which has tanh at hand; here (with dropout) tanh is
//   recovered from P = exp2(u scale_log2 - lse_log2), u = tanh - slope * distance: u = (log2 P + lse_log2) /
//   scale_log2. Where P is 0 (masked or underflowed) dS is 0 whatever the derivative, and it is skipped.
//   The recovery's error is that of log2 and of the fp32 LSE, far below the input dtype's rounding.
// pos: the tile's absolute position; lse_log2_of as in compute_p.
template <bool kQueryIsRow, bool kVariants, class DpTensor, class PTensor, class CoordTensor, class DsumOf,
          class Element, class LseLog2Of>
__forceinline__ __device__ void compute_ds(DpTensor& dp, const PTensor& p, const CoordTensor& coords, DsumOf dsum_of,
                                           const DsMods<Element>& mods, const ScorePos& pos, LseLog2Of lse_log2_of) {
    static_assert(decltype(size(dp))::value == decltype(size(p))::value &&
                      decltype(size(dp))::value == decltype(size(coords))::value,
                  "dP, P and coords of one tile");
    if constexpr (kVariants) {
        if (mods.any()) {
            compute_ds_variants<kQueryIsRow>(dp, p, coords, dsum_of, mods, pos, lse_log2_of);
            return;
        }
    }
    for_each_by_query<kQueryIsRow>(dp, coords, dsum_of,
                                   [&](int i, int j, int, float dsum) { dp(i, j) = p(i, j) * (dp(i, j) - dsum); });
}

// P and dS of one tile in a single pass, for a call with softcap and without dropout, once both S and dP are
// complete. compute_ds recovers softcap's tanh t from P through a log2, a MUFU operation as tanh and exp2 are;
// here the derivative 1 - t^2 is taken while t is at hand. s: S, overwritten with P; dp: dP, overwritten with dS;
// the rest as in compute_p and compute_ds.
template <bool kQueryIsRow, HideP kHide, class Mask, class STensor, class DpTensor, class CoordTensor, class Element,
          class LseLog2Of, class DsumOf>
__forceinline__ __device__ void compute_p_ds_softcap(STensor& s, DpTensor& dp, const CoordTensor& coords,
                                                     const Mask& mask, const ScoreMod<Element>& score_mod,
                                                     const ScorePos& pos, float scale_log2, LseLog2Of lse_log2_of,
                                                     DsumOf dsum_of) {
    static_assert(decltype(size(s))::value == decltype(size(dp))::value &&
                      decltype(size(s))::value == decltype(size(coords))::value,
                  "S, dP and coords of one tile");
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) { s(i) = softcap_tanh(s(i) * score_mod.params.softcap_prescale); }
    if constexpr (kHide == HideP::kBeforeExp) {
        if (mask.needs_mask()) { mask.template apply<kQueryIsRow>(s, coords); }
    }
    // ALiBi's term in exp2 units: the exponent is (t - slope * distance) * scale_log2 - lse_log2.
    const float slope_log2 = score_mod.alibi() ? score_mod.slope(pos.head) * scale_log2 : 0.f;
    const TileDistances<kQueryIsRow, CoordTensor> distance(score_mod, coords, pos);
    // Each query's D (x) and LSE times log2(e) (y), the LSE read first: the exp needs it first.
    auto dsum_lse_of = [&](int q) {
        const float lse_log2 = lse_log2_of(q);
        return make_float2(dsum_of(q), lse_log2);
    };
    auto p_ds_loop = [&](auto test_diagonal) {
        for_each_by_query<kQueryIsRow>(s, coords, dsum_lse_of, [&](int i, int j, int q, float2 of_q) {
            const float t = s(i, j);  // tanh, or -inf where kBeforeExp's mask hides the element
            float p = exp2f(fmaf(t, scale_log2, fmaf(-slope_log2, distance(i, j), -of_q.y)));
            if constexpr (decltype(test_diagonal)::value) {
                p = hidden_past_diagonal<decltype(test_diagonal)::value>(mask, q, key_of<kQueryIsRow>(coords, i, j))
                        ? 0.f
                        : p;
            }
            s(i, j) = p;
            // 1 - t^2; where t = -inf, P = 0 and the min keeps the factor at 0 instead of -inf (0 * inf = NaN).
            dp(i, j) = p * (dp(i, j) - of_q.x) * (1.f - fminf(t * t, 1.f));
        });
    };
    if constexpr (kHide == HideP::kInExp) {
        // As in compute_p: the window test only in tiles that cross an edge.
        if (mask.may_hide_past_diagonal()) {
            p_ds_loop(std::true_type{});
        } else {
            p_ds_loop(std::false_type{});
        }
    } else {
        p_ds_loop(std::false_type{});
    }
    if constexpr (kHide == HideP::kInExp) {
        // Keys past the sequence end: P and, computed from the P they had before, dS.
        mask.template hide_keys_past_end<kQueryIsRow>(s, coords);
        mask.template hide_keys_past_end<kQueryIsRow>(dp, coords);
    }
}

// P converted to Element for dV += P^T dO: as it is, or with dropout (P sign-encoded) its kept values and 0 for
// the dropped ones; the kernels apply dropout's 1 / (1 - p) to dV once, at its store. p itself is left as it is
// (the Hopper narrow kernel still needs the signs for dS).
template <typename Element, class PTensor>
__forceinline__ __device__ auto convert_fragment_kept(const PTensor& p, bool dropout) {
    auto converted = convert_fragment<Element>(p);
    if (dropout) {
        CUTE_UNROLL
        for (int i = 0; i < size(p); ++i) { converted(i) = static_cast<Element>(fmaxf(p(i), 0.f)); }
    }
    return converted;
}

}  // namespace flash
