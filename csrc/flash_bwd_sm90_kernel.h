// FlashAttention-2 backward kernel for Hopper (sm_90a) on warpgroup MMAs. The schedule is that of
// flash_bwd_kernel.h (one CTA owns kBlockN keys and walks the query blocks that see them; P is recomputed
// from the LSE; dK and dV stay in registers; dQ goes to an fp32 buffer by reduction), with the score GEMMs
// computed transposed so each warpgroup holds P^T and dS^T for its own keys. Deterministic mode runs the
// mma.sync kernel.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "block_info.h"
#include "flash_bwd_kernel.h"
#include "flash_params.h"
#include "kernel_traits_sm90.h"
#include "mask.h"
#include "utils.h"
#include "utils_sm90.h"

namespace flash {

using namespace cute;

template <class Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kQElems = Traits::kSmemQElems;

    const int n_block = blockIdx.x;
    const int batch_idx = blockIdx.y;
    const int head_idx = blockIdx.z;
    const int head_idx_k = head_idx / (params.num_heads / params.num_heads_k);
    const int tidx = threadIdx.x;
    const BlockInfo binfo(params, batch_idx);
    if (n_block * kBlockN >= binfo.seqlen_k) { return; }

    const int m_block_end = (binfo.seqlen_q + kBlockM - 1) / kBlockM;
    // The first query block with a row that sees a key of this block (causal: row >= key - (sk - sq)).
    int m_block_begin = 0;
    if constexpr (kCausal) {
        const int first_row = n_block * kBlockN - (binfo.seqlen_k - binfo.seqlen_q);
        m_block_begin = first_row <= 0 ? 0 : min(first_row / kBlockM, m_block_end);
    }
    // Query row i sees key j iff j <= i + causal_offset.
    const int causal_offset = binfo.seqlen_k - binfo.seqlen_q;

    const index_t lse_offset = binfo.lse_offset(params, batch_idx, head_idx);
    const float* lse_row = params.lse_ptr + lse_offset;
    const float* dsum_row = params.dsum_ptr + lse_offset;
    float* dq_head = params.dq_accum_ptr + binfo.dq_accum_row(params, batch_idx, head_idx) * kHeadDim;

    Tensor mQ = binfo.q_view<Element>(params, batch_idx, head_idx);    // (seqlen_q, head_dim)
    Tensor mdO = binfo.do_view<Element>(params, batch_idx, head_idx);  // (seqlen_q, head_dim)
    Tensor mK = binfo.k_view<Element>(params, batch_idx, head_idx_k);  // (seqlen_k, head_dim)
    Tensor mV = binfo.v_view<Element>(params, batch_idx, head_idx_k);  // (seqlen_k, head_dim)
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));        // (kBlockM, kHeadDim, m)
    Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));      // (kBlockM, kHeadDim, m)
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)

    // Shared memory: Q and dO (two stages each), K, V, dS^T, then the LSE and D rows of each stage.
    extern __shared__ __align__(1024) char smem_bwd_sm90[];  // 128 B swizzle atoms repeat every 1 KiB
    Element* smem_base = reinterpret_cast<Element*>(smem_bwd_sm90);
    Element* q_base = smem_base;                                     // stage s at q_base + s * kQElems
    Element* do_base = q_base + Traits::kStagesQ * kQElems;          // likewise
    Element* k_base = do_base + Traits::kStagesQ * kQElems;
    Element* v_base = k_base + Traits::kSmemKVElems;
    Element* dst_base = v_base + Traits::kSmemKVElems;
    float* s_lse = reinterpret_cast<float*>(dst_base + Traits::kSmemdSElems);  // (kStagesQ, kBlockM)
    float* s_dsum = s_lse + Traits::kStagesQ * kBlockM;                         // (kStagesQ, kBlockM)
    auto smem = [](Element* p, auto layout) { return make_tensor(make_smem_ptr(p), layout); };
    Tensor sK = smem(k_base, typename Traits::SmemLayoutKV{});    // (kBlockN, kHeadDim)
    Tensor sV = smem(v_base, typename Traits::SmemLayoutKV{});    // (kBlockN, kHeadDim)
    Tensor sKt = smem(k_base, typename Traits::SmemLayoutKt{});   // (kHeadDim, kBlockN)
    Tensor sdSt = smem(dst_base, typename Traits::SmemLayoutdSt{});  // (kBlockN, kBlockM)
    Tensor sdS = smem(dst_base, typename Traits::SmemLayoutdS{});    // (kBlockM, kBlockN)

    Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (kBlockM, kHeadDim)
    Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (kBlockN, kHeadDim)
    Tensor cSt = make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{});   // (kBlockN, kBlockM)

    // Per-thread partitions inside the main loop are made from opaque_int(tidx): their addresses are then
    // recomputed each step (a few integer ops) instead of being hoisted out of the loop, where, next to
    // the dK and dV accumulators, they would spill.
    typename Traits::GmemTiledCopyLoad gmem_tiled_copy;
    static_assert(Traits::kNThreads >= 2 * kBlockM);
    auto load_q_do = [&](int m_block, int stage, int thread) {
        auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(thread);
        Tensor tQcQ = gmem_thr_copy.partition_S(cQ);  // (CPY, CPY_M, CPY_K)
        Tensor tQsQ = gmem_thr_copy.partition_D(smem(q_base + stage * kQElems, typename Traits::SmemLayoutQ{}));
        Tensor tdOsdO = gmem_thr_copy.partition_D(smem(do_base + stage * kQElems, typename Traits::SmemLayoutQ{}));
        const int rows_left = binfo.seqlen_q - m_block * kBlockM;
        copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gQ(_, _, m_block)), tQsQ, tQcQ, rows_left, params.head_dim);
        copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gdO(_, _, m_block)), tdOsdO, tQcQ, rows_left,
                   params.head_dim);
        // LSE by the first kBlockM threads, D by the next kBlockM. Rows past seqlen_q read as 0: their Q
        // and dO rows are zero too, so P = 1 and dS = 0 there, and nothing reaches dV, dK or a stored dQ row.
        if (thread < 2 * kBlockM) {
            const int row = thread % kBlockM;
            const bool valid = row < rows_left;
            const float* src = (thread < kBlockM ? lse_row : dsum_row) + (valid ? m_block * kBlockM + row : 0);
            float* dst = (thread < kBlockM ? s_lse : s_dsum) + stage * kBlockM + row;
            cp_async_f32_zfill(dst, src, valid);
        }
    };

    // S^T and dP^T, (kBlockN, kBlockM): A operands K and V are fixed; B operands Q and dO change per stage.
    typename Traits::TiledMmaSdP mma_sdp;
    Tensor tSrK = mma_sdp.get_thread_slice(tidx).make_fragment_A(mma_sdp.get_thread_slice(tidx).partition_A(sK));  // (MMA, MMA_N, MMA_K)
    Tensor tSrV = mma_sdp.get_thread_slice(tidx).make_fragment_A(mma_sdp.get_thread_slice(tidx).partition_A(sV));  // (MMA, MMA_N, MMA_K)
    auto smem_tiled_copy_dst = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);

    // dV and dK, (kBlockN, kHeadDim), held in registers across the whole loop.
    typename Traits::TiledMmadKV mma_dkv;
    auto thr_mma_dkv = mma_dkv.get_thread_slice(tidx);
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    clear(acc_dk);
    clear(acc_dv);

    // dQ, (kBlockM, kHeadDim), added into dq_accum.
    typename Traits::TiledMmadQ mma_dq;
    Tensor gdQaccum = make_tensor(make_gmem_ptr(dq_head),
                                  make_layout(make_shape(Int<kBlockM>{}, Int<kHeadDim>{}, m_block_end),
                                              make_stride(Int<kHeadDim>{}, _1{}, Int<kBlockM * kHeadDim>{})));  // (kBlockM, kHeadDim, m)

    const int k_rows_left = binfo.seqlen_k - n_block * kBlockN;
    {
        auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
        Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);  // (CPY, CPY_N, CPY_K)
        Tensor tKsK = gmem_thr_copy.partition_D(sK);     // (CPY, CPY_N, CPY_K)
        Tensor tVsV = gmem_thr_copy.partition_D(sV);     // (CPY, CPY_N, CPY_K)
        copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gK), tKsK, tKVcKV, k_rows_left, params.head_dim);
        copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gV), tVsV, tKVcKV, k_rows_left, params.head_dim);
    }
    if (m_block_begin < m_block_end) { load_q_do(m_block_begin, 0, tidx); }
    cp_async_fence();

    for (int m_block = m_block_begin; m_block < m_block_end; ++m_block) {
        const int stage = (m_block - m_block_begin) & 1;
        const int loop_tidx = opaque_int(tidx);
        cp_async_wait<0>();
        // cp.async writes are generic-proxy stores; wgmma reads shared memory through the async proxy.
        cutlass::arch::fence_view_async_shared();
        __syncthreads();  // this block's Q, dO, LSE and D have landed; every warpgroup is done with dS^T and the other stage
        if (m_block + 1 < m_block_end) {
            load_q_do(m_block + 1, stage ^ 1, loop_tidx);
            cp_async_fence();
        }

        Tensor sQ = smem(q_base + stage * kQElems, typename Traits::SmemLayoutQ{});      // (kBlockM, kHeadDim)
        Tensor sdO = smem(do_base + stage * kQElems, typename Traits::SmemLayoutQ{});    // (kBlockM, kHeadDim)
        Tensor sQt = smem(q_base + stage * kQElems, typename Traits::SmemLayoutQt{});    // (kHeadDim, kBlockM)
        Tensor sdOt = smem(do_base + stage * kQElems, typename Traits::SmemLayoutQt{});  // (kHeadDim, kBlockM)

        // Both score GEMMs are in flight together; P^T is computed while dP^T finishes.
        auto thr_mma_sdp = mma_sdp.get_thread_slice(loop_tidx);
        Tensor acc_st = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});   // (MMA, MMA_N, MMA_M)
        Tensor acc_dpt = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA, MMA_N, MMA_M)
        Tensor tSrQ = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sQ));    // (MMA, MMA_M, MMA_K)
        Tensor tSrdO = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sdO));  // (MMA, MMA_M, MMA_K)
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ, acc_st);
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrV, tSrdO, acc_dpt);

        // (key row, query column) of each accumulator value.
        Tensor tStcSt = thr_mma_sdp.partition_C(cSt);                                            // (MMA, MMA_N, MMA_M)
        Tensor tStcSt_rc = make_tensor(tStcSt.data(), gmma_acc_rowcol_layout(tStcSt.layout()));  // (key rows, query cols)
        // Causal: key n_block * kBlockN + row is hidden from query m_block * kBlockM + col iff row - col > diag.
        const int diag = m_block * kBlockM + causal_offset - n_block * kBlockN;
        const bool causal_tile = kCausal && kBlockN - 1 > diag;
        const float* lse_stage = s_lse + stage * kBlockM;
        const float* dsum_stage = s_dsum + stage * kBlockM;

        // P^T = exp2(s * scale * log2(e) - lse * log2(e)).
        warpgroup_wait_for<1>(acc_st);
        Tensor st = gmma_as_rowcol(acc_st);  // (key rows, query cols)
        CUTE_UNROLL
        for (int c = 0; c < size<1>(st); ++c) {
            const int col = get<1>(tStcSt_rc(0, c));
            const float lse_log2 = lse_stage[col] * float(M_LOG2E);
            CUTE_UNROLL
            for (int r = 0; r < size<0>(st); ++r) {
                const bool hidden = causal_tile && get<0>(tStcSt_rc(r, c)) - col > diag;
                st(r, c) = hidden ? 0.f : exp2f(st(r, c) * params.softmax_scale_log2 - lse_log2);
            }
        }
        Tensor rPt = convert_fragment<Element>(acc_st);
        Tensor tKVrPt = make_tensor(rPt.data(), gmma_acc_as_a_operand_layout(rPt.layout()));  // (MMA, MMA_N, MMA_K)
        auto thr_mma_dkv_l = mma_dkv.get_thread_slice(loop_tidx);
        Tensor tKVrdOt = thr_mma_dkv_l.make_fragment_B(thr_mma_dkv_l.partition_B(sdOt));  // (MMA, MMA_D, MMA_K)
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_dkv, tKVrPt, tKVrdOt, acc_dv);

        // dS^T = P^T (dP^T - D), the gradient of the scaled scores.
        warpgroup_wait_for<1>(acc_dpt);
        Tensor dpt = gmma_as_rowcol(acc_dpt);  // (key rows, query cols)
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dpt); ++c) {
            const float dsum = dsum_stage[get<1>(tStcSt_rc(0, c))];
            CUTE_UNROLL
            for (int r = 0; r < size<0>(dpt); ++r) { dpt(r, c) = st(r, c) * (dpt(r, c) - dsum); }
        }
        Tensor rdSt = convert_fragment<Element>(acc_dpt);
        Tensor tKVrdSt = make_tensor(rdSt.data(), gmma_acc_as_a_operand_layout(rdSt.layout()));  // (MMA, MMA_N, MMA_K)

        // dS^T to shared memory for the dQ GEMM, whose rows (queries) span both warpgroups' keys.
        auto smem_thr_copy_dst = smem_tiled_copy_dst.get_thread_slice(loop_tidx);
        Tensor tdStrdSt = smem_thr_copy_dst.retile_S(rdSt);     // (CPY, CPY_N, CPY_M)
        Tensor tdStsdSt = smem_thr_copy_dst.partition_D(sdSt);  // (CPY, CPY_N, CPY_M)
        copy(smem_tiled_copy_dst, tdStrdSt, tdStsdSt);
        cutlass::arch::fence_view_async_shared();

        Tensor tKVrQt = thr_mma_dkv_l.make_fragment_B(thr_mma_dkv_l.partition_B(sQt));  // (MMA, MMA_D, MMA_K)
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_dkv, tKVrdSt, tKVrQt, acc_dk);

        __syncthreads();  // all of dS^T is in shared memory
        auto thr_mma_dq = mma_dq.get_thread_slice(loop_tidx);
        Tensor tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS));   // (MMA, MMA_M, MMA_K)
        Tensor tQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt));   // (MMA, MMA_D, MMA_K)
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_dq, tQrdS, tQrKt, acc_dq);
        warpgroup_wait_for<0>(acc_dq);
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(rPt);
        warpgroup_fence_operand(rdSt);
        Tensor tdQgdQ = thr_mma_dq.partition_C(gdQaccum(_, _, m_block));  // (MMA, MMA_M, MMA_D)
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += 2) { red_add_pair(&tdQgdQ(i), acc_dq(i), acc_dq(i + 1)); }
    }
    cp_async_wait<0>();  // K and V are still in flight when no query block sees this key block.

    // dK picks up the softmax scale here; dQ gets it when its fp32 buffer is converted.
    Tensor tKVcdKV = thr_mma_dkv.partition_C(cKV);  // (MMA, MMA_N, MMA_D)
    auto store_dk_dv = [&](auto out_type) {
        using Out = decltype(out_type);
        Tensor mdK = binfo.dk_view<Out>(params, batch_idx, head_idx);  // (seqlen_k, head_dim)
        Tensor mdV = binfo.dv_view<Out>(params, batch_idx, head_idx);  // (seqlen_k, head_dim)
        Tensor gdK = local_tile(mdK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
        Tensor gdV = local_tile(mdV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
        store_acc<Out>(acc_dk, tKVcdKV, gdK, k_rows_left, params.head_dim, params.softmax_scale);
        store_acc<Out>(acc_dv, tKVcdKV, gdV, k_rows_left, params.head_dim, 1.f);
    };
    if (params.dkv_fp32) {
        store_dk_dv(float{});
    } else {
        store_dk_dv(Element{});
    }
#endif
}

}  // namespace flash
