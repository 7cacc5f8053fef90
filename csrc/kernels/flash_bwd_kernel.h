// FlashAttention-2 backward kernel body. One CTA owns kBlockN keys of one (sequence, query head) and
// walks the query blocks that can see them. P is recomputed from the saved LSE; dK and dV stay in
// registers for the whole walk, and each step's dQ contribution is added to an fp32 buffer with atomics,
// which flash_bwd_convert_dq_kernel (below) turns into dQ (dq_accum.h).
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "kernels/block.h"
#include "kernels/block_info.h"
#include "kernels/bwd_p_ds.h"
#include "kernels/dq_accum.h"
#include "launch/flash_params.h"
#include "kernels/global_ops.h"
#include "kernels/kernel_traits_bwd.h"
#include "kernels/mask.h"
#include "kernels/score_mod.h"
#include "kernels/smem_partition.h"
#include "kernels/utils.h"

namespace flash {

using namespace cute;

// kVariants: as in flash_fwd_kernel.h.
template <class Traits, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_bwd_kernel(const __grid_constant__ BwdParams params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kHeadDimV = Traits::kHeadDimV;
    constexpr int kStagesQ = Traits::kStagesQ;
    constexpr int kQElems = Traits::kSmemQElems;
    constexpr int kdOElems = Traits::kSmemdOElems;
    constexpr int kDqChunk = Traits::kDqChunk;

    // Deterministic causal runs key blocks from the last (fewest query blocks) to the first; see accumulate_dq.
    const bool reversed = kCausal && params.deterministic;
    const int n_block = reversed ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    const int batch_idx = sequence_of_cta(params);
    const int head_idx = blockIdx.z;
    const int head_idx_k = head_idx / (params.num_heads / params.num_heads_k);
    const int tidx = threadIdx.x;
    const BlockInfo binfo(params, batch_idx);
    // Varlen grids are sized for the longest sequence; this one may have no keys here.
    if (n_block * kBlockN >= binfo.seqlen_k) { return; }
    const auto bounds = BlockBounds<kBlockM, kBlockN, kCausal, kVariants>::of_sequence(params, binfo);
    const ScoreMod<Element> score_mod(params, batch_idx, binfo);
    const Dropout dropout(params, batch_idx, head_idx);
    const int m_block_begin = bounds.m_block_begin(n_block);  // the query blocks that see this key block
    const int m_block_end = bounds.m_block_end(n_block);

    const index_t lse_offset = binfo.lse_offset(params, batch_idx, head_idx);
    const float* lse_row = params.lse_ptr + lse_offset;
    const float* dsum_row = params.dsum_ptr + lse_offset;
    // dq_accum rows are kHeadDim wide and each sequence owns whole query blocks of them, kBlockM * kHeadDim
    // floats each in fragment order (dq_accum_vec): compile-time offsets, so the reductions need neither
    // address arithmetic nor bounds checks (rows past seqlen_q and columns past head_dim only ever receive
    // zeros).
    float* dq_thread = params.dq_accum_ptr + binfo.dq_accum_row(params, batch_idx, head_idx) * kHeadDim +
                       tidx * dq_accum_vec();

    Tensor mQ = binfo.q_view<Element>(params, batch_idx, head_idx);      // (seqlen_q, head_dim)
    Tensor mdO = binfo.do_view<Element>(params, batch_idx, head_idx);    // (seqlen_q, head_dim_v)
    Tensor mK = binfo.k_view<Element>(params, batch_idx, head_idx_k);    // (seqlen_k, head_dim)
    Tensor mV = binfo.v_view<Element>(params, batch_idx, head_idx_k);    // (seqlen_k, head_dim_v)
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));    // (kBlockM, kHeadDim, m)
    Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(_, 0));  // (kBlockM, kHeadDimV, m)
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDimV)

    // Shared memory: Q and dO (kStagesQ stages each), K, V, P, dS, then the LSE and D rows of each stage. With V
    // in registers, P and dS take V's buffer once V has been read from it.
    extern __shared__ __align__(128) char smem[];
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                            typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
    Tensor sdO = make_tensor(sQ.data() + kStagesQ * kQElems, typename Traits::SmemLayoutdO{});  // (kBlockM, kHeadDimV)
    Tensor sK = make_tensor(sdO.data() + kStagesQ * kdOElems, typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutV{});  // (kBlockN, kHeadDimV)
    Tensor sP = make_tensor(Traits::kVInRegs ? sV.data() : sV.data() + size(sV),
                            typename Traits::SmemLayoutPdS{});  // (kBlockM, kBlockN)
    Tensor sdS = make_tensor(sP.data() + size(sP), typename Traits::SmemLayoutPdS{});  // (kBlockM, kBlockN)
    const auto rows_start = Traits::kVInRegs ? sV.data() + size(sV) : sdS.data() + size(sdS);
    float* s_lse = reinterpret_cast<float*>(raw_pointer_cast(rows_start.get()));  // (kStagesQ, kBlockM)
    float* s_dsum = s_lse + kStagesQ * kBlockM;  // (kStagesQ, kBlockM)
    Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});  // (kHeadDim, kBlockM)
    Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutdOt{});  // (kHeadDimV, kBlockM)
    Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});  // (kHeadDim, kBlockN)
    Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});  // (kBlockN, kBlockM)
    Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});  // (kBlockN, kBlockM)

    Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (kBlockM, kHeadDim)
    Tensor cdO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (kBlockM, kHeadDimV)
    Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (kBlockN, kHeadDim)
    Tensor cV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{});  // (kBlockN, kHeadDimV)
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (kBlockM, kBlockN)

    // Global -> shared copies: Q and K at kHeadDim, dO and V at kHeadDimV (the same copy where those are equal).
    typename Traits::GmemTiledCopyLoad gmem_tiled_copy;
    typename Traits::GmemTiledCopyLoadV gmem_tiled_copy_v;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    auto gmem_thr_copy_v = gmem_tiled_copy_v.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr_copy.partition_S(gQ);  // (CPY, CPY_M, CPY_K, m)
    Tensor tQsQ = smem_partition_D<typename Traits::GmemTiledCopyLoad>(sQ, tidx,
                                                                       take<0, 3>(shape(tQgQ)));  // (CPY, CPY_M, CPY_K)
    Tensor tdOgdO = gmem_thr_copy_v.partition_S(gdO);  // (CPY, CPY_M, CPY_K, m)
    Tensor tdOsdO = smem_partition_D<typename Traits::GmemTiledCopyLoadV>(
        sdO, tidx, take<0, 3>(shape(tdOgdO)));  // (CPY, CPY_M, CPY_K)
    Tensor tQcQ = gmem_thr_copy.partition_S(cQ);  // (CPY, CPY_M, CPY_K)
    Tensor tdOcdO = gmem_thr_copy_v.partition_S(cdO);  // (CPY, CPY_M, CPY_K)
    Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_K)
    Tensor tKsK = smem_partition_D<typename Traits::GmemTiledCopyLoad>(sK, tidx, tKgK);  // (CPY, CPY_N, CPY_K)
    Tensor tVgV = gmem_thr_copy_v.partition_S(gV);  // (CPY, CPY_N, CPY_K)
    Tensor tVsV = smem_partition_D<typename Traits::GmemTiledCopyLoadV>(sV, tidx, tVgV);  // (CPY, CPY_N, CPY_K)
    Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);  // (CPY, CPY_N, CPY_K)
    Tensor tVcV = gmem_thr_copy_v.partition_S(cV);  // (CPY, CPY_N, CPY_K)

    static_assert(Traits::kNThreads >= 2 * kBlockM);
    auto load_q_do = [&](int m_block, int stage) {
        const int rows_left = binfo.seqlen_q - m_block * kBlockM;
        Tensor tQsQ_stage = at_stage<kQElems>(tQsQ, stage);
        Tensor tdOsdO_stage = at_stage<kdOElems>(tdOsdO, stage);
        copy_zfill(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ_stage, tQcQ, rows_left, params.head_dim);
        copy_zfill(gmem_tiled_copy_v, tdOgdO(_, _, _, m_block), tdOsdO_stage, tdOcdO, rows_left, params.head_dim_v);
        // LSE by the first kBlockM threads, D by the next kBlockM; rows past seqlen_q read as 0.
        if (tidx < 2 * kBlockM) {
            const int row = tidx % kBlockM;
            const bool valid = row < rows_left;
            const float* src = (tidx < kBlockM ? lse_row : dsum_row) + (valid ? m_block * kBlockM + row : 0);
            float* dst = (tidx < kBlockM ? s_lse : s_dsum) + stage * kBlockM + row;
            cp_async_f32_zfill(dst, src, valid);
        }
    };

    // S = Q K^T and dP = dO V^T, (kBlockM, kBlockN).
    std::conditional_t<kVariants, typename Traits::TiledMmaSdPKeyRuns, typename Traits::TiledMmaSdP> mma_sdp;
    auto thr_mma_sdp = mma_sdp.get_thread_slice(tidx);
    auto copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto thr_copy_a_sdp = copy_a_sdp.get_thread_slice(tidx);
    auto thr_copy_b_sdp = copy_b_sdp.get_thread_slice(tidx);
    Tensor tSrQ = register_fragment_A<Element>(mma_sdp, sQ);  // (MMA, MMA_M, MMA_K)
    Tensor tSrdO = register_fragment_A<Element>(mma_sdp, sdO);  // (MMA, MMA_M, MMA_K)
    Tensor tSrK = register_fragment_B<Element>(mma_sdp, sK);  // (MMA, MMA_N, MMA_K)
    Tensor tSrV = register_fragment_B<Element>(mma_sdp, sV);  // (MMA, MMA_N, MMA_K)
    Tensor tSrQ_view = thr_copy_a_sdp.retile_D(tSrQ);  // (CPY, CPY_M, CPY_K)
    Tensor tSrdO_view = thr_copy_a_sdp.retile_D(tSrdO);  // (CPY, CPY_M, CPY_K)
    Tensor tSrK_view = thr_copy_b_sdp.retile_D(tSrK);  // (CPY, CPY_N, CPY_K)
    Tensor tSrV_view = thr_copy_b_sdp.retile_D(tSrV);  // (CPY, CPY_N, CPY_K)
    Tensor tSsQ = smem_partition_S<decltype(copy_a_sdp)>(sQ, tidx, tSrQ_view);  // (CPY, CPY_M, CPY_K)
    Tensor tSsdO = smem_partition_S<decltype(copy_a_sdp)>(sdO, tidx, tSrdO_view);  // (CPY, CPY_M, CPY_K)
    Tensor tSsK = smem_partition_S<decltype(copy_b_sdp)>(sK, tidx, tSrK_view);  // (CPY, CPY_N, CPY_K)
    Tensor tSsV = smem_partition_S<decltype(copy_b_sdp)>(sV, tidx, tSrV_view);  // (CPY, CPY_N, CPY_K)
    Tensor tScS = thr_mma_sdp.partition_C(cS);  // (MMA, MMA_M, MMA_N) positions in the tile
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout(tScS.layout()));  // (rows, cols)
    auto copy_store_sdp = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
    auto thr_copy_store_sdp = copy_store_sdp.get_thread_slice(tidx);
    using StoreViewSdP = decltype(shape(thr_copy_store_sdp.retile_S(make_tensor<Element>(shape(tScS)))));
    Tensor tPsP = smem_partition_D<decltype(copy_store_sdp)>(sP, tidx, StoreViewSdP{});  // (CPY, CPY_M, CPY_N)
    Tensor tPsdS = smem_partition_D<decltype(copy_store_sdp)>(sdS, tidx, StoreViewSdP{});  // (CPY, CPY_M, CPY_N)

    // dV += P^T dO, (kBlockN, kHeadDimV), and dK += dS^T Q, (kBlockN, kHeadDim): mma_dv is mma_dkv's type where
    // the head dims are equal.
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadV mma_dv;
    auto thr_mma_dkv = mma_dkv.get_thread_slice(tidx);
    auto thr_mma_dv = mma_dv.get_thread_slice(tidx);
    auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto copy_a_dv = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dv);
    auto copy_b_dv = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dv);
    auto thr_copy_a_dkv = copy_a_dkv.get_thread_slice(tidx);
    auto thr_copy_b_dkv = copy_b_dkv.get_thread_slice(tidx);
    auto thr_copy_a_dv = copy_a_dv.get_thread_slice(tidx);
    auto thr_copy_b_dv = copy_b_dv.get_thread_slice(tidx);
    Tensor tKVrPt = register_fragment_A<Element>(mma_dv, sPt);  // (MMA, MMA_N, MMA_K over queries)
    Tensor tKVrdSt = register_fragment_A<Element>(mma_dkv, sdSt);  // (MMA, MMA_N, MMA_K)
    Tensor tKVrdOt = register_fragment_B<Element>(mma_dv, sdOt);  // (MMA, MMA_DV, MMA_K)
    Tensor tKVrQt = register_fragment_B<Element>(mma_dkv, sQt);  // (MMA, MMA_D, MMA_K)
    Tensor tKVrPt_view = thr_copy_a_dv.retile_D(tKVrPt);  // (CPY, CPY_N, CPY_K)
    Tensor tKVrdSt_view = thr_copy_a_dkv.retile_D(tKVrdSt);  // (CPY, CPY_N, CPY_K)
    Tensor tKVrdOt_view = thr_copy_b_dv.retile_D(tKVrdOt);  // (CPY, CPY_DV, CPY_K)
    Tensor tKVrQt_view = thr_copy_b_dkv.retile_D(tKVrQt);  // (CPY, CPY_D, CPY_K)
    Tensor tKVsPt = smem_partition_S<decltype(copy_a_dv)>(sPt, tidx, tKVrPt_view);  // (CPY, CPY_N, CPY_K)
    Tensor tKVsdSt = smem_partition_S<decltype(copy_a_dkv)>(sdSt, tidx, tKVrdSt_view);  // (CPY, CPY_N, CPY_K)
    Tensor tKVsdOt = smem_partition_S<decltype(copy_b_dv)>(sdOt, tidx, tKVrdOt_view);  // (CPY, CPY_DV, CPY_K)
    Tensor tKVsQt = smem_partition_S<decltype(copy_b_dkv)>(sQt, tidx, tKVrQt_view);  // (CPY, CPY_D, CPY_K)
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<kHeadDimV>>{});  // (MMA, MMA_N, MMA_DV)
    clear(acc_dk);
    clear(acc_dv);

    // dQ = dS K, (kBlockM, kDqChunk) per chunk of head-dim columns.
    typename Traits::TiledMmadQ mma_dq;
    auto thr_mma_dq = mma_dq.get_thread_slice(tidx);
    auto copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
    auto copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dq);
    auto thr_copy_a_dq = copy_a_dq.get_thread_slice(tidx);
    auto thr_copy_b_dq = copy_b_dq.get_thread_slice(tidx);
    Tensor sKt_chunks = local_tile(sKt, Shape<Int<kDqChunk>, Int<kBlockN>>{},
                                   make_coord(_, 0));  // (kDqChunk, kBlockN, chunk)
    Tensor tQrdS = register_fragment_A<Element>(mma_dq, sdS);  // (MMA, MMA_M, MMA_K over keys)
    Tensor tQrKt = register_fragment_B<Element>(mma_dq, sKt_chunks(_, _, 0));  // (MMA, MMA_D, MMA_K)
    Tensor tQrdS_view = thr_copy_a_dq.retile_D(tQrdS);  // (CPY, CPY_M, CPY_K)
    Tensor tQrKt_view = thr_copy_b_dq.retile_D(tQrKt);  // (CPY, CPY_D, CPY_K)
    Tensor tQsdS = smem_partition_S<decltype(copy_a_dq)>(sdS, tidx, tQrdS_view);  // (CPY, CPY_M, CPY_K)
    Tensor tQsKt = smem_partition_S<decltype(copy_b_dq)>(
        sKt_chunks, tidx, append(shape(tQrKt_view), Int<kHeadDim / kDqChunk>{}));  // (CPY, CPY_D, CPY_K, chunk)

    const int k_rows_left = binfo.seqlen_k - n_block * kBlockN;
    copy_zfill(gmem_tiled_copy, tKgK, tKsK, tKVcKV, k_rows_left, params.head_dim);
    copy_zfill(gmem_tiled_copy_v, tVgV, tVsV, tVcV, k_rows_left, params.head_dim_v);
    if (m_block_begin < m_block_end) { load_q_do(m_block_begin, 0); }
    cp_async_fence();
    if constexpr (Traits::kVInRegs) {
        cp_async_wait<0>();
        __syncthreads();  // V has landed
        copy(copy_b_sdp, tSsV, tSrV_view);
        __syncthreads();  // every warp holds its V fragments before any writes P or dS over them
    }

    const int m_blocks_max = (params.seqlen_q + kBlockM - 1) / kBlockM;
    int* dq_semaphore = params.dq_semaphore_ptr + (index_t(batch_idx) * params.num_heads + head_idx) * m_blocks_max;
    // One query block: S and dP, P and dS (with the mask when kMasked: std::true_type or std::false_type), then
    // dQ, dV and dK.
    auto step = [&](int m_block, auto masked) __attribute__((always_inline)) {
        constexpr bool kMasked = decltype(masked)::value;
        const int stage = kStagesQ == 2 ? (m_block - m_block_begin) & 1 : 0;
        const int q_rows_left = binfo.seqlen_q - m_block * kBlockM;
        cp_async_wait<0>();
        __syncthreads();  // Q and dO of this block have landed; every warp is done with the last P, dS and stage.
        if (kStagesQ == 2 && m_block + 1 < m_block_end) {
            load_q_do(m_block + 1, stage ^ 1);
            cp_async_fence();
        }

        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        clear(acc_s);
        clear(acc_dp);
        Tensor tSsQ_stage = at_stage<kQElems>(tSsQ, stage);
        Tensor tSsdO_stage = at_stage<kdOElems>(tSsdO, stage);
        gemm_smem_smem(mma_sdp, acc_s, tSrQ, tSrK, tSsQ_stage, tSsK, copy_a_sdp, copy_b_sdp, tSrQ_view, tSrK_view);
        if constexpr (Traits::kVInRegs) {
            gemm_smem_reg(mma_sdp, acc_dp, tSrdO, tSrV, tSsdO_stage, copy_a_sdp, tSrdO_view);
        } else {
            gemm_smem_smem(mma_sdp, acc_dp, tSrdO, tSrV, tSsdO_stage, tSsV, copy_a_sdp, copy_b_sdp, tSrdO_view,
                           tSrV_view);
        }

        Tensor scores = as_rowcol(acc_s);  // (rows, cols)
        Tensor dp = as_rowcol(acc_dp);  // (rows, cols)
        // P = exp(s * scale - lse) in base 2; rows past seqlen_q get lse = +inf, so P = 0 there. Then dS.
        const float* lse_stage = s_lse + stage * kBlockM;
        const float* dsum_stage = s_dsum + stage * kBlockM;
        const ScorePos pos{m_block * kBlockM, n_block * kBlockN, head_idx};
        auto lse_log2_of = [&](int row) { return row < q_rows_left ? lse_stage[row] * float(M_LOG2E) : INFINITY; };
        auto dsum_of = [&](int row) { return dsum_stage[row]; };
        auto p_and_ds = [&](const auto& mask) {
            if constexpr (kVariants) {
                if (score_mod.softcap() && !dropout.active()) {
                    compute_p_ds_softcap</*kQueryIsRow=*/true, HideP::kBeforeExp>(
                        scores, dp, tScS_rc, mask, score_mod, pos, params.softmax_scale_log2, lse_log2_of, dsum_of);
                    return;
                }
                if (dropout.active() && !score_mod.softcap()) {
                    compute_p</*kQueryIsRow=*/true, HideP::kBeforeExp, kVariants>(
                        scores, tScS_rc, mask, score_mod, pos, params.softmax_scale_log2, lse_log2_of);
                    dropout.apply_with_ds(scores, dp, tScS_rc, pos.q0, pos.k0, dsum_of);
                    return;
                }
            }
            compute_p</*kQueryIsRow=*/true, HideP::kBeforeExp, kVariants>(scores, tScS_rc, mask, score_mod, pos,
                                                                          params.softmax_scale_log2, lse_log2_of);
            if (kVariants && dropout.active()) {
                dropout.template apply</*kQueryIsRow=*/true, /*kNegate=*/true>(scores, tScS_rc, pos.q0, pos.k0);
            }
            compute_ds</*kQueryIsRow=*/true, kVariants>(dp, scores, tScS_rc, dsum_of,
                                                        DsMods<Element>{score_mod, head_idx}, pos, lse_log2_of);
        };
        if constexpr (kMasked) {
            p_and_ds(TileMask<kBlockM, kBlockN, kCausal, kVariants>(bounds, m_block, n_block));
        } else {
            p_and_ds(NoTileMask{});
        }
        // P is sign-coded only with dropout and softcap; dropout alone leaves the kept P (apply_with_ds).
        Tensor rP = convert_fragment_kept<Element>(acc_s, kVariants && dropout.active() && score_mod.softcap());
        Tensor rdS = convert_fragment<Element>(acc_dp);
        copy(copy_store_sdp, thr_copy_store_sdp.retile_S(rP), tPsP);
        copy(copy_store_sdp, thr_copy_store_sdp.retile_S(rdS), tPsdS);
        __syncthreads();  // P and dS are visible to all warps.

        // dQ = dS K, added into dq_accum. In deterministic mode the key blocks that see a query block add into
        // it in a fixed order, each waiting for its predecessor, which has a lower CTA index and so was
        // scheduled first. Non-causal: ascending key blocks. Causal: descending, so each key block starts at
        // its first query block while the later key blocks (which start further down) are already ahead of
        // it; ascending order would make the long first key block hold back every other one.
        const int dq_turn = reversed ? bounds.n_block_end(m_block) - 1 - n_block : n_block;
        auto wait_dq_turn = [&] {
            if (params.deterministic) {
                if (tidx == 0) {
                    while (load_acquire(dq_semaphore + m_block) != dq_turn) {}
                }
                __syncthreads();
            }
        };
        auto pass_dq_turn = [&] {
            if (params.deterministic) {
                __threadfence();
                __syncthreads();
                if (tidx == 0) { store_release(dq_semaphore + m_block, dq_turn + 1); }
            }
        };
        // dQ of one chunk of head-dim columns, (kBlockM, kDqChunk).
        auto dq_gemm = [&](auto& acc_dq, int chunk) {
            clear(acc_dq);
            Tensor tQsKt_chunk = tQsKt(_, _, _, chunk);
            gemm_smem_smem(mma_dq, acc_dq, tQrdS, tQrKt, tQsdS, tQsKt_chunk, copy_a_dq, copy_b_dq, tQrdS_view,
                           tQrKt_view);
        };
        // Adds part `part` of `parts` runs of a chunk's dQ into dq_accum, in fragment order (dq_accum_vec).
        auto add_dq = [&](const auto& acc_dq, int chunk, int part, auto parts) {
            constexpr int kVec = dq_accum_vec();
            constexpr int kGroups = decltype(size(acc_dq))::value / kVec;
            constexpr int kParts = decltype(parts)::value;
            static_assert(kGroups * kVec == decltype(size(acc_dq))::value);  // a part may be empty
            float* dst = dq_thread + (m_block * (kHeadDim / kDqChunk) + chunk) * (kBlockM * kDqChunk);
            CUTE_UNROLL
            for (int g = part * kGroups / kParts; g < (part + 1) * kGroups / kParts; ++g) {
                red_add_dq(dst + g * Traits::kNThreads * kVec, acc_dq, g);
            }
        };

        // The first dQ chunk is computed before the dV GEMM, and its reductions go into that GEMM's basic block,
        // a run after each k-step. In a block of their own, ended by deterministic mode's branch, the step was
        // 1.8-4.7% slower at head dims 64 and 128, though ptxas issues them in one run either way; spreading them
        // further was slower (docs/design-notes.md, 'mma.sync backward: dQ reductions and basic blocks').
        // With one Q stage the next Q and dO load once the dV and dK GEMMs are done with this block's; the
        // remaining chunks then overlap that load. Only one chunk runs ahead: its accumulator is live next to
        // dK and dV.
        constexpr int kDqChunks = kHeadDim / kDqChunk;
        constexpr int kDqChunksFirst = kStagesQ == 2 ? kDqChunks : kDqChunks - 1;
        static_assert(kDqChunksFirst <= 1);
        Tensor tKVsdOt_stage = at_stage<kdOElems>(tKVsdOt, stage);
        Tensor tKVsQt_stage = at_stage<kQElems>(tKVsQt, stage);
        if constexpr (kDqChunksFirst == 1) {
            wait_dq_turn();
            Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDqChunk>>{});  // (MMA, MMA_M, MMA_D)
            dq_gemm(acc_dq, 0);
            constexpr auto kDvSteps = size<2>(tKVrPt);
            gemm_smem_smem(mma_dv, acc_dv, tKVrPt, tKVrdOt, tKVsPt, tKVsdOt_stage, copy_a_dv, copy_b_dv, tKVrPt_view,
                           tKVrdOt_view, [&](int k) { add_dq(acc_dq, 0, k, kDvSteps); });
        } else {
            gemm_smem_smem(mma_dv, acc_dv, tKVrPt, tKVrdOt, tKVsPt, tKVsdOt_stage, copy_a_dv, copy_b_dv, tKVrPt_view,
                           tKVrdOt_view);
        }
        if constexpr (kDqChunksFirst == kDqChunks) { pass_dq_turn(); }
        gemm_smem_smem(mma_dkv, acc_dk, tKVrdSt, tKVrQt, tKVsdSt, tKVsQt_stage, copy_a_dkv, copy_b_dkv, tKVrdSt_view,
                       tKVrQt_view);
        if constexpr (kStagesQ == 1) {
            if (m_block + 1 < m_block_end) {
                __syncthreads();  // every warp is done with Q, dO and their LSE and D rows
                load_q_do(m_block + 1, 0);
                cp_async_fence();
            }
            if constexpr (kDqChunksFirst == 0) { wait_dq_turn(); }
            CUTE_UNROLL
            for (int chunk = kDqChunksFirst; chunk < kDqChunks; ++chunk) {
                Tensor acc_dq = partition_fragment_C(mma_dq,
                                                     Shape<Int<kBlockM>, Int<kDqChunk>>{});  // (MMA, MMA_M, MMA_D)
                dq_gemm(acc_dq, chunk);
                add_dq(acc_dq, chunk, 0, _1{});
            }
            pass_dq_turn();
        }
    };
    // The plain kernels' masked tiles (the causal diagonal, or every tile of the key block holding the sequence
    // end) are the first ones visited, so the steps after them carry no mask code (rows past seqlen_q need none:
    // their LSE reads as +inf). Not in the variants kernel, where a window's left edge masks the last query
    // blocks too; and not at head dim 64 non-causal, where the second copy of the step body cost 20 bytes of
    // spills and made the kernel 3% slower, so that every step checks.
    constexpr bool kSplitSteps = !kVariants && (kCausal || kHeadDim != 64);
    visit_masked_first</*kStep=*/1, kSplitSteps>(m_block_begin, m_block_end, [&](int m) {
        return TileMask<kBlockM, kBlockN, kCausal, kVariants>(bounds, m, n_block).needs_mask();
    }, step);
    cp_async_wait<0>();  // K and V are still in flight when no query block sees this key block.

    // dK picks up the softmax scale here (dS is the gradient of the scaled scores); dQ gets it when its
    // fp32 buffer is converted. dV picks up dropout's 1 / (1 - p) (1 without dropout): it summed kept P unscaled.
    // GQA slices are summed over each group on the host: kept in fp32 so the sum is rounded once.
    if (params.dkv_fp32) {
        Tensor tKVcdKV = thr_mma_dkv.partition_C(cKV);
        Tensor tKVcdV = thr_mma_dv.partition_C(cV);
        Tensor gdK = local_tile(binfo.dk_view<float>(params, batch_idx, head_idx), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                make_coord(n_block, 0));  // (kBlockN, kHeadDim)
        Tensor gdV = local_tile(binfo.dv_view<float>(params, batch_idx, head_idx),
                                Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDimV)
        store_acc<float>(acc_dk, tKVcdKV, gdK, k_rows_left, params.head_dim, params.softmax_scale);
        store_acc<float>(acc_dv, tKVcdV, gdV, k_rows_left, params.head_dim_v,
                         kVariants ? params.dropout_keep_scale : 1.f);
        return;
    }
    // Element-typed dK and dV go through K's and V's buffers, as in the Hopper backward: each thread then writes
    // whole 16 B chunks of rows, where its accumulator holds 4 B pairs, half a 32 B sector per row of a warp's
    // store.
    __syncthreads();  // every warp is done with K and V (and with P and dS, in V's buffer when V is in registers)
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= params.softmax_scale; }
    if constexpr (kVariants) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dv); ++i) { acc_dv(i) *= params.dropout_keep_scale; }
    }
    Tensor rdK = convert_fragment<Element>(acc_dk);
    Tensor rdV = convert_fragment<Element>(acc_dv);
    auto smem_tiled_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dkv);
    auto smem_thr_copy = smem_tiled_copy.get_thread_slice(tidx);
    auto smem_tiled_copy_v = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dv);
    auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(tidx);
    Tensor tdKrdK = smem_thr_copy.retile_S(rdK);  // (CPY, CPY_N, CPY_D)
    Tensor tdVrdV = smem_thr_copy_v.retile_S(rdV);  // (CPY, CPY_N, CPY_DV)
    copy(smem_tiled_copy, tdKrdK, smem_partition_D<decltype(smem_tiled_copy)>(sK, tidx, tdKrdK));
    copy(smem_tiled_copy_v, tdVrdV, smem_partition_D<decltype(smem_tiled_copy_v)>(sV, tidx, tdVrdV));
    __syncthreads();
    typename Traits::GmemTiledCopyStore gmem_tiled_copy_store;
    typename Traits::GmemTiledCopyStoreV gmem_tiled_copy_store_v;
    auto gmem_thr_copy_store = gmem_tiled_copy_store.get_thread_slice(tidx);
    auto gmem_thr_copy_store_v = gmem_tiled_copy_store_v.get_thread_slice(tidx);
    Tensor gdK = local_tile(binfo.dk_view<Element>(params, batch_idx, head_idx), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                            make_coord(n_block, 0));  // (kBlockN, kHeadDim)
    Tensor gdV = local_tile(binfo.dv_view<Element>(params, batch_idx, head_idx), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                            make_coord(n_block, 0));  // (kBlockN, kHeadDimV)
    Tensor tdKcdK = gmem_thr_copy_store.partition_D(cKV);  // (CPY, CPY_N, CPY_D)
    Tensor tdVcdV = gmem_thr_copy_store_v.partition_D(cV);  // (CPY, CPY_N, CPY_DV)
    Tensor tdKgdK = gmem_thr_copy_store.partition_D(gdK);  // (CPY, CPY_N, CPY_D)
    Tensor tdVgdV = gmem_thr_copy_store_v.partition_D(gdV);  // (CPY, CPY_N, CPY_DV)
    copy_to_gmem(gmem_tiled_copy_store, smem_partition_S<typename Traits::GmemTiledCopyStore>(sK, tidx, tdKgdK), tdKgdK,
                 tdKcdK, k_rows_left, params.head_dim);
    copy_to_gmem(gmem_tiled_copy_store_v, smem_partition_S<typename Traits::GmemTiledCopyStoreV>(sV, tidx, tdVgdV),
                 tdVgdV, tdVcdV, k_rows_left, params.head_dim_v);
}

// dq = softmax_scale * dq_accum for one query block of one (sequence, query head), from dq_accum in the dQ
// GEMM's fragment order (convert_dq_tile).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams params) {
    convert_dq_tile<Traits>(params);
}

}  // namespace flash
