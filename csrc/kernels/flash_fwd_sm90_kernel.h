// FlashAttention-2 forward kernel for Hopper (sm_90a): the schedule of flash_fwd_kernel.h with both
// GEMMs on warpgroup MMAs (wgmma), which read K and V straight from shared memory instead of through
// per-warp ldmatrix copies. One CTA computes one (query block, sequence, head) tile (or, split-KV, its
// share of the keys); each warpgroup owns 64 query rows (split-Q), so warpgroups never exchange partial
// results. K and V come in Traits::kStagesKV stages: later key blocks load during the whole current step.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "launch/flash_params.h"
#include "kernels/fwd_tile.h"
#include "kernels/kernel_traits_fwd_sm90.h"
#include "kernels/mask.h"
#include "kernels/dropout.h"
#include "kernels/score_mod.h"
#include "kernels/softmax.h"
#include "kernels/utils.h"
#include "kernels/utils_sm90.h"

namespace flash {

using namespace cute;

// kVariants: as in flash_fwd_kernel.h.
template <class Traits, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kCtasPerSm)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    const int tidx = threadIdx.x;

    const FwdTile<kBlockM, kBlockN, kCausal, kVariants> tile(params);
    if (!tile.has_rows()) { return; }
    const int m_block = tile.m_block;
    const BlockInfo& binfo = tile.binfo;
    const auto& bounds = tile.bounds;
    const ScoreMod<Element> score_mod(params, tile.batch_idx, binfo);
    const Dropout dropout(params, tile.batch_idx, tile.head_idx);
    const int n_block_begin = tile.n_block_begin();
    const int n_block_end = tile.n_block_end();

    const auto gQKV = tile.template gmem_qkv<Element, kHeadDim>(params);
    Tensor gQ = get<0>(gQKV);  // (kBlockM, kHeadDim)
    Tensor gK = get<1>(gQKV);  // (kBlockN, kHeadDim, n)
    Tensor gV = get<2>(gQKV);  // (kBlockN, kHeadDim, n)

    extern __shared__ __align__(1024) char smem_sm90[];  // 128 B swizzle atoms repeat every 1 KiB
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_sm90)),
                            typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
    Element* kv_base = raw_pointer_cast(sQ.data()) + Traits::kSmemQElems;
    // Stage s (of Traits::kStagesKV) holds K at kv_base + 2s * kv and V right after it.
    auto sK_stage = [&](int s) {
        return make_tensor(make_smem_ptr(kv_base + 2 * s * Traits::kSmemKVElems),
                           typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    };
    auto sV_stage = [&](int s) {
        return make_tensor(make_smem_ptr(kv_base + (2 * s + 1) * Traits::kSmemKVElems),
                           typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    };
    auto sVt_stage = [&](int s) {
        return make_tensor(make_smem_ptr(kv_base + (2 * s + 1) * Traits::kSmemKVElems),
                           typename Traits::SmemLayoutVt{});  // (kHeadDim, kBlockN)
    };

    Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (kBlockM, kHeadDim)
    Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (kBlockN, kHeadDim)
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});    // (kBlockM, kBlockN)

    typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
    auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr_copy.partition_S(gQ);     // (CPY, CPY_M, CPY_K)
    Tensor tQsQ = gmem_thr_copy.partition_D(sQ);     // (CPY, CPY_M, CPY_K)
    Tensor tQcQ = gmem_thr_copy.partition_S(cQ);     // (CPY, CPY_M, CPY_K)
    Tensor tKgK = gmem_thr_copy.partition_S(gK);     // (CPY, CPY_N, CPY_K, n)
    Tensor tVgV = gmem_thr_copy.partition_S(gV);     // (CPY, CPY_N, CPY_K, n)
    Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);  // (CPY, CPY_N, CPY_K)

    typename Traits::TiledMmaS mma_s;
    auto thr_mma_s = mma_s.get_thread_slice(tidx);
    typename Traits::TiledMmaO mma_o;
    auto thr_mma_o = mma_o.get_thread_slice(tidx);
    // wgmma operands in shared memory are descriptors, one per (stage, k slice).
    Tensor tSrQ = thr_mma_s.make_fragment_A(thr_mma_s.partition_A(sQ));  // (MMA, MMA_M, MMA_K)
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_o);
    Tensor tScS = thr_mma_s.partition_C(cS);                                            // (MMA, MMA_M, MMA_N)
    Tensor tScS_rc = make_tensor(tScS.data(), gmma_acc_rowcol_layout(tScS.layout()));  // (rows, cols)

    const int q_rows_left = tile.q_rows_left();
    auto load_kv = [&](int n_block, int stage) {
        Tensor tKsK = gmem_thr_copy.partition_D(sK_stage(stage));  // (CPY, CPY_N, CPY_K)
        Tensor tVsV = gmem_thr_copy.partition_D(sV_stage(stage));  // (CPY, CPY_N, CPY_K)
        if constexpr (kVariants) {
            if (params.block_table_ptr != nullptr) {
                // Unrolled with one warpgroup: the 128-row tiles spill with it (80 bytes at head dim 128).
                tile.template copy_paged<true, true, Traits::kNWarpgroups == 1>(
                    params, gmem_tiled_copy, tKgK(_, _, _, 0), tKsK, tVsV, tKVcKV, n_block);
                return;
            }
        }
        const int rows_left = binfo.seqlen_k - n_block * kBlockN;
        copy_zfill(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV, rows_left, params.head_dim);
        copy_zfill(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV, rows_left, params.head_dim);
    };

    // Key blocks run from the last to the first, so the tiles that need masking (the sequence end
    // and the causal diagonal) come first.
    // One cp.async group per key block, empty past the first block, so that waiting until kStagesKV - 2
    // groups are pending always means this step's block has landed while the next ones keep streaming.
    constexpr int kStagesKV = Traits::kStagesKV;
    copy_zfill(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, q_rows_left, params.head_dim);
    CUTE_UNROLL
    for (int s = 0; s < kStagesKV - 1; ++s) {
        if (n_block_end - 1 - s >= n_block_begin) { load_kv(n_block_end - 1 - s, s); }
        cp_async_fence();
    }

    Tensor acc_o_rc = gmma_as_rowcol(acc_o);  // (rows, kHeadDim cols)
    OnlineSoftmax<decltype(size<0>(acc_o_rc))::value> softmax(params.softmax_scale_log2);

    // Waits for step n_block's K and V and starts loading the block kStagesKV - 1 steps ahead into the
    // stage every warpgroup finished with in the previous step.
    auto advance_pipeline = [&](int n_block, int stage) {
        cp_async_wait<kStagesKV - 2>();
        // cp.async writes are generic-proxy stores; wgmma reads shared memory through the async proxy.
        cutlass::arch::fence_view_async_shared();
        __syncthreads();  // this step's K and V have landed, and every warpgroup is done with the stage refilled next
        const int refill_stage = stage == 0 ? kStagesKV - 1 : stage - 1;
        if (n_block - (kStagesKV - 1) >= n_block_begin) { load_kv(n_block - (kStagesKV - 1), refill_stage); }
        cp_async_fence();
    };
    auto next_stage = [](int stage) { return stage + 1 == kStagesKV ? 0 : stage + 1; };

    // A warpgroup runs only the key blocks its own 64 query rows see; for the others it just loads its share of
    // K and V and meets the barriers. That skips every block for a warpgroup whose rows all lie past the
    // sequence end (decoding and other short queries fill one warpgroup at most), and, causal, the blocks
    // right of its part of the diagonal, which come first. Decided once, outside the loops: a branch inside
    // the main loop changed its register allocation and cost the anchor shapes 3-6%.
    // A window's left edge likewise ends a warpgroup's own blocks above n_block_begin.
    const int wg_row0 = tidx / 128 * 64;
    const bool wg_has_rows = wg_row0 < q_rows_left;
    const int n_block_end_wg = wg_has_rows
                                   ? min(n_block_end, bounds.n_block_end_for_rows(m_block * kBlockM + wg_row0 + 63))
                                   : n_block_begin;
    const int n_block_begin_wg = kVariants && wg_has_rows
                                     ? max(n_block_begin, bounds.n_block_begin_for_rows(m_block * kBlockM + wg_row0))
                                     : n_block_begin;
    int n_block = n_block_end - 1;
    int stage = 0;
    for (; n_block >= n_block_end_wg; --n_block, stage = next_stage(stage)) { advance_pipeline(n_block, stage); }
    for (; n_block >= n_block_begin_wg; --n_block, stage = next_stage(stage)) {
        advance_pipeline(n_block, stage);

        Tensor tSrK = thr_mma_s.make_fragment_B(thr_mma_s.partition_B(sK_stage(stage)));  // (MMA, MMA_N, MMA_K)
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        warpgroup_gemm</*kZeroInit=*/true>(mma_s, tSrQ, tSrK, acc_s);

        Tensor scores = gmma_as_rowcol(acc_s);  // (rows, kBlockN cols)
        if constexpr (kVariants) {
            apply_score_mod</*kQueryIsRow=*/true>(score_mod, scores, tScS_rc,
                                                  {m_block * kBlockM, n_block * kBlockN, tile.head_idx});
        }
        const TileMask<kBlockM, kBlockN, kCausal, kVariants> mask(bounds, m_block, n_block);
        if (mask.needs_mask()) { mask.template apply</*kQueryIsRow=*/true>(scores, tScS_rc); }
        softmax.update(scores, acc_o_rc);
        // Dropout after the row sums, which are those of the undropped softmax (the LSE's). On float32 P: on the
        // converted pairs (Dropout::apply_converted) the dropout forward ran 4-5% faster, but the softcap forward
        // 1-5% slower (docs/design-notes.md).
        if (kVariants && dropout.active()) {
            dropout.template apply</*kQueryIsRow=*/true, /*kNegate=*/false>(scores, tScS_rc, m_block * kBlockM,
                                                                            n_block * kBlockN);
        }

        Tensor rP = convert_fragment<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), gmma_acc_as_a_operand_layout(rP.layout()));  // (MMA, MMA_M, MMA_K)
        Tensor tOrVt = thr_mma_o.make_fragment_B(thr_mma_o.partition_B(sVt_stage(stage)));  // (MMA, MMA_N, MMA_K)
        warpgroup_gemm</*kZeroInit=*/false>(mma_o, tOrP, tOrVt, acc_o);
    }
    if constexpr (kVariants) {
        for (; n_block >= n_block_begin; --n_block, stage = next_stage(stage)) { advance_pipeline(n_block, stage); }
    }

    // Epilogue: normalize once, stage O through shared memory (Q's buffer) for 16 B global stores; a
    // split-KV CTA writes its fp32 partials instead.
    Tensor lse = kVariants ? softmax.finalize(acc_o_rc, params.score_scale, params.dropout_keep_scale)
                           : softmax.finalize(acc_o_rc, params.softmax_scale, 1.f);
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (kBlockM, kHeadDim)
    Tensor tOcO = thr_mma_o.partition_C(cO);  // (MMA, MMA_M, MMA_N), positions of acc_o's values
    Tensor tOcO_rc = make_tensor(tOcO.data(), gmma_acc_rowcol_layout(tOcO.layout()));  // (rows, cols)
    tile.fold_row_mod(params, acc_o_rc, lse, tOcO_rc);
    Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});  // (kBlockM, kHeadDim)
    tile.template epilogue<typename Traits::GmemTiledCopyO>(params, acc_o_rc, tOcO_rc, lse, sO, [&] {
        store_fragment_to_smem(mma_o, tidx, convert_fragment<Element>(acc_o), sO);
    }, tidx);
#endif
}

}  // namespace flash
