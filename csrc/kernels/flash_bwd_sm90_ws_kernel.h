// The warp-specialized Hopper backward (sm_90a) for the plain kernels' masks (none, or causal), head dims 64 and 128,
// dense or variable-length batches. It computes what the narrow kernel of flash_bwd_sm90_kernel.h computes, with that
// kernel's tile, MMAs and step (S^T and dP^T, P^T and dS^T in the A-operand registers of dV and dK, dS^T through shared
// memory for dQ), but splits the CTA's work by role:
// - the producer warpgroup: its first warp loads K and V once per tile and Q and dO once per step with TMA; its
//   second loads each step's LSE and D rows with cp.async; its third adds each step's dQ tile into dq_accum with
//   one bulk reduction. They run ahead of the consumers through mbarriers (full, empty) per buffer, so nothing in
//   the main loop waits for a load that could have been issued earlier, and no consumer issues a copy;
// - two consumer warpgroups of 64 keys each, which only compute, with one named barrier a step (dS^T complete).
// It is persistent: one CTA per SM walks key-block tiles of (sequence, head or GQA group) in a fixed schedule
// (WsSchedule; under a causal mask, key blocks j and n - 1 - j form one unit, whose steps sum to about the same for
// every j). setmaxnreg gives the producer warpgroup the minimum of registers and the consumers the rest.
// With GQA a tile walks every query head of its key/value head where the plan walks groups (BwdParams::heads_per_cta),
// or writes fp32 dK/dV slices per query head (BwdParams::dkv_fp32).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "kernels/block.h"
#include "kernels/block_info.h"
#include "kernels/bwd_p_ds.h"
#include "kernels/dq_turns.h"
#include "kernels/flash_bwd_sm90_kernel.h"  // BwdStep
#include "kernels/global_ops.h"
#include "kernels/kernel_traits_bwd_sm90.h"
#include "kernels/mask.h"
#include "kernels/score_mod.h"
#include "kernels/utils.h"
#include "kernels/utils_sm90.h"
#include "kernels/ws_schedule.h"
#include "launch/flash_params.h"

namespace flash {

using namespace cute;

// Named barriers of the warp-specialized backward (0 is __syncthreads'), each among the consumer threads only.
struct BwdWsBarriers {
    static constexpr int kDsComplete = 1;  // every consumer's part of the step's dS^T is in shared memory
    static constexpr int kEpilogue = 2;  // the tile's dK/dV staging in K's and V's buffers
};

// One tile of the walk: key block n_block of one sequence and one dK/dV head (a query head, or with a GQA walk a
// key/value head whose query heads it visits in turn), and the steps that see it: (query head, query block) pairs,
// heads outer, query blocks inner, as in BwdSm90Block. Every role builds the same tiles from the same schedule.
template <int kBlockM, int kBlockN, bool kCausal>
struct BwdWsTile {
    int n_block;
    int batch_idx;
    int dkv_head;
    int first_head;  // query heads [first_head, first_head + heads_per_cta)
    int heads_per_cta;
    int head_idx_k;
    BlockInfo binfo;
    BlockBounds<kBlockM, kBlockN, kCausal> bounds;
    int m_block_begin;
    int m_block_end;
    int steps;

    template <class Coord>
    __forceinline__ __device__ BwdWsTile(const BwdParams& params, const Coord& coord)
        : n_block(coord.block),
          batch_idx(coord.batch),
          dkv_head(coord.head),
          first_head(coord.head * params.heads_per_cta),
          heads_per_cta(params.heads_per_cta),
          head_idx_k(coord.head * params.heads_per_cta / (params.num_heads / params.num_heads_k)),
          binfo(params, coord.batch),
          bounds(BlockBounds<kBlockM, kBlockN, kCausal>::of_sequence(params, binfo)),
          m_block_begin(bounds.m_block_begin(coord.block)),
          m_block_end(bounds.m_block_end(coord.block)),
          steps(heads_per_cta * max(m_block_end - m_block_begin, 0)) {}

    __forceinline__ __device__ BwdStep first_step() const { return {0, first_head, m_block_begin}; }
    // By a compare and a select, as BwdSm90Block::next_step.
    __forceinline__ __device__ BwdStep next_step(const BwdStep& step) const {
        const bool wrap = step.m_block + 1 == m_block_end;
        return {step.number + 1, step.head + int(wrap), wrap ? m_block_begin : step.m_block + 1};
    }
    template <class F>
    __forceinline__ __device__ void for_each_step(const F& f) const {
        for (BwdStep step = first_step(); step.number < steps; step = next_step(step)) { f(step); }
    }
    __forceinline__ __device__ int k_rows_left() const { return binfo.seqlen_k - n_block * kBlockN; }
    // Deterministic mode (dq_turns.h): the position of this key block among those that see query block m_block in
    // the order they add their dQ there, which follows the order they reach it in. Without a mask, from the first
    // key block. Under a causal mask key blocks pair up (WsSchedule), and of a round's units the first blocks
    // walked, [first_high, blocks), are the late ones, reaching a query block one after another from the last:
    // they add first, from the last, and then the others from the first. A wait ends as long as every unit of
    // the (sequence, head) runs in the same round (the launcher's grid keeps heads whole where it needs to), or
    // each waits only for lower units (no mask).
    __forceinline__ __device__ int dq_turn(int m_block, int first_high) const {
        if constexpr (!kCausal) {
            return n_block;
        } else {
            const int end = bounds.n_block_end(m_block);
            return n_block >= first_high ? end - 1 - n_block : max(end - first_high, 0) + n_block;
        }
    }
    // False for a key block past its sequence's keys (variable-length grids are sized by the longest) or seen by no
    // query (a sequence without queries): every role skips it, and its dK and dV stay the zeros the host wrote.
    __forceinline__ __device__ bool has_work() const { return steps > 0 && k_rows_left() > 0; }
};

// Block `block` of kRows rows of head `head` of sequence `batch`, whose rows start at row first_row of its (seqlen,
// head_dim, heads, batch) TMA view mX (variable-length batches: one batch of all sequences' rows), into the
// shared-memory tile of SmemLayout at smem, its bytes counted on the mbarrier `full`.
template <int kRows, int kHeadDim, class Tma, class View, class Element, class SmemLayout>
__forceinline__ __device__ void tma_load_block(const Tma& tma, const View& mX, int head, int batch, int first_row,
                                               int block, Element* smem, SmemLayout layout, uint64_t& full) {
    Tensor sX = make_tensor(make_smem_ptr(smem), layout);  // (kRows, kHeadDim)
    Tensor mXs = domain_offset(make_coord(first_row, 0), mX(_, _, head, batch));  // (seqlen, head_dim) from first_row
    Tensor gX = local_tile(mXs, Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(block, 0));  // (kRows, kHeadDim)
    auto [tXgX, tXsX] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                      group_modes<0, 2>(gX));  // (TMA), (TMA)
    copy(tma.with(full), tXgX, tXsX);
}

template <class Traits, bool kCausal, bool kVarlen>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_ws_kernel(const __grid_constant__ BwdWsParams<Traits> ws) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    using Barrier = cutlass::arch::ClusterBarrier;
    using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
    using Tile = BwdWsTile<Traits::kBlockM, Traits::kBlockN, kCausal>;
    using QSlot = RingSlot<Traits::kStagesQ>;
    using DqSlot = RingSlot<2>;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    const BwdParams& params = ws.base;
    const WsSchedule<kBlockN, kCausal> schedule(params.seqlen_k, params.batch, params.num_heads / params.heads_per_cta);

    extern __shared__ __align__(1024) char smem_bwd_ws[];
    auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bwd_ws);

    const int warp_idx = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);  // uniform, so role branches are too
    const int warpgroup = warp_idx / 4;
    if (threadIdx.x == 0) {
        Barrier::init(&storage.kv_full, 1);  // the TMA thread's arrival, with the transaction bytes
        Barrier::init(&storage.kv_empty, Traits::kConsumerWarps);
        CUTE_UNROLL
        for (int s = 0; s < Traits::kStagesQ; ++s) {
            // The TMA thread's arrival, and one per lane of the LSE/D warp when its copies land (cp.async's noinc
            // arrival counts against the expected count).
            Barrier::init(&storage.q_full[s], 1 + 32);
            Barrier::init(&storage.q_empty[s], Traits::kConsumerWarps);
        }
        CUTE_UNROLL
        for (int t = 0; t < 2; ++t) {
            Barrier::init(&storage.dq_full[t], Traits::kConsumerWarps);
            Barrier::init(&storage.dq_empty[t], 1);
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    // Every role walks the same tiles in the same order and counts steps (Q stages, dQ tiles) and tiles (K/V loads)
    // from the CTA's start, so the mbarrier phases agree without any other exchange.
    auto for_each_tile = [&](const auto& f) {
        for (int unit = int(blockIdx.x); unit < schedule.units; unit += int(gridDim.x)) {
            for (int part = 0; part < schedule.tiles_in(unit); ++part) {
                const Tile tile(params, schedule.tile(unit, part, params.batch));
                // A dense tile always has work (the host runs no kernel for a call without queries or keys), and
                // the test cost the dense form 16 bytes of spills at head dim 128, causal.
                if (!kVarlen || tile.has_work()) { f(tile); }
            }
        }
    };
    // kVarlen: the TMA views hold every sequence's rows as one batch, and a sequence starts at its first row there;
    // past a sequence's last query row lie the next one's rows (TileMask::hide_queries_past_end). A form of its own,
    // so that the dense one keeps its code.
    constexpr bool varlen = kVarlen;
    const int view_batches = varlen ? 1 : params.batch;

    if (warpgroup == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
        const int lane = int(threadIdx.x) % 32;
        if (warp_idx == 0) {
            // TMA loads. Out-of-bounds rows and columns read as 0: with zero Q and dO rows (and zero LSE and D) a
            // query row past seqlen_q gives P = 1 and dS = 0, so nothing reaches dV, dK or a stored dQ row; keys
            // past seqlen_k are hidden by the mask.
            if (!cute::elect_one_sync()) { return; }
            const int rows_q = varlen ? params.total_q : params.seqlen_q;
            const int rows_k = varlen ? params.total_k : params.seqlen_k;
            Tensor mQ = ws.tma_q.get_tma_tensor(
                make_shape(rows_q, params.head_dim, params.num_heads, view_batches));  // (rows_q, d, h, b)
            Tensor mdO = ws.tma_do.get_tma_tensor(
                make_shape(rows_q, params.head_dim, params.num_heads, view_batches));  // (rows_q, d, h, b)
            Tensor mK = ws.tma_k.get_tma_tensor(
                make_shape(rows_k, params.head_dim, params.num_heads_k, view_batches));  // (rows_k, d, h_k, b)
            Tensor mV = ws.tma_v.get_tma_tensor(
                make_shape(rows_k, params.head_dim, params.num_heads_k, view_batches));  // (rows_k, d, h_k, b)
            int steps_done = 0;
            int tiles_done = 0;
            for_each_tile([&](const Tile& tile) {
                const int view_batch = varlen ? 0 : tile.batch_idx;
                const int q_start = varlen ? tile.binfo.q_start : 0;  // the dense form's rows start at 0
                const int k_start = varlen ? tile.binfo.k_start : 0;
                auto load_step = [&](const BwdStep& step) {
                    const QSlot slot(steps_done + step.number);
                    uint64_t& full = storage.q_full[slot.stage];
                    Barrier::wait(&storage.q_empty[slot.stage], slot.phase ^ 1u);
                    TxBarrier::arrive_and_expect_tx(&full, 2 * Traits::kQBytes);
                    tma_load_block<kBlockM, kHeadDim>(ws.tma_q, mQ, step.head, view_batch, q_start, step.m_block,
                                                      storage.q[slot.stage], typename Traits::SmemLayoutQ{}, full);
                    tma_load_block<kBlockM, kHeadDim>(ws.tma_do, mdO, step.head, view_batch, q_start, step.m_block,
                                                      storage.d_o[slot.stage], typename Traits::SmemLayoutQ{}, full);
                };
                // The tile's first Q and dO before its K and V: those wait for the previous tile's dK/dV store to
                // leave K's and V's buffers, and the first step's need not.
                if (tile.steps > 0) { load_step(tile.first_step()); }
                Barrier::wait(&storage.kv_empty, (uint32_t(tiles_done) & 1u) ^ 1u);
                TxBarrier::arrive_and_expect_tx(&storage.kv_full, 2 * Traits::kKVBytes);
                tma_load_block<kBlockN, kHeadDim>(ws.tma_k, mK, tile.head_idx_k, view_batch, k_start, tile.n_block,
                                                  storage.k, typename Traits::SmemLayoutKV{}, storage.kv_full);
                tma_load_block<kBlockN, kHeadDim>(ws.tma_v, mV, tile.head_idx_k, view_batch, k_start, tile.n_block,
                                                  storage.v, typename Traits::SmemLayoutKV{}, storage.kv_full);
                tile.for_each_step([&](const BwdStep& step) {
                    if (step.number > 0) { load_step(step); }
                });
                steps_done += tile.steps;
                ++tiles_done;
            });
        } else if (warp_idx == 1) {
            // The LSE and D of each step's rows, zero past seqlen_q; each lane's copies arrive on the stage's full
            // barrier when they land.
            int steps_done = 0;
            for_each_tile([&](const Tile& tile) {
                tile.for_each_step([&](const BwdStep& step) {
                    const QSlot slot(steps_done + step.number);
                    const index_t offset = tile.binfo.lse_offset(params, tile.batch_idx, step.head);
                    const int rows_left = tile.binfo.seqlen_q - step.m_block * kBlockM;
                    Barrier::wait(&storage.q_empty[slot.stage], slot.phase ^ 1u);
                    CUTE_UNROLL
                    for (int i = lane; i < 2 * kBlockM; i += 32) {
                        const int row = i % kBlockM;
                        const bool valid = row < rows_left;
                        const float* src = (i < kBlockM ? params.lse_ptr : params.dsum_ptr) + offset +
                                           (valid ? step.m_block * kBlockM + row : 0);
                        float* dst = (i < kBlockM ? storage.lse[slot.stage] : storage.dsum[slot.stage]) + row;
                        cp_async_f32_zfill(dst, src, valid);
                    }
                    const uint32_t full = cute::cast_smem_ptr_to_uint(&storage.q_full[slot.stage]);
                    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
                });
                steps_done += tile.steps;
            });
            cp_async_wait<0>();  // no copy lands in shared memory after the warp exits
        } else if (warp_idx == 2) {
            // Each step's dQ tile into dq_accum, whole: rows past seqlen_q hold exact zeros, and dq_accum pads each
            // sequence past its last query block. The first key block to reach a query block stores its tile,
            // the others add theirs once that store has landed (dq_turns.h), so no pass zeroes dq_accum before
            // the kernel. The tile's buffer is released once the copy has read it.
            // In deterministic mode it waits for the step's turn (BwdWsTile::dq_turn) before the reduction, and
            // passes the turn of the step before on first, that step's reduction having landed by then: the warp
            // does not wait for the completion of a reduction it just issued, and a CTA's key block runs about a
            // step behind its predecessor. A pass never waits for another CTA: only for this one's consumers.
            if (!cute::elect_one_sync()) { return; }
            const int first_high = schedule.blocks / 2;
            int* last_flag = nullptr;  // deterministic mode: the previous step's flag and turn, not yet passed on
            int last_turn = 0;
            auto pass_last_turn = [&] {
                if (last_flag != nullptr) {
                    bulk_wait<0>();
                    pass_dq_turn(last_flag, last_turn);
                }
            };
            int steps_done = 0;
            for_each_tile([&](const Tile& tile) {
                tile.for_each_step([&](const BwdStep& step) {
                    const DqSlot slot(steps_done + step.number);
                    float* dq_tile = params.dq_accum_ptr + (tile.binfo.dq_accum_row(params, tile.batch_idx, step.head) +
                                                            index_t(step.m_block) * kBlockM) *
                                                               kHeadDim;
                    int* flag = dq_turn_flag<kBlockM>(params, tile.batch_idx, step.head, step.m_block);
                    constexpr int kTileBytes = Traits::kSmemDqTileFloats * int(sizeof(float));
                    Barrier::wait(&storage.dq_full[slot.stage], slot.phase);
                    bool first;
                    if (params.deterministic) {
                        pass_last_turn();
                        last_flag = flag;
                        last_turn = tile.dq_turn(step.m_block, first_high);
                        wait_dq_turn(last_flag, last_turn);
                        first = last_turn == 0;
                    } else {
                        first = dq_arrive_first(flag);
                        if (!first) { wait_dq_stored(flag); }
                    }
                    if (first) {
                        bulk_store(dq_tile, storage.dq[slot.stage], kTileBytes);
                    } else {
                        bulk_reduce_add_f32(dq_tile, storage.dq[slot.stage], kTileBytes);
                    }
                    bulk_commit();
                    if (first && !params.deterministic) {
                        bulk_wait<0>();
                        mark_dq_stored(flag);
                    }
                    bulk_wait_read<0>();
                    Barrier::arrive(&storage.dq_empty[slot.stage]);
                });
                steps_done += tile.steps;
            });
            pass_last_turn();
            bulk_wait<0>();  // the CTA's last reductions complete before it exits
        }
        return;
    }

    // The consumers: the narrow kernel's two warpgroups (64 keys each), thread ctidx of its 256.
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int ctidx = int(threadIdx.x) - 128;
    const bool releases = ctidx % 32 == 0;  // one arrival per warp on the empty barriers

    Tensor sK = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    Tensor sV = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
    Tensor sKt = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKt{});  // (kHeadDim, kBlockN)

    // S^T and dP^T, (kBlockN, kBlockM): A operands K and V, fixed per tile; B operands Q and dO, per stage.
    typename Traits::TiledMmaSdP mma_sdp;
    auto smem_tiled_copy_dst = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);
    // dV and dK, (kBlockN, kHeadDim), held in registers across a tile's steps.
    typename Traits::TiledMmadKV mma_dkv;
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    // dQ = dS K, (kBlockM, kHeadDim) per step.
    typename Traits::TiledMmadQ mma_dq;
    // dK's K steps (query rows, 16 a wgmma) issued before the step's barrier; the rest follow the dQ GEMM, so that
    // the tensor cores have dK's work while the dQ tile is stored (docs/design-notes.md, 'dK's GEMM behind dQ's').
    constexpr int kDkStepsFirst = 0;

    int steps_done = 0;
    int tiles_done = 0;
    for_each_tile([&](const Tile& tile) {
        const ScoreMod<Element> score_mod(params, tile.batch_idx, tile.binfo);
        clear(acc_dk);
        clear(acc_dv);
        auto thr_mma_kv = mma_sdp.get_thread_slice(ctidx);
        Tensor tSrK = thr_mma_kv.make_fragment_A(thr_mma_kv.partition_A(sK));  // (MMA, MMA_N, MMA_K)
        Tensor tSrV = thr_mma_kv.make_fragment_A(thr_mma_kv.partition_A(sV));  // (MMA, MMA_N, MMA_K)
        Barrier::wait(&storage.kv_full, uint32_t(tiles_done) & 1u);
        tile.for_each_step([&](const BwdStep& step) {
            const int loop_tidx = opaque_int(ctidx);
            const QSlot slot(steps_done + step.number);
            const int stage = slot.stage;
            const DqSlot dq_slot(steps_done + step.number);
            Tensor sQ = make_tensor(make_smem_ptr(storage.q[stage]), typename Traits::SmemLayoutQ{});  // (M, d)
            Tensor sdO = make_tensor(make_smem_ptr(storage.d_o[stage]), typename Traits::SmemLayoutQ{});  // (M, d)
            Tensor sQt = make_tensor(make_smem_ptr(storage.q[stage]), typename Traits::SmemLayoutQt{});  // (d, M)
            Tensor sdOt = make_tensor(make_smem_ptr(storage.d_o[stage]), typename Traits::SmemLayoutQt{});  // (d, M)
            Tensor sdSt = make_tensor(make_smem_ptr(storage.dst[dq_slot.stage]),
                                      typename Traits::SmemLayoutdSt{});  // (kBlockN, kBlockM)
            Tensor sdS = make_tensor(make_smem_ptr(storage.dst[dq_slot.stage]),
                                     typename Traits::SmemLayoutdS{});  // (kBlockM, kBlockN)

            Barrier::wait(&storage.q_full[stage], slot.phase);
            const TileMask<kBlockM, kBlockN, kCausal> mask(tile.bounds, step.m_block, tile.n_block);
            auto [rPt, rdSt] = bwd_narrow_step_scores<typename Traits::Base, /*kVariants=*/false, kDkStepsFirst>(
                params, score_mod, mask, tile.batch_idx, step.head, mma_sdp, mma_dkv, smem_tiled_copy_dst, tSrK, tSrV,
                sQ, sdO, sQt, sdOt, storage.lse[stage], storage.dsum[stage], sdSt, acc_dk, acc_dv, loop_tidx, [] {},
                /*hide_queries_past_end=*/varlen);

            // dQ = dS K, whose rows (queries) span both warpgroups' keys. dS^T has two buffers by step parity: a
            // warpgroup that writes this step's passed the previous step's barrier, which the other warpgroup
            // reached only after its dQ GEMM of the step before, the last reader of this buffer.
            named_barrier_sync(BwdWsBarriers::kDsComplete, kConsumerThreads);
            auto thr_mma_dq = mma_dq.get_thread_slice(loop_tidx);
            Tensor tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS));  // (MMA, MMA_M, MMA_K)
            Tensor tQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sKt));  // (MMA, MMA_D, MMA_K)
            Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
            warpgroup_gemm_issue</*kZeroInit=*/true>(mma_dq, tQrdS, tQrKt, acc_dq);
            // The rest of dK's K steps behind dQ's, so that the tensor cores have work while the dQ tile is stored.
            auto thr_mma_dkv = mma_dkv.get_thread_slice(loop_tidx);
            Tensor tKVrdSt = make_tensor(rdSt.data(), gmma_acc_as_a_operand_layout(rdSt.layout()));  // (MMA, N, K)
            Tensor tKVrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sQt));  // (MMA, MMA_D, MMA_K)
            warpgroup_gemm_issue</*kZeroInit=*/false, kDkStepsFirst>(mma_dkv, tKVrdSt, tKVrQt, acc_dk);
            warpgroup_wait_for<1>(acc_dq);  // dQ (and dV, and dK's first steps) complete

            // The dQ tile in fragment order (dq_accum.h), four values a 16 B store, each warp 512 consecutive bytes,
            // for the producer's bulk reduction.
            static_assert(decltype(size(acc_dq))::value * kConsumerThreads == kBlockM * kHeadDim);
            Barrier::wait(&storage.dq_empty[dq_slot.stage], dq_slot.phase ^ 1u);
            float* dq_smem = storage.dq[dq_slot.stage] + loop_tidx * 4;
            CUTE_UNROLL
            for (int g = 0; g < size(acc_dq) / 4; ++g) {
                *reinterpret_cast<float4*>(dq_smem + g * kConsumerThreads * 4) = make_float4(
                    acc_dq(4 * g), acc_dq(4 * g + 1), acc_dq(4 * g + 2), acc_dq(4 * g + 3));
            }
            cutlass::arch::fence_view_async_shared();  // the bulk reduction reads them through the async proxy
            __syncwarp();
            if (releases) { Barrier::arrive(&storage.dq_full[dq_slot.stage]); }
            warpgroup_wait<0>();  // dK's last steps: the step's last reads of Q
            warpgroup_fence_operand(acc_dv);
            warpgroup_fence_operand(acc_dk);
            warpgroup_fence_operand(rPt);
            warpgroup_fence_operand(rdSt);
            if (releases) { Barrier::arrive(&storage.q_empty[stage]); }
        });
        steps_done += tile.steps;
        ++tiles_done;

        // dK (with the softmax scale; dQ gets it in its conversion) and dV. Element outputs stage in K's and V's
        // buffers, free once both warpgroups' GEMMs of the tile are done, and leave with 16 B stores; fp32 slices
        // (GQA without a walk) go straight from the accumulators. Each warp releases the buffers after its last
        // read of them.
        const int etidx = opaque_int(ctidx);
        Tensor cdKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (kBlockN, kHeadDim)
        auto key_block_of = [&](auto view) {  // the tile's (kBlockN, kHeadDim) rows of a dK or dV view
            return local_tile(view, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(tile.n_block, 0));
        };
        if (params.dkv_fp32) {
            auto thr_mma = mma_dkv.get_thread_slice(etidx);
            Tensor tdKVcdKV = thr_mma.partition_C(cdKV);  // (MMA, MMA_N, MMA_D)
            Tensor gdK = key_block_of(
                tile.binfo.template dk_view<float>(params, tile.batch_idx, tile.dkv_head));  // (kBlockN, kHeadDim)
            Tensor gdV = key_block_of(
                tile.binfo.template dv_view<float>(params, tile.batch_idx, tile.dkv_head));  // (kBlockN, kHeadDim)
            store_acc<float>(acc_dk, tdKVcdKV, gdK, tile.k_rows_left(), params.head_dim, params.softmax_scale);
            store_acc<float>(acc_dv, tdKVcdKV, gdV, tile.k_rows_left(), params.head_dim, 1.f);
        } else {
            CUTE_UNROLL
            for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= params.softmax_scale; }
            Tensor rdK = convert_fragment<Element>(acc_dk);
            Tensor rdV = convert_fragment<Element>(acc_dv);
            named_barrier_sync(BwdWsBarriers::kEpilogue, kConsumerThreads);  // no GEMM reads K or V any more
            auto smem_tiled_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
            auto smem_thr_copy = smem_tiled_copy.get_thread_slice(etidx);
            copy(smem_tiled_copy, smem_thr_copy.retile_S(rdK), smem_thr_copy.partition_D(sK));
            copy(smem_tiled_copy, smem_thr_copy.retile_S(rdV), smem_thr_copy.partition_D(sV));
            named_barrier_sync(BwdWsBarriers::kEpilogue, kConsumerThreads);
            typename Traits::GmemTiledCopyStore gmem_tiled_copy;
            auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(etidx);
            Tensor tdKVcdKV = gmem_thr_copy.partition_D(cdKV);  // (CPY, CPY_N, CPY_D)
            Tensor gdK = key_block_of(
                tile.binfo.template dk_view<Element>(params, tile.batch_idx, tile.dkv_head));  // (kBlockN, kHeadDim)
            Tensor gdV = key_block_of(
                tile.binfo.template dv_view<Element>(params, tile.batch_idx, tile.dkv_head));  // (kBlockN, kHeadDim)
            copy_to_gmem(gmem_tiled_copy, gmem_thr_copy.partition_S(sK), gmem_thr_copy.partition_D(gdK), tdKVcdKV,
                         tile.k_rows_left(), params.head_dim);
            copy_to_gmem(gmem_tiled_copy, gmem_thr_copy.partition_S(sV), gmem_thr_copy.partition_D(gdV), tdKVcdKV,
                         tile.k_rows_left(), params.head_dim);
        }
        // The next tile's K and V land through the async proxy where this one's dK/dV was staged.
        cutlass::arch::fence_view_async_shared();
        __syncwarp();
        if (releases) { Barrier::arrive(&storage.kv_empty); }
    });
#endif
}

}  // namespace flash
