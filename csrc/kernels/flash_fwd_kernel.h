// FlashAttention-2 forward kernel body. One CTA computes one (query block, sequence, head) tile, or
// for a split-KV launch that tile's share of the keys; each warp owns 16-row slices of the query block
// (split-Q), so warps never exchange partial results.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "launch/flash_params.h"
#include "kernels/fwd_tile.h"
#include "kernels/kernel_traits_fwd.h"
#include "kernels/mask.h"
#include "kernels/dropout.h"
#include "kernels/score_mod.h"
#include "kernels/softmax.h"
#include "kernels/utils.h"

namespace flash {

using namespace cute;

// kVariants: the variants kernel (kCausal too), with a runtime window, softcap, ALiBi and dropout; without it
// the kernel compiles none of their code (the plain path, whose speed they would cost). kMod: a plain kernel that
// softcaps every score, or drops out P, for a call whose only variant that is, with the plain kernels' step
// structure; the variants kernel's own cost, every variant's code behind runtime branches in one step body, was
// 9-20% of a head-dim-128 forward before any variant's arithmetic (docs/design-notes.md).
template <class Traits, bool kCausal, bool kVariants, PlainMod kMod = PlainMod::kNone>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_fwd_kernel(const __grid_constant__ FwdParams params) {
    static_assert(!(kVariants && kMod != PlainMod::kNone), "the variants kernel takes every variant at run time");
    constexpr bool kSoftcap = kMod == PlainMod::kSoftcap;
    constexpr bool kDropout = kMod == PlainMod::kDropout;
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kHeadDimV = Traits::kHeadDimV;
    static_assert(!kVariants || kHeadDimV == kHeadDim,
                  "the variants kernel (paged caches among them) has one head dim");
    const int tidx = threadIdx.x;

    const FwdTile<kBlockM, kBlockN, kCausal, kVariants> tile(params);
    if (!tile.has_rows()) { return; }
    const int m_block = tile.m_block;
    const BlockInfo& binfo = tile.binfo;
    const auto& bounds = tile.bounds;
    const ScoreMod<Element> score_mod(params, tile.batch_idx, binfo);
    const Dropout dropout(params, tile.batch_idx, tile.head_idx);

    const auto gQKV = tile.template gmem_qkv<Element, kHeadDim, kHeadDimV>(params);
    Tensor gQ = get<0>(gQKV);  // (kBlockM, kHeadDim)
    Tensor gK = get<1>(gQKV);  // (kBlockN, kHeadDim, n)
    Tensor gV = get<2>(gQKV);  // (kBlockN, kHeadDimV, n)

    extern __shared__ __align__(128) char smem[];
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                            typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutV{});  // (kBlockN, kHeadDimV)
    Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});  // (kHeadDimV, kBlockN)

    // Positions inside a tile, for predicates and masks.
    Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (kBlockM, kHeadDim)
    Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (kBlockN, kHeadDim)
    Tensor cV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{});  // (kBlockN, kHeadDimV)
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});    // (kBlockM, kBlockN)

    typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr_copy.partition_S(gQ);     // (CPY, CPY_M, CPY_K)
    Tensor tQsQ = gmem_thr_copy.partition_D(sQ);     // (CPY, CPY_M, CPY_K)
    Tensor tQcQ = gmem_thr_copy.partition_S(cQ);     // (CPY, CPY_M, CPY_K)
    Tensor tKgK = gmem_thr_copy.partition_S(gK);     // (CPY, CPY_N, CPY_K, n)
    Tensor tKsK = gmem_thr_copy.partition_D(sK);     // (CPY, CPY_N, CPY_K)
    Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);  // (CPY, CPY_N, CPY_K)
    typename Traits::GmemTiledCopyV gmem_tiled_copy_v;  // GmemTiledCopyQKV where V has Q's and K's head dim
    auto gmem_thr_copy_v = gmem_tiled_copy_v.get_thread_slice(tidx);
    Tensor tVgV = gmem_thr_copy_v.partition_S(gV);  // (CPY, CPY_N, CPY_K, n)
    Tensor tVsV = gmem_thr_copy_v.partition_D(sV);  // (CPY, CPY_N, CPY_K)
    Tensor tVcV = gmem_thr_copy_v.partition_S(cV);  // (CPY, CPY_N, CPY_K)
    // V's columns: head_dim where V has Q's and K's, which the host then also gives head_dim_v (one value, so that
    // V's predicates and K's are the same ones).
    const int v_cols = kHeadDimV == kHeadDim ? params.head_dim : params.head_dim_v;

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor tSrQ = register_fragment_A<Element>(tiled_mma, sQ);    // (MMA, MMA_M, MMA_K)
    Tensor tSrK = register_fragment_B<Element>(tiled_mma, sK);    // (MMA, MMA_N, MMA_K)
    Tensor tOrVt = register_fragment_B<Element>(tiled_mma, sVt);  // (MMA, MMA_N over head_dim, MMA_K over keys)
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_o);
    Tensor tScS = thr_mma.partition_C(cS);  // (MMA, MMA_M, MMA_N)
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));  // (rows, cols)

    auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtomQK{}, tiled_mma);
    auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
    Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
    Tensor tSrQ_view = smem_thr_copy_Q.retile_D(tSrQ);
    auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtomQK{}, tiled_mma);
    auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
    Tensor tSsK = smem_thr_copy_K.partition_S(sK);
    Tensor tSrK_view = smem_thr_copy_K.retile_D(tSrK);
    auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomVt{}, tiled_mma);
    auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
    Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);
    Tensor tOrVt_view = smem_thr_copy_V.retile_D(tOrVt);

    const int q_rows_left = tile.q_rows_left();
    // is_v: std::true_type for V, std::false_type for K (which a paged cache needs to know).
    auto load_kv = [&](auto& tSrc, auto& tDst, int n_block, auto is_v) {
        if constexpr (kVariants) {
            if (params.block_table_ptr != nullptr) {
                constexpr bool kIsV = decltype(is_v)::value;
                // Rolled: unrolled, this kernel's sm_90a build spilled (8 bytes at head dim 128).
                tile.template copy_paged<!kIsV, kIsV, false>(params, gmem_tiled_copy, tSrc(_, _, _, 0), tDst, tDst,
                                                             tKVcKV, n_block);
                return;
            }
        }
        if constexpr (decltype(is_v)::value) {
            copy_zfill(gmem_tiled_copy_v, tSrc(_, _, _, n_block), tDst, tVcV, binfo.seqlen_k - n_block * kBlockN,
                       v_cols);
        } else {
            copy_zfill(gmem_tiled_copy, tSrc(_, _, _, n_block), tDst, tKVcKV, binfo.seqlen_k - n_block * kBlockN,
                       params.head_dim);
        }
    };

    // Key blocks run from the last to the first, so the tiles that need masking (the sequence end
    // and the causal diagonal) come first. K for the next step loads during the P V product, and V
    // loads during the Q K^T product.
    const int n_block_begin = tile.n_block_begin();
    int n_block = tile.n_block_end() - 1;
    copy_zfill(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, q_rows_left, params.head_dim);
    if (n_block >= n_block_begin) { load_kv(tKgK, tKsK, n_block, std::false_type{}); }
    cp_async_fence();

    Tensor acc_o_rc = as_rowcol(acc_o);  // (rows, kHeadDimV cols)
    OnlineSoftmax<decltype(size<0>(acc_o_rc))::value> softmax(params.softmax_scale_log2);

    // One key block: S = Q K^T, the mask when kMasked (std::true_type or std::false_type), the online softmax, and
    // O += P V.
    auto step = [&](int n_block, auto masked) __attribute__((always_inline)) {
        constexpr bool kMasked = decltype(masked)::value;
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        clear(acc_s);
        cp_async_wait<0>();
        __syncthreads();  // K is in smem, and every warp has finished reading the previous V.
        load_kv(tVgV, tVsV, n_block, std::true_type{});
        cp_async_fence();

        gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_tiled_copy_Q, smem_tiled_copy_K, tSrQ_view,
                       tSrK_view);
        Tensor scores = as_rowcol(acc_s);  // (rows, kBlockN cols)
        if constexpr (kVariants) {
            apply_score_mod</*kQueryIsRow=*/true>(score_mod, scores, tScS_rc,
                                                  {m_block * kBlockM, n_block * kBlockN, tile.head_idx});
        }
        if constexpr (kSoftcap) { apply_softcap(scores, params.softcap_prescale); }
        if constexpr (kMasked) {
            const TileMask<kBlockM, kBlockN, kCausal, kVariants> mask(bounds, m_block, n_block);
            if (mask.needs_mask()) { mask.template apply</*kQueryIsRow=*/true>(scores, tScS_rc); }
        }

        cp_async_wait<0>();
        __syncthreads();  // V is in smem, and every warp has finished reading K.
        if (n_block > n_block_begin) {
            load_kv(tKgK, tKsK, n_block - 1, std::false_type{});
            cp_async_fence();
        }

        softmax.template update</*kSkipUnmoved=*/true>(scores, acc_o_rc);
        Tensor rP = convert_fragment<Element>(acc_s);
        // Dropout after the row sums, which are those of the undropped softmax (the LSE's).
        if (kDropout || (kVariants && dropout.active())) {
            Tensor rP_rc = as_rowcol(rP);  // (rows, kBlockN cols)
            dropout.apply_converted(rP_rc, tScS_rc, m_block * kBlockM, n_block * kBlockN);
        }
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand_layout(rP.layout()));  // (MMA, MMA_M, MMA_K)
        gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_tiled_copy_V, tOrVt_view);
    };
    // A window's left edge masks the last blocks visited too, so the variants kernel checks in every step. In the
    // plain kernels a mask checked in every step was compiled into predicated instructions that every step issued.
    visit_masked_first</*kStep=*/-1, /*kSplit=*/!kVariants>(n_block, n_block_begin - 1, [&](int n) {
        return TileMask<kBlockM, kBlockN, kCausal, kVariants>(bounds, m_block, n).needs_mask();
    }, step);

    // Epilogue: normalize once, stage O through shared memory (Q's buffer) for 16 B global stores; a
    // split-KV CTA writes its fp32 partials instead.
    Tensor lse = kVariants ? softmax.finalize(acc_o_rc, params.score_scale, params.dropout_keep_scale)
                           : softmax.finalize(acc_o_rc, kSoftcap ? params.score_scale : params.softmax_scale,
                                              kDropout ? params.dropout_keep_scale : 1.f);
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (kBlockM, kHeadDimV)
    Tensor tOcO = thr_mma.partition_C(cO);  // (MMA, MMA_M, MMA_N), positions of acc_o's values
    Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));  // (rows, cols)
    tile.fold_row_mod(params, acc_o_rc, lse, tOcO_rc);
    Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});  // (kBlockM, kHeadDimV)
    tile.template epilogue<typename Traits::GmemTiledCopyO>(params, acc_o_rc, tOcO_rc, lse, sO, [&] {
        Tensor rO = convert_fragment<Element>(acc_o);
        auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
        auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
        copy(smem_tiled_copy_O, smem_thr_copy_O.retile_S(rO), smem_thr_copy_O.partition_D(sO));
    }, tidx);
}

}  // namespace flash
