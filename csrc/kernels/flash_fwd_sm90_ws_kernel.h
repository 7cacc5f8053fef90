// The warp-specialized Hopper forward (sm_90a) for dense batches with the plain kernels' masks (none, or causal).
// It is persistent: one CTA per SM walks (query block, sequence, head) tiles in a fixed schedule (WsSchedule),
// so that the loads of a tile's first blocks run under the previous tile's last GEMMs and its output store. Each
// CTA splits its work by role instead of by loop phase:
// - the producer: the first warp of warpgroup 0 issues TMA loads of each tile's Q, and of K and V block by block
//   into kStages buffers each, as soon as the consumers have released a buffer (mbarriers, no CTA-wide barrier);
// - the consumers: kConsumerWarpgroups warpgroups of 64 query rows. Each overlaps its own work: it issues the next
//   block's S = Q K^T together with this block's O += P V, and runs the next block's softmax while P V runs. They
//   also take turns issuing their GEMMs (named barriers in a ring), so that one warpgroup's softmax runs while
//   another's GEMMs hold the tensor cores.
// setmaxnreg gives the producer warpgroup the minimum of registers and the consumers the rest.
// kMod: the kernel's softcap or dropout form, for a call whose one variant that is (PlainMod). kSink: the form for
// calls with a learnable sink, which folds it into each finished row (OnlineSoftmax::fold_row_terms). A form of its
// own rather than a runtime branch: the branch in the epilogue, which sits inside the persistent tile loop, moved
// ptxas's schedule of the main loop (docs/design-notes.md, 'Learnable sinks'), and the plain form keeps its code.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "launch/flash_params.h"
#include "launch/tile_size.h"  // dropout_fits_key_blocks
#include "kernels/dropout.h"
#include "kernels/fwd_tile.h"
#include "kernels/kernel_traits_fwd_sm90.h"
#include "kernels/mask.h"
#include "kernels/score_mod.h"
#include "kernels/softmax.h"
#include "kernels/utils.h"
#include "kernels/utils_sm90.h"
#include "kernels/ws_schedule.h"

namespace flash {

using namespace cute;

// Named barriers of the warp-specialized forward (0 is __syncthreads'): the consumers' turn ring, one per
// consumer warpgroup, then one per consumer warpgroup for its epilogue.
struct FwdWsBarriers {
    static constexpr int kTurn0 = 1;
    template <int kConsumerWarpgroups>
    static constexpr int kEpilogue0 = kTurn0 + kConsumerWarpgroups;
};

template <class Traits, bool kCausal, PlainMod kMod, bool kSink>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdWsParams<Traits> ws) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kSoftcap = kMod == PlainMod::kSoftcap;
    constexpr bool kDropout = kMod == PlainMod::kDropout;
    static_assert(!kDropout || dropout_fits_key_blocks(Traits::kBlockN), "dropout's draws need 32-key-aligned blocks");
    using Element = typename Traits::Element;
    using Barrier = cutlass::arch::ClusterBarrier;
    using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
    using Tile = FwdTile<Traits::kBlockM, Traits::kBlockN, kCausal>;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kHeadDimV = Traits::kHeadDimV;
    constexpr int kStages = Traits::kStages;
    constexpr int kConsumerWarpgroups = Traits::kConsumerWarpgroups;
    const FwdParams& params = ws.base;
    const WsSchedule<kBlockM, kCausal> schedule(params.seqlen_q, params.batch, params.num_heads);

    extern __shared__ __align__(1024) char smem_ws[];
    auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_ws);
    Tensor sQ = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});         // (kBlockM, kHeadDim)
    Tensor sK = make_tensor(make_smem_ptr(storage.k),
                            typename Traits::SmemLayoutKStages{});  // (kBlockN, kHeadDim, kStages)
    Tensor sV = make_tensor(make_smem_ptr(storage.v),
                            typename Traits::SmemLayoutVStages{});  // (kBlockN, kHeadDimV, kStages)
    Tensor sVt = make_tensor(make_smem_ptr(storage.v),
                             typename Traits::SmemLayoutVtStages{});  // (kHeadDimV, kBlockN, kStages)

    const int warp_idx = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);  // uniform, so role branches are too
    const int warpgroup = warp_idx / 4;
    if (threadIdx.x == 0) {
        // One arrival (with the transaction bytes) fills a buffer; each consumer warp's arrival empties one.
        Barrier::init(&storage.q_full, 1);
        Barrier::init(&storage.q_empty, Traits::kConsumerWarps);
        CUTE_UNROLL
        for (int s = 0; s < kStages; ++s) {
            Barrier::init(&storage.k_full[s], 1);
            Barrier::init(&storage.v_full[s], 1);
            Barrier::init(&storage.k_empty[s], Traits::kConsumerWarps);
            Barrier::init(&storage.v_empty[s], Traits::kConsumerWarps);
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    // Both roles walk the same tiles in the same order, and count Q buffers (one per tile) and K/V blocks
    // through their rings from the CTA's start, so the mbarrier phases agree without any other exchange.
    if (warpgroup == 0) {
        // The producer. Key blocks run from the last to the first, as in the other kernels (masked tiles first).
        // K runs one block ahead of V: a consumer needs block n's K for its S while it still multiplies block
        // n + 1's P by V.
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
        if (warp_idx != 0 || !cute::elect_one_sync()) { return; }
        Tensor mQ = ws.tma_q.get_tma_tensor(
            make_shape(params.seqlen_q, params.head_dim, params.num_heads, params.batch));  // (seqlen_q, d, h, b)
        Tensor mK = ws.tma_k.get_tma_tensor(
            make_shape(params.seqlen_k, params.head_dim, params.num_heads_k, params.batch));  // (seqlen_k, d, h_k, b)
        Tensor mV = ws.tma_v.get_tma_tensor(make_shape(params.seqlen_k, params.head_dim_v, params.num_heads_k,
                                                       params.batch));  // (seqlen_k, d_v, h_k, b)
        int tiles_done = 0;  // Q buffers filled
        int kv_blocks = 0;  // K (and V) blocks loaded
        for (int unit = int(blockIdx.x); unit < schedule.units; unit += int(gridDim.x)) {
            for (int part = 0; part < schedule.tiles_in(unit); ++part) {
                const auto coord = schedule.tile(unit, part, params.batch);
                const Tile tile(params, coord.block, coord.batch, coord.head);
                Tensor gQ = local_tile(mQ(_, _, tile.head_idx, tile.batch_idx), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                       make_coord(tile.m_block, 0));  // (kBlockM, kHeadDim)
                Tensor gK = local_tile(mK(_, _, tile.head_idx_k, tile.batch_idx), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                       make_coord(_, 0));  // (kBlockN, kHeadDim, n)
                Tensor gV = local_tile(mV(_, _, tile.head_idx_k, tile.batch_idx), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                                       make_coord(_, 0));  // (kBlockN, kHeadDimV, n)
                auto [tQgQ, tQsQ] = tma_partition(ws.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                                  group_modes<0, 2>(gQ));  // (TMA), (TMA)
                auto [tKgK, tKsK] = tma_partition(ws.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                                  group_modes<0, 2>(gK));  // (TMA, n), (TMA, kStages)
                auto [tVgV, tVsV] = tma_partition(ws.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                                  group_modes<0, 2>(gV));  // (TMA, n), (TMA, kStages)

                // The i-th block visited is n_block_end - 1 - i; a buffer is refilled once every consumer warp
                // released it (parity ^ 1: the first round finds every buffer free).
                const int n_block_end = tile.n_block_end();
                auto load = [&](auto& tma, auto& tXgX, auto& tXsX, uint64_t* full, uint64_t* empty, int bytes, int i) {
                    const RingSlot<kStages> slot(kv_blocks + i);
                    Barrier::wait(&empty[slot.stage], slot.phase ^ 1u);
                    TxBarrier::arrive_and_expect_tx(&full[slot.stage], bytes);
                    copy(tma.with(full[slot.stage]), tXgX(_, n_block_end - 1 - i), tXsX(_, slot.stage));
                };
                const int blocks = n_block_end - tile.n_block_begin();
                // The first K block before Q: where the output stages in Q's buffer, Q waits for the previous
                // tile's store, and K need not.
                if (blocks > 0) {
                    load(ws.tma_k, tKgK, tKsK, storage.k_full, storage.k_empty, Traits::kKStageBytes, 0);
                }
                // Q has one buffer, refilled once every consumer warp released the previous tile's.
                Barrier::wait(&storage.q_empty, (uint32_t(tiles_done) & 1u) ^ 1u);
                TxBarrier::arrive_and_expect_tx(&storage.q_full, Traits::kQBytes);
                copy(ws.tma_q.with(storage.q_full), tQgQ, tQsQ);
                ++tiles_done;
                for (int i = 0; i < blocks; ++i) {
                    if (i + 1 < blocks) {
                        load(ws.tma_k, tKgK, tKsK, storage.k_full, storage.k_empty, Traits::kKStageBytes, i + 1);
                    }
                    load(ws.tma_v, tVgV, tVsV, storage.v_full, storage.v_empty, Traits::kVStageBytes, i);
                }
                kv_blocks += max(blocks, 0);
            }
        }
        return;
    }

    // The consumers.
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int ctidx = int(threadIdx.x) - 128;  // among the consumers
    const int cwg = warpgroup - 1;  // consumer warpgroup: query rows [64 cwg, 64 cwg + 64) of the tile
    const bool releases = ctidx % 32 == 0;  // one arrival per warp on the empty barriers
    const int epilogue_barrier = FwdWsBarriers::kEpilogue0<kConsumerWarpgroups> + cwg;

    typename Traits::TiledMmaS mma_s;
    auto thr_mma_s = mma_s.get_thread_slice(ctidx);
    typename Traits::TiledMmaO mma_o;
    auto thr_mma_o = mma_o.get_thread_slice(ctidx);
    Tensor tSrQ = thr_mma_s.make_fragment_A(thr_mma_s.partition_A(sQ));  // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma_s.make_fragment_B(thr_mma_s.partition_B(sK));  // (MMA, MMA_N, MMA_K, kStages)
    Tensor tOrVt = thr_mma_o.make_fragment_B(thr_mma_o.partition_B(sVt));  // (MMA, MMA_N, MMA_K, kStages)
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (MMA, MMA_M, MMA_N)
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
    Tensor rP = make_tensor<Element>(acc_s.layout());  // (MMA, MMA_M, MMA_N)
    Tensor tOrP = make_tensor(rP.data(), gmma_acc_as_a_operand_layout(rP.layout()));  // (MMA, MMA_M, MMA_K)
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (kBlockM, kBlockN)
    Tensor tScS = thr_mma_s.partition_C(cS);  // (MMA, MMA_M, MMA_N)
    Tensor tScS_rc = make_tensor(tScS.data(), gmma_acc_rowcol_layout(tScS.layout()));  // (rows, cols)
    Tensor scores = gmma_as_rowcol(acc_s);  // (rows, kBlockN cols)
    Tensor acc_o_rc = gmma_as_rowcol(acc_o);  // (rows, kHeadDimV cols)
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (kBlockM, kHeadDimV)

    // The turn ring: a warpgroup issues its GEMMs after the previous one in the ring has issued its own. The last
    // warpgroup opens the first turn. Every warpgroup takes the same number of turns per tile, so the ring runs on
    // from one tile to the next.
    constexpr int kTurnThreads = 256;  // one warpgroup arrives, the next one waits
    const int my_turn = FwdWsBarriers::kTurn0 + cwg;
    const int next_turn = FwdWsBarriers::kTurn0 + (cwg + 1) % kConsumerWarpgroups;
    if (cwg == kConsumerWarpgroups - 1) { named_barrier_arrive(FwdWsBarriers::kTurn0, kTurnThreads); }

    int tiles_done = 0;  // Q buffers consumed
    int kv_blocks = 0;  // K (and V) blocks consumed
    auto wait_full = [&](uint64_t* full, int i) {
        const RingSlot<kStages> slot(kv_blocks + i);
        Barrier::wait(&full[slot.stage], slot.phase);
        return slot.stage;
    };
    auto release = [&](uint64_t* empty, int i) {
        if (releases) { Barrier::arrive(&empty[RingSlot<kStages>(kv_blocks + i).stage]); }
    };
    auto release_q = [&] {
        if (releases) { Barrier::arrive(&storage.q_empty); }
    };
    // P into the registers P V reads, by whole 32-bit registers (two probabilities each): an element-wise copy of
    // the 16-bit values compiled to byte permutes and masks, about 150 integer instructions a step at head dim 128.
    auto convert_p = [&] {
        Tensor converted = convert_fragment<Element>(acc_s);
        Tensor from = recast<uint32_t>(converted);
        Tensor to = recast<uint32_t>(rP);
        warpgroup_fence_operand(rP);
        CUTE_UNROLL
        for (int i = 0; i < size(to); ++i) { to(i) = from(i); }
        warpgroup_fence_operand(rP);
    };

    for (int unit = int(blockIdx.x); unit < schedule.units; unit += int(gridDim.x)) {
        for (int part = 0; part < schedule.tiles_in(unit); ++part) {
            const auto coord = schedule.tile(unit, part, params.batch);
            const Tile tile(params, coord.block, coord.batch, coord.head);
            const int n_block_end = tile.n_block_end();
            const int blocks = n_block_end - tile.n_block_begin();
            OnlineSoftmax<decltype(size<0>(acc_o_rc))::value> softmax(params.softmax_scale_log2);
            const Dropout dropout(params, tile.batch_idx, tile.head_idx);
            // Dropout on the probabilities of the i-th block visited, after the exps (whose row sums are the
            // undropped softmax's, the LSE's) and before the previous block's P V completes, which the draw runs
            // under.
            auto drop = [&](int i) {
                if constexpr (kDropout) {
                    dropout.template apply</*kQueryIsRow=*/true, /*kNegate=*/false>(
                        scores, tScS_rc, tile.m_block * kBlockM, (n_block_end - 1 - i) * kBlockN);
                }
            };
            auto tile_mask = [&](int n_block) {
                return TileMask<kBlockM, kBlockN, kCausal>(tile.bounds, tile.m_block, n_block);
            };
            clear(acc_o);

            Barrier::wait(&storage.q_full, uint32_t(tiles_done) & 1u);
            if (blocks > 0) {
                const int stage = wait_full(storage.k_full, 0);
                named_barrier_sync(my_turn, kTurnThreads);
                warpgroup_gemm_issue</*kZeroInit=*/true>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
                named_barrier_arrive(next_turn, kTurnThreads);
                warpgroup_wait_for<0>(acc_s);
                release(storage.k_empty, 0);
                if (Traits::kSeparateO && blocks == 1) { release_q(); }
                if constexpr (kSoftcap) { apply_softcap(scores, params.softcap_prescale); }
                if (const auto mask = tile_mask(n_block_end - 1); mask.needs_mask()) {
                    mask.template apply</*kQueryIsRow=*/true>(scores, tScS_rc);
                }
                softmax.exp_scores(scores);
                drop(0);
                convert_p();
                // One step: the S GEMM of the i-th block visited with the P V of the one before, then the i-th
                // block's softmax while that P V runs. Masked and unmasked steps are compiled apart, so that no
                // branch joins between the two waits: ptxas placed the P V wait at such a join, above the softmax,
                // which then no longer overlapped the P V.
                auto step = [&](int i, auto masked) {
                    const int k_stage = wait_full(storage.k_full, i);
                    named_barrier_sync(my_turn, kTurnThreads);
                    warpgroup_gemm_issue</*kZeroInit=*/true>(mma_s, tSrQ, tSrK(_, _, _, k_stage), acc_s);
                    const int v_stage = wait_full(storage.v_full, i - 1);
                    warpgroup_gemm_issue</*kZeroInit=*/false>(mma_o, tOrP, tOrVt(_, _, _, v_stage), acc_o);
                    named_barrier_arrive(next_turn, kTurnThreads);
                    warpgroup_wait_for<1>(acc_s);  // S done; P V may still run
                    release(storage.k_empty, i);
                    if (Traits::kSeparateO && i == blocks - 1) { release_q(); }  // the tile's last read of Q
                    if constexpr (kSoftcap) { apply_softcap(scores, params.softcap_prescale); }
                    if constexpr (decltype(masked)::value) {
                        tile_mask(n_block_end - 1 - i).template apply</*kQueryIsRow=*/true>(scores, tScS_rc);
                    }
                    Tensor correction = softmax.exp_scores(scores);
                    drop(i);
                    warpgroup_wait_for<0>(acc_o);
                    release(storage.v_empty, i - 1);
                    softmax.rescale(acc_o_rc, correction);
                    convert_p();
                };
                for (int i = 1; i < blocks; ++i) {
                    if (tile_mask(n_block_end - 1 - i).needs_mask()) {
                        step(i, std::true_type{});
                    } else {
                        step(i, std::false_type{});
                    }
                }
                const int v_stage = wait_full(storage.v_full, blocks - 1);
                named_barrier_sync(my_turn, kTurnThreads);
                warpgroup_gemm_issue</*kZeroInit=*/false>(mma_o, tOrP, tOrVt(_, _, _, v_stage), acc_o);
                named_barrier_arrive(next_turn, kTurnThreads);
                warpgroup_wait_for<0>(acc_o);
                release(storage.v_empty, blocks - 1);
            } else if (Traits::kSeparateO) {
                release_q();
            }
            kv_blocks += max(blocks, 0);
            ++tiles_done;

            // Epilogue: this warpgroup's output rows stage in its own rows of sO and leave with 16 B stores,
            // without waiting for the other warpgroups. Where sO is Q's buffer, this warpgroup's S GEMMs, its only
            // readers of those rows, are complete, and Q's buffer is released after the store has read them.
            Tensor lse = softmax.finalize(acc_o_rc, kSoftcap ? params.score_scale : params.softmax_scale,
                                          kDropout ? params.dropout_keep_scale : 1.f);
            if constexpr (kSink) {
                // No key splits and no GQA packing here (plan_fwd): every row is the tile's own head.
                softmax.fold_row_terms(acc_o_rc, lse, LearnableSink{params.learnable_sink_ptr},
                                       [&](int) { return tile.head_idx; });
            }
            Tensor rO = convert_fragment<Element>(acc_o);
            // The epilogue's addresses derive from a thread index and a buffer offset the compiler cannot see
            // through, so they are computed here each tile: hoisted out of the tile loop, they stayed live through
            // the main loop and spilled.
            const int o_offset = opaque_int(0);
            const int etidx = opaque_int(ctidx);
            Tensor sO = make_tensor(make_smem_ptr(Traits::o_smem(storage) + o_offset),
                                    typename Traits::SmemLayoutO{});  // (kBlockM, kHeadDimV)
            Tensor tOcO = mma_o.get_thread_slice(etidx).partition_C(cO);  // (MMA, MMA_M, MMA_N), acc_o's positions
            Tensor tOcO_rc = make_tensor(tOcO.data(), gmma_acc_rowcol_layout(tOcO.layout()));  // (rows, cols)
            if constexpr (Traits::kSeparateO) {
                named_barrier_sync(epilogue_barrier, 128);  // the previous tile's store has read these rows
            }
            store_fragment_to_smem(mma_o, etidx, rO, sO);
            tile.write_lse(params, lse, tOcO_rc);
            named_barrier_sync(epilogue_barrier, 128);
            tile.template store_o_rows<typename Traits::GmemTiledCopyO, 64>(params, sO, cwg, etidx % 128);
            if constexpr (!Traits::kSeparateO) { release_q(); }
        }
    }
#endif
}

}  // namespace flash
