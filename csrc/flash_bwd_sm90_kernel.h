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

    typename Traits::GmemTiledCopyLoad gmem_tiled_copy;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr_copy.partition_S(gQ);     // (CPY, CPY_M, CPY_K, m)
    Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);  // (CPY, CPY_M, CPY_K, m)
    Tensor tQcQ = gmem_thr_copy.partition_S(cQ);     // (CPY, CPY_M, CPY_K)
    Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);  // (CPY, CPY_N, CPY_K)

    static_assert(Traits::kNThreads >= 2 * kBlockM);
    auto load_q_do = [&](int m_block, int stage) {
        const int rows_left = binfo.seqlen_q - m_block * kBlockM;
        Tensor tQsQ = gmem_thr_copy.partition_D(smem(q_base + stage * kQElems, typename Traits::SmemLayoutQ{}));
        Tensor tdOsdO = gmem_thr_copy.partition_D(smem(do_base + stage * kQElems, typename Traits::SmemLayoutQ{}));
        copy_zfill(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ, tQcQ, rows_left, params.head_dim);
        copy_zfill(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO, tQcQ, rows_left, params.head_dim);
        // LSE by the first kBlockM threads, D by the next kBlockM; rows past seqlen_q read as 0.
        if (tidx < 2 * kBlockM) {
            const int row = tidx % kBlockM;
            const bool valid = row < rows_left;
            const float* src = (tidx < kBlockM ? lse_row : dsum_row) + (valid ? m_block * kBlockM + row : 0);
            float* dst = (tidx < kBlockM ? s_lse : s_dsum) + stage * kBlockM + row;
            cp_async_f32_zfill(dst, src, valid);
        }
    };

    // S^T and dP^T, (kBlockN, kBlockM): descriptors of K and V (fixed) and of each stage's Q and dO.
    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_mma_sdp = mma_sdp.get_thread_slice(tidx);
    Tensor tSrK = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(sK));  // (MMA, MMA_N, MMA_K)
    Tensor tSrV = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(sV));  // (MMA, MMA_N, MMA_K)
    Tensor tStcSt = thr_mma_sdp.partition_C(cSt);                                          // (MMA, MMA_N, MMA_M)
    Tensor tStcSt_rc = make_tensor(tStcSt.data(), gmma_acc_rowcol_layout(tStcSt.layout()));  // (key rows, query cols)

    // dV and dK, (kBlockN, kHeadDim).
    typename Traits::TiledMmadKV mma_dkv;
    auto thr_mma_dkv = mma_dkv.get_thread_slice(tidx);
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    clear(acc_dk);
    clear(acc_dv);

    // dQ, (kBlockM, kHeadDim), added into dq_accum.
    typename Traits::TiledMmadQ mma_dq;
    auto thr_mma_dq = mma_dq.get_thread_slice(tidx);
    Tensor tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS));  // (MMA, MMA_M, MMA_K)
    Tensor tQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt));  // (MMA, MMA_D, MMA_K)
    Tensor gdQaccum = make_tensor(make_gmem_ptr(dq_head),
                                  make_layout(make_shape(Int<kBlockM>{}, Int<kHeadDim>{}, m_block_end),
                                              make_stride(Int<kHeadDim>{}, _1{}, Int<kBlockM * kHeadDim>{})));  // (kBlockM, kHeadDim, m)
    Tensor tdQgdQaccum = thr_mma_dq.partition_C(gdQaccum);  // (MMA, MMA_M, MMA_D, m)

    const int k_rows_left = binfo.seqlen_k - n_block * kBlockN;
    Tensor tKsK = gmem_thr_copy.partition_D(sK);  // (CPY, CPY_N, CPY_K)
    Tensor tVsV = gmem_thr_copy.partition_D(sV);  // (CPY, CPY_N, CPY_K)
    copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gK), tKsK, tKVcKV, k_rows_left, params.head_dim);
    copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gV), tVsV, tKVcKV, k_rows_left, params.head_dim);
    if (m_block_begin < m_block_end) { load_q_do(m_block_begin, 0); }
    cp_async_fence();

    for (int m_block = m_block_begin; m_block < m_block_end; ++m_block) {
        const int stage = (m_block - m_block_begin) & 1;
        const int q_rows_left = binfo.seqlen_q - m_block * kBlockM;
        cp_async_wait<0>();
        // cp.async writes are generic-proxy stores; wgmma reads shared memory through the async proxy.
        cutlass::arch::fence_view_async_shared();
        __syncthreads();  // this block's Q, dO, LSE and D have landed; every warpgroup is done with dS^T and the other stage
        if (m_block + 1 < m_block_end) {
            load_q_do(m_block + 1, stage ^ 1);
            cp_async_fence();
        }

        Tensor sQ = smem(q_base + stage * kQElems, typename Traits::SmemLayoutQ{});     // (kBlockM, kHeadDim)
        Tensor sdO = smem(do_base + stage * kQElems, typename Traits::SmemLayoutQ{});   // (kBlockM, kHeadDim)
        Tensor sQt = smem(q_base + stage * kQElems, typename Traits::SmemLayoutQt{});   // (kHeadDim, kBlockM)
        Tensor sdOt = smem(do_base + stage * kQElems, typename Traits::SmemLayoutQt{});  // (kHeadDim, kBlockM)

        Tensor acc_st = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});   // (MMA, MMA_N, MMA_M)
        Tensor acc_dpt = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA, MMA_N, MMA_M)
        Tensor tSrQ = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sQ));     // (MMA, MMA_M, MMA_K)
        Tensor tSrdO = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sdO));   // (MMA, MMA_M, MMA_K)
        warpgroup_gemm</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ, acc_st);
        warpgroup_gemm</*kZeroInit=*/true>(mma_sdp, tSrV, tSrdO, acc_dpt);

        // P^T = exp2(s * scale - lse) and dS^T = P^T (dP^T - D), per (key row, query column). Query rows past
        // seqlen_q get lse = +inf, so P = 0 there; keys past seqlen_k are zero rows of K and V whose dK and
        // dV are never stored, and they add nothing to dQ.
        Tensor st = gmma_as_rowcol(acc_st);    // (key rows, query cols)
        Tensor dpt = gmma_as_rowcol(acc_dpt);  // (key rows, query cols)
        const bool causal_tile = kCausal && (n_block + 1) * kBlockN - 1 > m_block * kBlockM + causal_offset;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(st); ++c) {
            const int col = get<1>(tStcSt_rc(0, c));
            const float lse_log2 = col < q_rows_left ? s_lse[stage * kBlockM + col] * float(M_LOG2E) : INFINITY;
            const float dsum = s_dsum[stage * kBlockM + col];
            CUTE_UNROLL
            for (int r = 0; r < size<0>(st); ++r) {
                float p = exp2f(st(r, c) * params.softmax_scale_log2 - lse_log2);
                if (causal_tile && n_block * kBlockN + get<0>(tStcSt_rc(r, c)) >
                                       m_block * kBlockM + col + causal_offset) {
                    p = 0.f;
                }
                st(r, c) = p;
                dpt(r, c) = p * (dpt(r, c) - dsum);  // dS, the gradient of the scaled scores
            }
        }
        Tensor rPt = convert_fragment<Element>(acc_st);
        Tensor rdSt = convert_fragment<Element>(acc_dpt);

        // dS^T to shared memory for the dQ GEMM, whose rows (queries) span both warpgroups' keys.
        CUTE_UNROLL
        for (int i = 0; i < size(rdSt); ++i) { sdSt(get<0>(tStcSt(i)), get<1>(tStcSt(i))) = rdSt(i); }
        cutlass::arch::fence_view_async_shared();

        Tensor tKVrPt = make_tensor(rPt.data(), gmma_acc_as_a_operand_layout(rPt.layout()));     // (MMA, MMA_N, MMA_K)
        Tensor tKVrdSt = make_tensor(rdSt.data(), gmma_acc_as_a_operand_layout(rdSt.layout()));  // (MMA, MMA_N, MMA_K)
        Tensor tKVrdOt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sdOt));  // (MMA, MMA_D, MMA_K)
        Tensor tKVrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sQt));    // (MMA, MMA_D, MMA_K)
        warpgroup_gemm</*kZeroInit=*/false>(mma_dkv, tKVrPt, tKVrdOt, acc_dv);
        warpgroup_gemm</*kZeroInit=*/false>(mma_dkv, tKVrdSt, tKVrQt, acc_dk);

        __syncthreads();  // all of dS^T is in shared memory
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
        warpgroup_gemm</*kZeroInit=*/true>(mma_dq, tQrdS, tQrKt, acc_dq);
        Tensor tdQgdQ = tdQgdQaccum(_, _, _, m_block);
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += 2) { red_add_pair(&tdQgdQ(i), acc_dq(i), acc_dq(i + 1)); }
    }
    cp_async_wait<0>();  // K and V are still in flight when no query block sees this key block.

    // dK picks up the softmax scale here; dQ gets it when its fp32 buffer is converted.
    Tensor tKVcdKV = thr_mma_dkv.partition_C(cKV);
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
