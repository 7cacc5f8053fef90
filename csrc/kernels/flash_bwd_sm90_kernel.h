// FlashAttention-2 backward kernels for Hopper (sm_90a) on warpgroup MMAs. The schedule is that of
// flash_bwd_kernel.h: one CTA owns kBlockN keys and walks the query blocks that see them, P is recomputed
// from the LSE, dK and dV stay in registers, and dQ goes to an fp32 buffer by reduction. With GQA/MQA a CTA
// can also walk every query head of its key/value head (BwdParams::heads_per_cta), so dK and dV are summed
// over the group in registers instead of through per-query-head fp32 slices. Two variants:
// - flash_bwd_sm90_kernel (head dims up to 128): each warpgroup owns 64 keys end to end. The score GEMMs
//   are computed transposed (S^T = K Q^T, dP^T = V dO^T), so P^T and dS^T come out already in the
//   A-operand registers of dV += P^T dO and dK += dS^T Q; only dS^T goes through shared memory, for dQ.
// - flash_bwd_sm90_wide_kernel (head dims 160 to 256): dK and dV of 64 keys over the whole head dim
//   do not fit one warpgroup's registers, so the warpgroups split the keys of S and dP, write P and dS to
//   shared memory, and split the head dim of dV, dK and dQ.
// In deterministic mode the wide kernel adds dQ in a fixed order (BwdSm90Block::dq_turn); the narrow one has no such
// mode (the mma.sync kernel, or flash_bwd_sm90_ws_kernel.h, runs there).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/block.h"
#include "kernels/block_info.h"
#include "kernels/bwd_p_ds.h"
#include "kernels/dq_accum.h"
#include "kernels/dq_turns.h"
#include "launch/flash_params.h"
#include "kernels/global_ops.h"
#include "kernels/kernel_traits_bwd_sm90.h"
#include "kernels/mask.h"
#include "kernels/score_mod.h"
#include "kernels/utils.h"
#include "kernels/utils_sm90.h"

namespace flash {

using namespace cute;

// One step of a CTA's walk: its number (from 0, counted over all of the CTA's key blocks), query head and
// query block.
struct BwdStep {
    int number;
    int head;
    int m_block;
};

// What both kernels share: the CTA's key blocks and the query blocks that see each, the shared-memory
// carve-up (Q and dO in kStagesQ stages, K and V, the kernel's scratch tiles, LSE and D per Q stage, then
// with kStagesKV == 2 the second K/V buffer), the loads, the dQ reduction and the dK/dV store. A CTA walks
// key blocks [n_block, n_block_stop) one after another (BwdParams::key_blocks_per_cta, kStagesKV == 2 only);
// the next one's K and V load during the current one's steps, and its first Q and dO during the current one's
// last step.
template <class Traits, bool kCausal, bool kVariants>
struct BwdSm90Block {
    using Element = typename Traits::Element;
    static constexpr int kBlockM = Traits::kBlockM;
    static constexpr int kBlockN = Traits::kBlockN;
    static constexpr int kHeadDim = Traits::kHeadDim;
    static constexpr int kHeadDimV = Traits::kHeadDimV;
    static constexpr int kQElems = Traits::kSmemQElems;
    static constexpr int kdOElems = Traits::kSmemdOElems;
    static_assert(Traits::kNThreads >= 2 * kBlockM, "one thread per LSE and per D value of a query block");
    // Whether key blocks may start their walks at their own query blocks (BwdParams::stagger): the wide kernel's
    // plain non-causal form, where every key block walks the same query blocks. The narrow kernel walks from its
    // first query block, with the code it was measured with.
    static constexpr bool kStaggers = Traits::kDqTurns && !kCausal && !kVariants;

    int n_block;       // the current key block
    int n_block_stop;  // one past the CTA's last key block
    int kv_stage;      // the K/V buffer of the current key block
    int batch_idx;
    int first_head;  // the CTA walks query heads [first_head, first_head + heads_per_cta)
    int heads_per_cta;
    int head_idx_k;
    int dkv_head;    // the dK/dV slice it writes: its query head, or its key/value head when it walks a group
    BlockInfo binfo;
    BlockBounds<kBlockM, kBlockN, kCausal, kVariants> bounds;  // the sequence's block ranges and tile masks
    int m_block_begin;       // the first query block with a row that sees a key of the current block
    int m_block_begin_next;  // the same for the next key block (its first step loads during the current's last)
    int m_block_end;         // one past the last (below the query blocks' end only under a window's left edge)
    // With a stagger (kStaggers, BwdParams::stagger) the key block walks its query blocks from m_block_first to
    // m_block_end - 1, then from m_block_begin, per query head; else m_block_first is m_block_begin.
    int m_block_first;
    bool staggered;
    // Steps [step_begin, step_end) are the current key block's (query head, query block) pairs, heads outer,
    // query blocks inner. A key block has no steps when no query sees it (seqlen_q 0, or a window's edges);
    // a CTA then walks one key block only (the plan keeps key_blocks_per_cta 1 for windows), since a step-less
    // key block starts none of its successor's loads.
    int step_begin;
    int step_end;
    Element* q_base;    // stage s at q_base + s * kQElems
    Element* do_base;   // likewise
    Element* k_base;    // K of K/V stage 0; stage 1's at k_base + kKV1Offset; V right after K in each
    Element* scratch_base;  // Traits::kSmemScratchElems elements
    float* s_lse;           // (kStagesQ, kBlockM)
    float* s_dsum;          // (kStagesQ, kBlockM)
    float* s_dq;            // two dQ tiles of Traits::kSmemDqTileFloats with Traits::kDqThroughSmem (add_dq)

    __forceinline__ __device__ BwdSm90Block(const BwdParams& params, char* smem_raw)
        : n_block(first_key_block(params)),
          kv_stage(0),
          batch_idx(sequence_of_cta(params)),
          first_head(blockIdx.z * params.heads_per_cta),
          heads_per_cta(params.heads_per_cta),
          head_idx_k(first_head / (params.num_heads / params.num_heads_k)),
          dkv_head(blockIdx.z),
          binfo(params, batch_idx),
          bounds(BlockBounds<kBlockM, kBlockN, kCausal, kVariants>::of_sequence(params, binfo)) {
        n_block_stop = Traits::kStagesKV > 1 ? min(n_block + params.key_blocks_per_cta, bounds.n_blocks())
                                             : n_block + 1;
        m_block_end = bounds.m_block_end(n_block);
        m_block_begin = kVariants ? min(bounds.m_block_begin(n_block), m_block_end) : bounds.m_block_begin(n_block);
        m_block_begin_next = bounds.m_block_begin(n_block + 1);
        m_block_first = m_block_begin;
        staggered = false;
        if constexpr (kStaggers) {
            // In deterministic mode only while no key block passes a query block that has not reached it, which
            // the turn order (dq_turn) assumes: at most as many key blocks as query blocks in this sequence.
            const int m_blocks = m_block_end - m_block_begin;
            staggered = params.stagger && m_blocks > 0 && (!params.deterministic || bounds.n_blocks() <= m_blocks);
            if (staggered) { m_block_first = m_block_begin + n_block % m_blocks; }
        }
        step_begin = 0;
        step_end = steps_of(m_block_begin);
        q_base = reinterpret_cast<Element*>(smem_raw);
        do_base = q_base + Traits::kStagesQ * kQElems;
        k_base = do_base + Traits::kStagesQ * kdOElems;
        scratch_base = k_base + Traits::kSmemKVElems + Traits::kSmemVElems;
        s_lse = reinterpret_cast<float*>(scratch_base + Traits::kSmemScratchElems);
        s_dsum = s_lse + Traits::kStagesQ * kBlockM;
        s_dq = reinterpret_cast<float*>(smem_raw + Traits::kSmemBytesOneKV);
    }

    // The CTA's first key block. In deterministic mode under a causal mask grid x runs over the key blocks from the
    // last, the order of their turns (dq_turn).
    __forceinline__ __device__ static int first_key_block(const BwdParams& params) {
        if constexpr (Traits::kDqTurns && kCausal) {
            if (params.deterministic) { return int(gridDim.x) - 1 - int(blockIdx.x); }
        }
        return blockIdx.x * (Traits::kStagesKV > 1 ? params.key_blocks_per_cta : 1);
    }

    // Steps of a key block whose first query block is first_m_block.
    __forceinline__ __device__ int steps_of(int first_m_block) const {
        return heads_per_cta * (m_block_end - first_m_block);
    }

    // False when the first key block starts past this sequence's end (varlen grids are sized by the longest).
    __forceinline__ __device__ bool has_keys() const { return n_block * kBlockN < binfo.seqlen_k; }
    __forceinline__ __device__ int k_rows_left() const { return binfo.seqlen_k - n_block * kBlockN; }
    // Moves to the CTA's next key block, whose loads this one started; false after the last.
    __forceinline__ __device__ bool next_key_block() {
        if (n_block + 1 >= n_block_stop) { return false; }
        ++n_block;
        kv_stage ^= 1;
        if constexpr (kVariants) {
            m_block_end = bounds.m_block_end(n_block);
            m_block_begin = min(m_block_begin_next, m_block_end);
        } else {
            m_block_begin = m_block_begin_next;
        }
        m_block_begin_next = bounds.m_block_begin(n_block + 1);
        step_begin = step_end;
        step_end += steps_of(m_block_begin);
        return true;
    }
    // Steps advance by a compare and a select: a division and a remainder per step cost the backward 2-4%.
    __forceinline__ __device__ BwdStep first_step() const {
        return {step_begin, first_head, kStaggers ? m_block_first : m_block_begin};
    }
    __forceinline__ __device__ BwdStep next_step(const BwdStep& step) const {
        const bool wrap = step.m_block + 1 == m_block_end;
        const int m_block = wrap ? m_block_begin : step.m_block + 1;
        if constexpr (kStaggers) { return {step.number + 1, step.head + int(m_block == m_block_first), m_block}; }
        return {step.number + 1, step.head + int(wrap), m_block};
    }
    // The step before `step` of the same key block.
    __forceinline__ __device__ BwdStep previous_step(const BwdStep& step) const {
        const bool wrap = step.m_block == m_block_begin;
        const int m_block = wrap ? m_block_end - 1 : step.m_block - 1;
        if constexpr (kStaggers) { return {step.number - 1, step.head - int(step.m_block == m_block_first), m_block}; }
        return {step.number - 1, step.head - int(wrap), m_block};
    }
    __forceinline__ __device__ BwdStep last_step() const {
        const int after_last = kStaggers && m_block_first != m_block_begin ? m_block_first : m_block_end;
        return {step_end - 1, first_head + heads_per_cta - 1, after_last - 1};
    }

    template <class Layout>
    __forceinline__ __device__ static auto smem(Element* p, Layout layout) {
        return make_tensor(make_smem_ptr(p), layout);
    }
    __forceinline__ __device__ auto sQ(int stage) const {
        return smem(q_base + stage * kQElems, typename Traits::SmemLayoutQ{});
    }     // (kBlockM, kHeadDim)
    __forceinline__ __device__ auto sdO(int stage) const {
        return smem(do_base + stage * kdOElems, typename Traits::SmemLayoutdO{});
    }   // (kBlockM, kHeadDimV)
    __forceinline__ __device__ auto sQt(int stage) const {
        return smem(q_base + stage * kQElems, typename Traits::SmemLayoutQt{});
    }   // (kHeadDim, kBlockM)
    __forceinline__ __device__ auto sdOt(int stage) const {
        return smem(do_base + stage * kdOElems, typename Traits::SmemLayoutdOt{});
    } // (kHeadDimV, kBlockM)
    static constexpr int kKV1Offset = Traits::kSmemBytesOneKV / int(sizeof(Element)) -
                                      Traits::kStagesQ * (kQElems + kdOElems);
    __forceinline__ __device__ Element* k_stage(int s) const { return k_base + s * kKV1Offset; }
    __forceinline__ __device__ auto sK(int s) const {
        return smem(k_stage(s), typename Traits::SmemLayoutKV{});
    }    // (kBlockN, kHeadDim)
    __forceinline__ __device__ auto sV(int s) const {
        return smem(k_stage(s) + Traits::kSmemKVElems, typename Traits::SmemLayoutV{});
    }  // (kBlockN, kHeadDimV)
    __forceinline__ __device__ auto sKt(int s) const {
        return smem(k_stage(s), typename Traits::SmemLayoutKt{});
    }   // (kHeadDim, kBlockN)

    // Block `block` of kRows rows of a (seqlen, head_dim) view mA into the shared-memory tile sA, (kRows, kCols),
    // with GmemTiledCopy; rows past seqlen and columns past head_dim read as 0.
    template <class GmemTiledCopy, int kRows, int kCols, class View, class Smem>
    __forceinline__ __device__ static void load_tile(const View& mA, int block, const Smem& sA, int seqlen,
                                                     int head_dim, int thread) {
        GmemTiledCopy gmem_tiled_copy;
        auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(thread);
        Tensor gA = local_tile(mA, Shape<Int<kRows>, Int<kCols>>{}, make_coord(block, 0));  // (kRows, kCols)
        Tensor tAcA = gmem_thr_copy.partition_S(
            make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));  // (CPY, CPY_R, CPY_K)
        Tensor tAsA = gmem_thr_copy.partition_D(sA);  // (CPY, CPY_R, CPY_K)
        copy_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(gA), tAsA, tAcA, seqlen - block * kRows, head_dim);
    }

    // K and V of key block n into K/V stage s.
    __forceinline__ __device__ void load_kv(const BwdParams& params, int n, int s, int thread) const {
        load_tile<typename Traits::GmemTiledCopyLoad, kBlockN, kHeadDim>(
            binfo.k_view<Element>(params, batch_idx, head_idx_k), n, sK(s), binfo.seqlen_k, params.head_dim, thread);
        load_tile<typename Traits::GmemTiledCopyLoadV, kBlockN, kHeadDimV>(
            binfo.v_view<Element>(params, batch_idx, head_idx_k), n, sV(s), binfo.seqlen_k, params.head_dim_v, thread);
    }

    // Q, dO, LSE and D of step `step` into stage. Rows past seqlen_q read as 0, LSE and D included: with
    // zero Q and dO rows that gives P = 1 and dS = 0 there, so nothing reaches dV, dK or a stored dQ row,
    // and the kernels need no query-end mask.
    __forceinline__ __device__ void load_q_do(const BwdParams& params, const BwdStep& step, int stage,
                                              int thread) const {
        const int head_idx = step.head;
        const int m_block = step.m_block;
        load_tile<typename Traits::GmemTiledCopyQ, kBlockM, kHeadDim>(
            binfo.q_view<Element>(params, batch_idx, head_idx), m_block, sQ(stage), binfo.seqlen_q, params.head_dim,
            thread);
        load_tile<typename Traits::GmemTiledCopydO, kBlockM, kHeadDimV>(
            binfo.do_view<Element>(params, batch_idx, head_idx), m_block, sdO(stage), binfo.seqlen_q, params.head_dim_v,
            thread);
        const int rows_left = binfo.seqlen_q - m_block * kBlockM;
        // LSE by the first kBlockM threads, D by the next kBlockM.
        if (thread < 2 * kBlockM) {
            const index_t lse_offset = binfo.lse_offset(params, batch_idx, head_idx);
            const int row = thread % kBlockM;
            const bool valid = row < rows_left;
            const float* src = (thread < kBlockM ? params.lse_ptr : params.dsum_ptr) + lse_offset +
                               (valid ? m_block * kBlockM + row : 0);
            float* dst = (thread < kBlockM ? s_lse : s_dsum) + stage * kBlockM + row;
            cp_async_f32_zfill(dst, src, valid);
        }
    }

    // K, V and the first step's Q, dO, LSE and D, in flight when the loop starts.
    __forceinline__ __device__ void load_first(const BwdParams& params, int thread) const {
        load_kv(params, n_block, kv_stage, thread);
        if (step_end > 0) { load_q_do(params, first_step(), 0, thread); }
        cp_async_fence();
    }

    // Whether the CTA has a key block after the current one.
    __forceinline__ __device__ bool has_next_key_block() const {
        return Traits::kStagesKV > 1 && n_block + 1 < n_block_stop;
    }

    // Starts loading the next key block's K and V into the other K/V stage, as its own cp.async group, once
    // every warpgroup is done with the key block that used that stage last. Called before the current key
    // block's steps. cp.async groups complete in order, so the load stays pending only through the first
    // step: a one-step key block (short queries) overlaps it with its whole step and dK/dV store, and a
    // longer one takes it in at its second step's wait.
    __forceinline__ __device__ void load_next_kv(const BwdParams& params, int thread) const {
        __syncthreads();
        load_kv(params, n_block + 1, kv_stage ^ 1, thread);
        cp_async_fence();
    }

    // Opens step `step` and returns its stage: waits for its loads, makes them visible to wgmma, and syncs the
    // CTA, so that every warpgroup is done with the previous step's shared-memory tiles. The first step of a key
    // block whose successor's K and V are in flight (load_next_kv, the newest cp.async group) leaves that group
    // pending.
    __forceinline__ __device__ int begin_step(const BwdStep& step, bool kv_in_flight) const {
        if (kv_in_flight && step.number == step_begin) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        // cp.async writes and add_dq's are generic-proxy stores; wgmma and the bulk reductions read shared memory
        // through the async proxy.
        cutlass::arch::fence_view_async_shared();
        __syncthreads();
        return step.number & 1;
    }

    // After begin_step, once the step's first GEMMs are issued: adds the previous step's dQ tile from shared memory
    // and starts loading the next step (the next key block's first after the last) into the other stage. Here the
    // copies' address arithmetic, which waits on the load/store queue, runs under those GEMMs rather than before
    // them; that measured neutral on the anchor shapes, and the causal 64-row kernel lost an 8-byte spill.
    __forceinline__ __device__ void prefetch(const BwdParams& params, const BwdStep& step, int thread) const {
        if (dq_through_smem(params) && step.number > step_begin) { reduce_dq(params, previous_step(step), thread); }
        const bool last = step.number + 1 == step_end;
        if (!last || has_next_key_block()) {
            const BwdStep next = last ? BwdStep{step_end, first_head, m_block_begin_next} : next_step(step);
            load_q_do(params, next, (step.number & 1) ^ 1, thread);
            cp_async_fence();
        }
    }

    // Deterministic mode (Traits::kDqTurns; dq_turns.h): the key blocks that see a query block add into it from the
    // first, or under a causal mask from the last, which reaches it first (a key block's first query block lies
    // further down the later the block is). Either way grid x runs over them in that order (first_key_block), so each
    // waits only for CTAs of lower index, dispatched no later. A key block passes a step's turn on at its next
    // step, each thread having fenced its additions, which by then have long landed: no thread waits for additions
    // it just issued. Without a mask a key block then runs a step behind its predecessor, and where CTAs start
    // together (several heads' key blocks in one wave) the later ones wait for the earlier ones' steps.
    // Staggered instead (no mask, no more key blocks than query blocks in the sequence), key block n reaches query
    // block m at its step (m - n) mod (query blocks), and the turns follow that order of arrival: key block m (or
    // the last, if there are fewer) down to 0, then the last down to m + 1. A key block waits only for the next one,
    // which reached the query block a step before it; that one has a higher CTA index, so the plan staggers only
    // where every key block of a sequence is resident at once (Plan::staggered).
    __forceinline__ __device__ int dq_turn(const BwdStep& step) const {
        if constexpr (kCausal) {
            return bounds.n_block_end(step.m_block) - 1 - n_block;
        } else {
            if (staggered) {
                const int m = step.m_block - m_block_begin;
                const int n_blocks = bounds.n_blocks();
                return n_block <= m ? min(m, n_blocks - 1) - n_block : n_blocks + m - n_block;
            }
            return n_block;
        }
    }
    __forceinline__ __device__ void pass_turn(const BwdParams& params, const BwdStep& step) const {
        pass_dq_turn(dq_turn_flag<kBlockM>(params, batch_idx, step.head, step.m_block), dq_turn(step));
    }
    // Before a step's additions: the previous step's turn passes on and this one's comes.
    __forceinline__ __device__ void begin_dq_turn(const BwdParams& params, const BwdStep& step, int thread) const {
        __threadfence();
        __syncthreads();
        if (thread == 0) {
            if (step.number > step_begin) { pass_turn(params, previous_step(step)); }
            wait_dq_turn(dq_turn_flag<kBlockM>(params, batch_idx, step.head, step.m_block), dq_turn(step));
        }
        __syncthreads();
    }
    // After a key block's steps: the last one's turn passes on.
    __forceinline__ __device__ void end_dq_turns(const BwdParams& params, int thread) const {
        if constexpr (Traits::kDqTurns) {
            if (params.deterministic && step_end > step_begin) {
                __threadfence();
                __syncthreads();
                if (thread == 0) { pass_turn(params, last_step()); }
            }
        }
    }

    // Whether add_dq writes dQ to shared memory for a bulk reduction (Traits::kDqThroughSmem): in a CTA of one key
    // block, where the two dQ tiles take the second K/V buffer's place.
    __forceinline__ __device__ static bool dq_through_smem(const BwdParams& params) {
        return Traits::kDqThroughSmem && params.key_blocks_per_cta == 1;
    }

    // Adds the dQ tile that add_dq wrote to shared memory for `step` into dq_accum, one bulk reduction by thread 0,
    // called after a barrier that follows every thread's writes and an async-proxy fence. The tile of step s - 2
    // used the same shared memory; waiting for that reduction's reads here, before the barrier in the middle of
    // step s that comes before add_dq overwrites it, keeps the two apart. The tile is added whole: rows past
    // seqlen_q hold exact zeros (load_q_do) and dq_accum pads each sequence past its last query block.
    __forceinline__ __device__ void reduce_dq(const BwdParams& params, const BwdStep& step, int thread) const {
        if (thread == 0) {
            bulk_wait_read<0>();
            bulk_reduce_add_f32(&gdQaccum(params, step.head)(0, 0, step.m_block),
                                s_dq + (step.number & 1) * Traits::kSmemDqTileFloats,
                                Traits::kSmemDqTileFloats * int(sizeof(float)));
            bulk_commit();
        }
    }

    // After a key block's steps: adds the last one's dQ tile from shared memory (add_dq).
    __forceinline__ __device__ void flush_dq(const BwdParams& params, int thread) const {
        if (dq_through_smem(params) && step_end > step_begin) {
            cutlass::arch::fence_view_async_shared();
            __syncthreads();
            reduce_dq(params, last_step(), thread);
        }
    }

    // Query head head_idx's dQ accumulator as (kBlockM, kHeadDim) tiles.
    __forceinline__ __device__ auto gdQaccum(const BwdParams& params, int head_idx) const {
        float* dq_head = params.dq_accum_ptr + binfo.dq_accum_row(params, batch_idx, head_idx) * kHeadDim;
        return make_tensor(
            make_gmem_ptr(dq_head),
            make_layout(make_shape(Int<kBlockM>{}, Int<kHeadDim>{}, m_block_end),
                        make_stride(Int<kHeadDim>{}, _1{}, Int<kBlockM * kHeadDim>{})));  // (kBlockM, kHeadDim, m)
    }

    // Adds step's dQ (acc_dq, partitioned by thr_mma_dq, the slice of thread `thread`) into dq_accum, skipping the
    // rows past seqlen_q: with short queries every key block's CTA would otherwise add a block of mostly zero rows
    // into the same L2 lines. A test of each value's row, which folds to a few compares per step (a thread holds
    // two rows of each 64-row wgmma tile, or four query columns of a transposed one); testing the values for zero
    // instead (a compare and a select per pair in every step) cost the anchor shapes 1-3%.
    // acc_dq is (kBlockM, kHeadDim), added in the dQ GEMM's fragment order (dq_accum.h) four values at a time:
    // values 4 g to 4 g + 3 of a wgmma fragment are a column pair of rows r and r + 8, skipped when r is past
    // seqlen_q (row r + 8 then is too, or it adds its exact zeros inside the tile). With Traits::kDqTransposed
    // it is (kHeadDim, kBlockM), added one value at a time in (row, column) order.
    template <class ThrMma, class Acc>
    __forceinline__ __device__ void add_dq(const BwdParams& params, const ThrMma& thr_mma_dq, const Acc& acc_dq,
                                           const BwdStep& step, int thread) const {
        Tensor gdQ = gdQaccum(params, step.head)(_, _, step.m_block);  // (kBlockM, kHeadDim)
        const int rows_left = binfo.seqlen_q - step.m_block * kBlockM;
        if constexpr (Traits::kDqTransposed) {
            Tensor gdQt = make_tensor(gdQ.data(), make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{},
                                                              Stride<_1, Int<kHeadDim>>{}));  // (kHeadDim, kBlockM)
            Tensor tdQgdQ = thr_mma_dq.partition_C(gdQt);  // (MMA, MMA_D, MMA_M)
            Tensor tdQcdQ = thr_mma_dq.partition_C(
                make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockM>>{}));  // (MMA, MMA_D, MMA_M)
            CUTE_UNROLL
            for (int i = 0; i < size(acc_dq); ++i) { red_add_if(get<1>(tdQcdQ(i)) < rows_left, &tdQgdQ(i), acc_dq(i)); }
        } else {
            static_assert(Traits::kDqChunk == kHeadDim &&
                          decltype(size(acc_dq))::value * Traits::kNThreads == kBlockM * kHeadDim);
            if (dq_through_smem(params)) {
                // Four values a 16 B store, each warp's 512 consecutive bytes, in the tile reduce_dq adds.
                float* tile = s_dq + (step.number & 1) * Traits::kSmemDqTileFloats + thread * 4;
                CUTE_UNROLL
                for (int g = 0; g < size(acc_dq) / 4; ++g) {
                    *reinterpret_cast<float4*>(tile + g * Traits::kNThreads * 4) = make_float4(
                        acc_dq(4 * g), acc_dq(4 * g + 1), acc_dq(4 * g + 2), acc_dq(4 * g + 3));
                }
                return;
            }
            float* dst = &gdQ(0, 0) + thread * 4;  // the tile's floats, in fragment order
            Tensor tdQcdQ = thr_mma_dq.partition_C(
                make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (MMA, MMA_M, MMA_D)
            if constexpr (Traits::kDqTurns) {
                if (params.deterministic) { begin_dq_turn(params, step, thread); }
            }
            CUTE_UNROLL
            for (int g = 0; g < size(acc_dq) / 4; ++g) {
                red_add_dq_if(get<0>(tdQcdQ(4 * g)) < rows_left, dst + g * Traits::kNThreads * 4, acc_dq, g);
            }
        }
    }

    // Writes the key block's dK and dV. dK picks up the softmax scale here; dQ gets it when its fp32 buffer is
    // converted. Element outputs go through the current K/V buffer, which is free once every warpgroup's
    // GEMMs of the key block are done: stmatrix in, 16 B stores out. Stored straight from the accumulators
    // (4 B per thread and store, half of each 32 B sector) they kept short-query CTAs waiting on a full store
    // queue. fp32 outputs (GQA slices per query head) would not fit the buffer and keep the direct stores.
    // mma_dk and mma_dv partition the accumulators: one MMA for both, or dV's of kHeadDimV columns.
    template <class MmadK, class AccdK, class MmadV, class AccdV>
    __forceinline__ __device__ void store_dk_dv(const BwdParams& params, const MmadK& mma_dk, AccdK& acc_dk,
                                                const MmadV& mma_dv, AccdV& acc_dv, int thread) const {
        // No step waited for this key block's K and V when it had none; the wide kernel exits right after.
        if (step_end == step_begin) { cp_async_wait<0>(); }
        const float dv_scale = kVariants ? params.dropout_keep_scale : 1.f;  // dV summed kept P unscaled
        if (params.dkv_fp32) {
            store_fp32<kHeadDim>(mma_dk, acc_dk, binfo.dk_view<float>(params, batch_idx, dkv_head), params.head_dim,
                                 params.softmax_scale, thread);
            store_fp32<kHeadDimV>(mma_dv, acc_dv, binfo.dv_view<float>(params, batch_idx, dkv_head), params.head_dim_v,
                                  dv_scale, thread);
            return;
        }
        __syncthreads();  // every warpgroup's wgmmas that read this K/V buffer have completed
        stage_in_smem(mma_dk, acc_dk, params.softmax_scale, sK(kv_stage), thread);
        stage_in_smem(mma_dv, acc_dv, dv_scale, sV(kv_stage), thread);
        __syncthreads();
        store_staged<typename Traits::GmemTiledCopyStore, kHeadDim>(
            sK(kv_stage), binfo.dk_view<Element>(params, batch_idx, dkv_head), params.head_dim, thread);
        store_staged<typename Traits::GmemTiledCopyStoreV, kHeadDimV>(
            sV(kv_stage), binfo.dv_view<Element>(params, batch_idx, dkv_head), params.head_dim_v, thread);
    }
    template <class MmadKV, class Acc>
    __forceinline__ __device__ void store_dk_dv(const BwdParams& params, const MmadKV& mma_dkv, Acc& acc_dk,
                                                Acc& acc_dv, int thread) const {
        store_dk_dv(params, mma_dkv, acc_dk, mma_dkv, acc_dv, thread);
    }

    // store_dk_dv's parts. acc, (kBlockN, kCols) partitioned by mma, times scale straight into the fp32 view's
    // key block n_block, its columns up to cols.
    template <int kCols, class Mma, class Acc, class View>
    __forceinline__ __device__ void store_fp32(const Mma& mma, const Acc& acc, const View& view, int cols, float scale,
                                               int thread) const {
        Tensor tcC = mma.get_thread_slice(thread).partition_C(
            make_identity_tensor(Shape<Int<kBlockN>, Int<kCols>>{}));  // (MMA, MMA_N, MMA_D)
        Tensor gC = local_tile(view, Shape<Int<kBlockN>, Int<kCols>>{}, make_coord(n_block, 0));  // (kBlockN, kCols)
        store_acc<float>(acc, tcC, gC, k_rows_left(), cols, scale);
    }
    // acc times scale, as Element, into the shared-memory tile sC of its shape with stmatrix.
    template <class Mma, class Acc, class Smem>
    __forceinline__ __device__ static void stage_in_smem(const Mma& mma, Acc& acc, float scale, const Smem& sC,
                                                         int thread) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) { acc(i) *= scale; }
        Tensor rC = convert_fragment<Element>(acc);
        auto smem_tiled_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
        auto smem_thr_copy = smem_tiled_copy.get_thread_slice(thread);
        copy(smem_tiled_copy, smem_thr_copy.retile_S(rC), smem_thr_copy.partition_D(sC));
    }
    // The staged tile sC, (kBlockN, kCols), into the view's key block n_block with 16 B stores, its columns up to
    // cols.
    template <class GmemTiledCopy, int kCols, class Smem, class View>
    __forceinline__ __device__ void store_staged(const Smem& sC, const View& view, int cols, int thread) const {
        GmemTiledCopy gmem_tiled_copy;
        auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(thread);
        Tensor tcC = gmem_thr_copy.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kCols>>{}));  // (CPY, N, D)
        Tensor gC = local_tile(view, Shape<Int<kBlockN>, Int<kCols>>{}, make_coord(n_block, 0));  // (kBlockN, kCols)
        copy_to_gmem(gmem_tiled_copy, gmem_thr_copy.partition_S(sC), gmem_thr_copy.partition_D(gC), tcC, k_rows_left(),
                     cols);
    }
};

// The part of a narrow-kernel step before its dQ GEMM, which the warp-specialized backward's consumers share: issues
// S^T = K Q^T and dP^T = V dO^T (tSrK, tSrV: the key block's K and V as their A operands; sQ, sdO: the step's Q and
// dO, sQt, sdOt their transposed views), runs under_score_gemms() while they compute, then P^T from the LSE
// (lse_stage: the step's query rows), dV += P^T dO, dS^T = P^T (dP^T - D) (dsum_stage) into shared memory (sdSt)
// for the dQ GEMM, and dK += dS^T Q (its first kDkSteps K steps, -1: all), scaled by the tile mask `mask` and the
// variants of score_mod for query head `head`. hide_queries_past_end: query rows past the sequence end hold another
// sequence's rows (see TileMask::hide_queries_past_end; not in the variants' fused softcap form). It returns with
// the dV and dK GEMMs in flight, and P^T and dS^T in the registers they read, which the caller fences once it has
// waited for them. Threads: the two warpgroups, loop_tidx of their 256.
template <class Traits, bool kVariants, int kDkSteps = -1, class Element, class Mask, class MmaSdP, class MmadKV,
          class SmemCopydSt, class FragKV, class SmemQ, class SmemQt, class SmemdSt, class AccdKV,
          class UnderScoreGemms>
__forceinline__ __device__ auto bwd_narrow_step_scores(
    const BwdParams& params, const ScoreMod<Element>& score_mod, const Mask& mask, int batch_idx, int head,
    MmaSdP& mma_sdp, MmadKV& mma_dkv, const SmemCopydSt& smem_tiled_copy_dst, FragKV& tSrK, FragKV& tSrV,
    const SmemQ& sQ, const SmemQ& sdO, const SmemQt& sQt, const SmemQt& sdOt, const float* lse_stage,
    const float* dsum_stage, const SmemdSt& sdSt, AccdKV& acc_dk, AccdKV& acc_dv, int loop_tidx,
    const UnderScoreGemms& under_score_gemms, bool hide_queries_past_end = false) {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    Tensor cSt = make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{});  // (kBlockN, kBlockM)

    // Both score GEMMs are in flight together; P^T is computed while dP^T finishes.
    auto thr_mma_sdp = mma_sdp.get_thread_slice(loop_tidx);
    Tensor acc_st = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA, MMA_N, MMA_M)
    Tensor acc_dpt = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA, MMA_N, MMA_M)
    Tensor tSrQ = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sQ));  // (MMA, MMA_M, MMA_K)
    Tensor tSrdO = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(sdO));  // (MMA, MMA_M, MMA_K)
    warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrK, tSrQ, acc_st);
    warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrV, tSrdO, acc_dpt);
    under_score_gemms();

    // (key row, query column) of each accumulator value.
    Tensor tStcSt = thr_mma_sdp.partition_C(cSt);  // (MMA, MMA_N, MMA_M)
    Tensor tStcSt_rc = make_tensor(tStcSt.data(), gmma_acc_rowcol_layout(tStcSt.layout()));  // (key rows, query cols)

    // P^T = exp2(s * scale * log2(e) - lse * log2(e)). With softcap (and no dropout) dS^T in the same pass, after
    // dP^T (compute_p_ds_softcap): that gives up the dP^T GEMM's overlap with the exp loop for one MUFU operation
    // less per element than recovering tanh from P, and was faster.
    Tensor st = gmma_as_rowcol(acc_st);  // (key rows, query cols)
    Tensor dpt = gmma_as_rowcol(acc_dpt);  // (key rows, query cols)
    const ScorePos pos{mask.m_block * kBlockM, mask.n_block * kBlockN, head};
    auto lse_log2_of = [&](int col) { return lse_stage[col] * float(M_LOG2E); };
    auto dsum_of = [&](int col) { return dsum_stage[col]; };
    const Dropout step_dropout(params, batch_idx, head);
    const bool fused_softcap = kVariants && score_mod.softcap() && !step_dropout.active();
    if (fused_softcap) {
        warpgroup_wait_for<0>(acc_dpt);
        warpgroup_fence_operand(acc_st);  // S^T completed with that wait too: no read of it above it
        compute_p_ds_softcap</*kQueryIsRow=*/false, HideP::kInExp>(st, dpt, tStcSt_rc, mask, score_mod, pos,
                                                                   params.softmax_scale_log2, lse_log2_of, dsum_of);
    } else {
        warpgroup_wait_for<1>(acc_st);
        compute_p</*kQueryIsRow=*/false, HideP::kInExp, kVariants>(st, tStcSt_rc, mask, score_mod, pos,
                                                                   params.softmax_scale_log2, lse_log2_of);
        if (kVariants && step_dropout.active()) {
            step_dropout.template apply</*kQueryIsRow=*/false, /*kNegate=*/true>(st, tStcSt_rc, pos.q0, pos.k0);
        }
        if (hide_queries_past_end) { mask.template hide_queries_past_end</*kQueryIsRow=*/false>(st, tStcSt_rc); }
    }
    Tensor rPt = convert_fragment_kept<Element>(acc_st, kVariants && step_dropout.active());
    Tensor tKVrPt = make_tensor(rPt.data(), gmma_acc_as_a_operand_layout(rPt.layout()));  // (MMA, MMA_N, MMA_K)
    auto thr_mma_dkv = mma_dkv.get_thread_slice(loop_tidx);
    Tensor tKVrdOt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sdOt));  // (MMA, MMA_D, MMA_K)
    warpgroup_gemm_issue</*kZeroInit=*/false>(mma_dkv, tKVrPt, tKVrdOt, acc_dv);

    // dS^T = P^T (dP^T - D), the gradient of the scaled scores.
    warpgroup_wait_for<1>(acc_dpt);
    if (!fused_softcap) {
        compute_ds</*kQueryIsRow=*/false, kVariants>(dpt, st, tStcSt_rc, dsum_of, DsMods<Element>{score_mod, head}, pos,
                                                     lse_log2_of);
    }
    Tensor rdSt = convert_fragment<Element>(acc_dpt);
    Tensor tKVrdSt = make_tensor(rdSt.data(), gmma_acc_as_a_operand_layout(rdSt.layout()));  // (MMA, MMA_N, MMA_K)

    // dS^T to shared memory for the dQ GEMM, whose rows (queries) span both warpgroups' keys.
    auto smem_thr_copy_dst = smem_tiled_copy_dst.get_thread_slice(loop_tidx);
    Tensor tdStrdSt = smem_thr_copy_dst.retile_S(rdSt);  // (CPY, CPY_N, CPY_M)
    Tensor tdStsdSt = smem_thr_copy_dst.partition_D(sdSt);  // (CPY, CPY_N, CPY_M)
    copy(smem_tiled_copy_dst, tdStrdSt, tdStsdSt);
    cutlass::arch::fence_view_async_shared();

    Tensor tKVrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(sQt));  // (MMA, MMA_D, MMA_K)
    if constexpr (kDkSteps != 0) {
        warpgroup_gemm_issue</*kZeroInit=*/false, 0, kDkSteps>(mma_dkv, tKVrdSt, tKVrQt, acc_dk);
    }
    return cute::make_tuple(rPt, rdSt);
}

// Per-thread partitions inside the main loops are made from opaque_int(tidx): their addresses are then
// recomputed each step (a few integer ops) instead of being hoisted out of the loop, where, next to the dK
// and dV accumulators, they would spill.

// kVariants: as in flash_fwd_kernel.h.
template <class Traits, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;

    extern __shared__ __align__(1024) char smem_bwd_sm90[];  // 128 B swizzle atoms repeat every 1 KiB
    BwdSm90Block<Traits, kCausal, kVariants> blk(params, smem_bwd_sm90);
    if (!blk.has_keys()) { return; }
    const int tidx = threadIdx.x;
    const ScoreMod<Element> score_mod(params, blk.batch_idx, blk.binfo);

    Tensor sdSt = blk.smem(blk.scratch_base, typename Traits::SmemLayoutdSt{});  // (kBlockN, kBlockM)
    Tensor sdS = blk.smem(blk.scratch_base, typename Traits::SmemLayoutdS{});  // (kBlockM, kBlockN)

    // S^T and dP^T, (kBlockN, kBlockM): A operands K and V are fixed per key block; B operands Q and dO
    // change per stage.
    typename Traits::TiledMmaSdP mma_sdp;
    auto smem_tiled_copy_dst = make_tiled_copy_C(typename Traits::SmemCopyAtomdSt{}, mma_sdp);

    // dV and dK, (kBlockN, kHeadDim), held in registers across a key block's steps.
    typename Traits::TiledMmadKV mma_dkv;
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)

    // dQ, (kBlockM, kHeadDim) per query block (transposed with Traits::kDqTransposed), added into dq_accum.
    typename Traits::TiledMmadQ mma_dq;

    blk.load_first(params, tidx);
    do {  // key blocks of this CTA
        clear(acc_dk);
        clear(acc_dv);
        const int kv_stage = blk.kv_stage;
        const bool kv_in_flight = blk.has_next_key_block() && blk.step_end > blk.step_begin;  // no steps: no K/V needed
        if (kv_in_flight) { blk.load_next_kv(params, tidx); }
        auto thr_mma_kv = mma_sdp.get_thread_slice(tidx);
        Tensor tSrK = thr_mma_kv.make_fragment_A(thr_mma_kv.partition_A(blk.sK(kv_stage)));  // (MMA, MMA_N, MMA_K)
        Tensor tSrV = thr_mma_kv.make_fragment_A(thr_mma_kv.partition_A(blk.sV(kv_stage)));  // (MMA, MMA_N, MMA_K)
        for (BwdStep step = blk.first_step(); step.number < blk.step_end; step = blk.next_step(step)) {
            const int loop_tidx = opaque_int(tidx);
            const int stage = blk.begin_step(step, kv_in_flight);
            const int m_block = step.m_block;

            const TileMask<kBlockM, kBlockN, kCausal, kVariants> mask(blk.bounds, m_block, blk.n_block);
            auto [rPt, rdSt] = bwd_narrow_step_scores<Traits, kVariants>(
                params, score_mod, mask, blk.batch_idx, step.head, mma_sdp, mma_dkv, smem_tiled_copy_dst, tSrK, tSrV,
                blk.sQ(stage), blk.sdO(stage), blk.sQt(stage), blk.sdOt(stage), blk.s_lse + stage * kBlockM,
                blk.s_dsum + stage * kBlockM, sdSt, acc_dk, acc_dv, loop_tidx,
                [&] { blk.prefetch(params, step, loop_tidx); });

            __syncthreads();  // all of dS^T is in shared memory
            auto thr_mma_dq = mma_dq.get_thread_slice(loop_tidx);
            // The accumulator is complete before it is returned: a copy of registers that a wgmma still
            // writes would be undefined.
            auto dq_gemm = [&]() {
                if constexpr (Traits::kDqTransposed) {
                    Tensor tQrKt = thr_mma_dq.make_fragment_A(
                        thr_mma_dq.partition_A(blk.sKt(kv_stage)));  // (MMA, MMA_D, MMA_K)
                    Tensor tQrdS = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(sdS));  // (MMA, MMA_M, MMA_K)
                    Tensor acc = partition_fragment_C(mma_dq,
                                                      Shape<Int<kHeadDim>, Int<kBlockM>>{});  // (MMA, MMA_D, MMA_M)
                    warpgroup_gemm_issue</*kZeroInit=*/true>(mma_dq, tQrKt, tQrdS, acc);
                    warpgroup_wait_for<0>(acc);
                    return acc;
                } else {
                    Tensor tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS));  // (MMA, MMA_M, MMA_K)
                    Tensor tQrKt = thr_mma_dq.make_fragment_B(
                        thr_mma_dq.partition_B(blk.sKt(kv_stage)));  // (MMA, MMA_D, MMA_K)
                    Tensor acc = partition_fragment_C(mma_dq,
                                                      Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
                    warpgroup_gemm_issue</*kZeroInit=*/true>(mma_dq, tQrdS, tQrKt, acc);
                    warpgroup_wait_for<0>(acc);
                    return acc;
                }
            };
            Tensor acc_dq = dq_gemm();
            warpgroup_fence_operand(acc_dv);
            warpgroup_fence_operand(acc_dk);
            warpgroup_fence_operand(rPt);
            warpgroup_fence_operand(rdSt);
            blk.add_dq(params, thr_mma_dq, acc_dq, step, loop_tidx);
        }
        blk.flush_dq(params, tidx);
        // With one step per key block, the next one's K and V and first Q and dO are in flight during the store.
        blk.store_dk_dv(params, mma_dkv, acc_dk, acc_dv, opaque_int(tidx));
    } while (blk.next_key_block());
    cp_async_wait<0>();  // no cp.async may land in shared memory after the CTA exits
    if (BwdSm90Block<Traits, kCausal, kVariants>::dq_through_smem(params) && tidx == 0) {
        bulk_wait<0>();  // nor a bulk reduction read it
    }
#endif
}

template <class Traits, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_wide_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kHeadDimV = Traits::kHeadDimV;

    extern __shared__ __align__(1024) char smem_bwd_sm90[];  // 128 B swizzle atoms repeat every 1 KiB
    const BwdSm90Block<Traits, kCausal, kVariants> blk(params, smem_bwd_sm90);
    static_assert(Traits::kStagesKV == 1, "one key block per CTA");
    if (!blk.has_keys()) { return; }
    const int tidx = threadIdx.x;
    const ScoreMod<Element> score_mod(params, blk.batch_idx, blk.binfo);

    Element* p_base = blk.scratch_base;
    Element* ds_base = blk.scratch_base + Traits::kSmemPElems;
    Tensor sP = blk.smem(p_base, typename Traits::SmemLayoutP{});  // (kBlockM, kBlockN)
    Tensor sdS = blk.smem(ds_base, typename Traits::SmemLayoutP{});  // (kBlockM, kBlockN)
    Tensor sPt = blk.smem(p_base, typename Traits::SmemLayoutPt{});  // (kBlockN, kBlockM)
    Tensor sdSt = blk.smem(ds_base, typename Traits::SmemLayoutPt{});  // (kBlockN, kBlockM)
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (kBlockM, kBlockN)

    // S and dP, (kBlockM, kBlockN), each warpgroup kBlockN / 2 keys.
    typename Traits::TiledMmaSdP mma_sdp;
    auto smem_tiled_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);

    // dK, (kBlockN, kHeadDim), and dV, (kBlockN, kHeadDimV), each warpgroup half the head dim, held in registers
    // across the loop.
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadV mma_dv;
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<kHeadDimV>>{});  // (MMA, MMA_N, MMA_DV)
    clear(acc_dk);
    clear(acc_dv);

    // dQ, (kBlockM, kHeadDim) per query block, each warpgroup half the head dim, added into dq_accum.
    typename Traits::TiledMmadQ mma_dq;

    blk.load_first(params, tidx);
    for (BwdStep step = blk.first_step(); step.number < blk.step_end; step = blk.next_step(step)) {
        const int loop_tidx = opaque_int(tidx);
        const int stage = blk.begin_step(step, /*kv_in_flight=*/false);
        const int m_block = step.m_block;

        auto thr_mma_sdp = mma_sdp.get_thread_slice(loop_tidx);
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        Tensor tSrQ = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(blk.sQ(stage)));  // (MMA, MMA_M, MMA_K)
        Tensor tSrdO = thr_mma_sdp.make_fragment_A(thr_mma_sdp.partition_A(blk.sdO(stage)));  // (MMA, MMA_M, MMA_K)
        Tensor tSrK = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(blk.sK(0)));  // (MMA, MMA_N, MMA_K)
        Tensor tSrV = thr_mma_sdp.make_fragment_B(thr_mma_sdp.partition_B(blk.sV(0)));  // (MMA, MMA_N, MMA_K)
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrQ, tSrK, acc_s);
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_sdp, tSrdO, tSrV, acc_dp);
        blk.prefetch(params, step, loop_tidx);

        // (query row, key column) of each accumulator value.
        Tensor tScS = thr_mma_sdp.partition_C(cS);  // (MMA, MMA_M, MMA_N)
        Tensor tScS_rc = make_tensor(tScS.data(), gmma_acc_rowcol_layout(tScS.layout()));  // (query rows, key cols)
        const TileMask<kBlockM, kBlockN, kCausal, kVariants> mask(blk.bounds, m_block, blk.n_block);

        // P = exp2(s * scale * log2(e) - lse * log2(e)), then dS = P (dP - D); with softcap (and no dropout) both
        // in one pass after dP (compute_p_ds_softcap).
        Tensor s = gmma_as_rowcol(acc_s);  // (query rows, key cols)
        Tensor dp = gmma_as_rowcol(acc_dp);  // (query rows, key cols)
        const ScorePos pos{m_block * kBlockM, blk.n_block * kBlockN, step.head};
        auto lse_log2_of = [&](int row) { return blk.s_lse[stage * kBlockM + row] * float(M_LOG2E); };
        auto dsum_of = [&](int row) { return blk.s_dsum[stage * kBlockM + row]; };
        const Dropout step_dropout(params, blk.batch_idx, step.head);
        if (kVariants && score_mod.softcap() && !step_dropout.active()) {
            warpgroup_wait_for<0>(acc_dp);
            warpgroup_fence_operand(acc_s);  // S completed with that wait too: no read of it above it
            compute_p_ds_softcap</*kQueryIsRow=*/true, HideP::kInExp>(s, dp, tScS_rc, mask, score_mod, pos,
                                                                      params.softmax_scale_log2, lse_log2_of, dsum_of);
        } else {
            warpgroup_wait_for<1>(acc_s);
            compute_p</*kQueryIsRow=*/true, HideP::kInExp, kVariants>(s, tScS_rc, mask, score_mod, pos,
                                                                      params.softmax_scale_log2, lse_log2_of);
            if (kVariants && step_dropout.active()) {
                step_dropout.template apply</*kQueryIsRow=*/true, /*kNegate=*/true>(s, tScS_rc, pos.q0, pos.k0);
            }
            warpgroup_wait_for<0>(acc_dp);
            compute_ds</*kQueryIsRow=*/true, kVariants>(dp, s, tScS_rc, dsum_of, DsMods<Element>{score_mod, step.head},
                                                        pos, lse_log2_of);
        }

        // P and dS to shared memory: the next three GEMMs read them across both warpgroups' keys.
        auto smem_thr_copy_pds = smem_tiled_copy_pds.get_thread_slice(loop_tidx);
        Tensor rP = convert_fragment_kept<Element>(acc_s, kVariants && step_dropout.active());
        Tensor rdS = convert_fragment<Element>(acc_dp);
        copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rP), smem_thr_copy_pds.partition_D(sP));
        copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rdS), smem_thr_copy_pds.partition_D(sdS));
        cutlass::arch::fence_view_async_shared();
        __syncthreads();  // all of P and dS are in shared memory

        // dQ first, so its reduction into global memory overlaps the dV and dK GEMMs.
        auto thr_mma_dq = mma_dq.get_thread_slice(loop_tidx);
        Tensor tQrdS = thr_mma_dq.make_fragment_A(thr_mma_dq.partition_A(sdS));  // (MMA, MMA_M, MMA_K)
        Tensor tQrKt = thr_mma_dq.make_fragment_B(thr_mma_dq.partition_B(blk.sKt(0)));  // (MMA, MMA_D, MMA_K)
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_D)
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_dq, tQrdS, tQrKt, acc_dq);
        auto thr_mma_dkv = mma_dkv.get_thread_slice(loop_tidx);
        auto thr_mma_dv = mma_dv.get_thread_slice(loop_tidx);
        Tensor tKVrPt = thr_mma_dv.make_fragment_A(thr_mma_dv.partition_A(sPt));  // (MMA, MMA_N, MMA_K)
        Tensor tKVrdSt = thr_mma_dkv.make_fragment_A(thr_mma_dkv.partition_A(sdSt));  // (MMA, MMA_N, MMA_K)
        Tensor tKVrdOt = thr_mma_dv.make_fragment_B(thr_mma_dv.partition_B(blk.sdOt(stage)));  // (MMA, MMA_DV, MMA_K)
        Tensor tKVrQt = thr_mma_dkv.make_fragment_B(thr_mma_dkv.partition_B(blk.sQt(stage)));  // (MMA, MMA_D, MMA_K)
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_dv, tKVrPt, tKVrdOt, acc_dv);
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_dkv, tKVrdSt, tKVrQt, acc_dk);
        warpgroup_wait_for<2>(acc_dq);
        blk.add_dq(params, thr_mma_dq, acc_dq, step, loop_tidx);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
    }
    blk.end_dq_turns(params, tidx);
    blk.store_dk_dv(params, mma_dkv, acc_dk, mma_dv, acc_dv, tidx);
#endif
}

// dq = softmax_scale * dq_accum for one query block of one (sequence, query head), from dq_accum in the dQ GEMM's
// fragment order (the kernels above but for the short-query tile, Traits::kDqTransposed).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_sm90_convert_dq_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!Traits::kDqTransposed);
    convert_dq_tile<Traits, /*kFlagged=*/true>(params);
#endif
}

}  // namespace flash
