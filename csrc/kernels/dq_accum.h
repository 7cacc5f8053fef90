// The fp32 dQ accumulator (dq_accum) in the dQ GEMM's fragment order: the reductions that add a step's dQ into
// it, and the conversion to dq.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "kernels/block_info.h"
#include "kernels/dq_turns.h"
#include "kernels/global_ops.h"
#include "launch/flash_params.h"
#include "kernels/smem_partition.h"
#include "kernels/utils.h"

namespace flash {

using namespace cute;

// The fp32 dQ buffer (dq_accum) of the mma.sync backward, and of the Hopper backward's kernels whose dQ GEMM has
// query rows (all but the 16-row short-query tile's), holds each (query block, dQ chunk) tile as its
// kBlockM * kDqChunk floats in the order of the dQ GEMM's accumulator fragments: value i of thread t at
// ((i / V) * kNThreads + t) * V + i % V, V = dq_accum_vec() floats per reduction. A warp's reduction then
// covers 32 * V consecutive floats, whole 128 B lines; in (row, column) order each one touched eight rows of
// 32 B, and sent eight requests to L2 where FlashAttention-2's sends one (Nsight Compute on an H200: four
// times the L2 reduction requests, and stalls on the load/store queues). convert_dq_tile restores the (row,
// column) order. V is 4 on sm_90, which has 16 B vector reductions, and 1 before it,
// whose vector reductions are split into scalar ones: four floats per thread would spread a warp's scalar
// reduction over four lines.
__forceinline__ __device__ constexpr int dq_accum_vec() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return 4;
#else
    return 1;
#endif
}

// Adds a thread's fragment values [kVec * g, kVec * (g + 1)) to dst, kVec = dq_accum_vec().
template <class AccTensor>
__forceinline__ __device__ void red_add_dq(float* dst, const AccTensor& acc, int g) {
    constexpr int kVec = dq_accum_vec();
    static_assert(kVec == 1 || kVec == 4);
    if constexpr (kVec == 4) {
        red_add_quad(dst, acc(4 * g), acc(4 * g + 1), acc(4 * g + 2), acc(4 * g + 3));
    } else {
        atomicAdd(dst, acc(g));
    }
}

// red_add_dq when `add`, for sm_90 (four values, dq_accum_vec()): the Hopper backward skips the quads of rows past
// seqlen_q (BwdSm90Block::add_dq).
template <class AccTensor>
__forceinline__ __device__ void red_add_dq_if(bool add, float* dst, const AccTensor& acc, int g) {
    red_add_quad_if(add, dst, acc(4 * g), acc(4 * g + 1), acc(4 * g + 2), acc(4 * g + 3));
}

// dq = softmax_scale * dq_accum for one query block of one (sequence, query head): dq_accum's tiles in the
// dQ GEMM's fragment order (dq_accum_vec) are read back by the threads that wrote them, 16 B (sm_90) or 4 B
// per access and contiguous across a warp, and staged through shared memory so that dq gets whole 16 B
// chunks of its rows.
// Traits: the main kernel's (kBlockM, kHeadDim, kDqChunk, kNThreads, TiledMmadQ, Element), with SmemLayoutQ for one
// (kBlockM, kHeadDim) tile, SmemCopyAtomStore (registers to it, for TiledMmadQ's fragments) and GmemTiledCopyStore;
// one CTA of kNThreads per (query block, sequence, query head), with kSmemQElems elements of shared memory.
// kFlagged: where the kernel stored each query block's first tile (BwdParams::dq_accum_stored), a block whose
// flag shows no key block holds no values, and its dq is zeros.
template <class Traits, bool kFlagged = false>
__forceinline__ __device__ void convert_dq_tile(const BwdParams& params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kDqChunk = Traits::kDqChunk;
    constexpr int kVec = dq_accum_vec();
    const int m_block = blockIdx.x;
    const int batch_idx = sequence_of_cta(params);
    const int head_idx = blockIdx.z;
    const int tidx = threadIdx.x;
    const BlockInfo binfo(params, batch_idx);
    const int rows_left = binfo.seqlen_q - m_block * kBlockM;
    if (rows_left <= 0) { return; }
    const float* src = params.dq_accum_ptr + binfo.dq_accum_row(params, batch_idx, head_idx) * kHeadDim +
                       m_block * (kBlockM * kHeadDim) + tidx * kVec;
    bool written = true;
    if constexpr (kFlagged) {
        written = !params.dq_accum_stored || *dq_turn_flag<kBlockM>(params, batch_idx, head_idx, m_block) != 0;
    }

    extern __shared__ __align__(128) char smem[];
    Tensor sdQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                             typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
    Tensor sdQ_chunks = local_tile(sdQ, Shape<Int<kBlockM>, Int<kDqChunk>>{},
                                   make_coord(0, _));  // (kBlockM, kDqChunk, chunk)
    typename Traits::TiledMmadQ mma_dq;
    auto smem_tiled_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dq);
    auto smem_thr_copy = smem_tiled_copy.get_thread_slice(tidx);
    // The mma.sync traits' staging store (one thread's register values to its own 4 B of shared memory) has its
    // partitions built by smem_partition_D from the register view's shape; the Hopper traits' stmatrix spreads a
    // thread's registers over other threads' rows, which that shape does not describe, and keeps CuTe's.
    constexpr bool kOwnPartitions = std::is_same_v<typename Traits::SmemCopyAtomStore,
                                                   Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>>;
    using AccShape = decltype(shape(partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDqChunk>>{})));
    auto tdQsdQ = [&] {
        if constexpr (kOwnPartitions) {
            return smem_partition_D<decltype(smem_tiled_copy)>(
                sdQ_chunks, tidx,
                append(shape(smem_thr_copy.retile_S(make_tensor<Element>(AccShape{}))),
                       Int<kHeadDim / kDqChunk>{}));  // (CPY, CPY_M, CPY_D, chunk)
        } else {
            return smem_thr_copy.partition_D(sdQ_chunks);  // (CPY, CPY_M, CPY_D, chunk)
        }
    }();
    CUTE_UNROLL
    for (int chunk = 0; chunk < kHeadDim / kDqChunk; ++chunk) {
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDqChunk>>{});  // (MMA, MMA_M, MMA_D)
        const float* chunk_src = src + chunk * (kBlockM * kDqChunk);
        CUTE_UNROLL
        for (int g = 0; g < size(acc_dq) / kVec; ++g) {
            const float* group = chunk_src + g * Traits::kNThreads * kVec;
            if constexpr (kVec == 4) {
                const float4 v = written ? *reinterpret_cast<const float4*>(group) : make_float4(0.f, 0.f, 0.f, 0.f);
                acc_dq(4 * g) = v.x;
                acc_dq(4 * g + 1) = v.y;
                acc_dq(4 * g + 2) = v.z;
                acc_dq(4 * g + 3) = v.w;
            } else {
                acc_dq(g) = written ? *group : 0.f;
            }
        }
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); ++i) { acc_dq(i) *= params.softmax_scale; }
        Tensor rdQ = convert_fragment<Element>(acc_dq);
        copy(smem_tiled_copy, smem_thr_copy.retile_S(rdQ), tdQsdQ(_, _, _, chunk));
    }
    __syncthreads();
    typename Traits::GmemTiledCopyStore gmem_tiled_copy_store;
    auto gmem_thr_copy_store = gmem_tiled_copy_store.get_thread_slice(tidx);
    Tensor gdQ = local_tile(binfo.dq_view<Element>(params, batch_idx, head_idx), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                            make_coord(m_block, 0));  // (kBlockM, kHeadDim)
    Tensor cdQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (kBlockM, kHeadDim) -> (row, col)
    Tensor tdQgdQ = gmem_thr_copy_store.partition_D(gdQ);  // (CPY, CPY_M, CPY_D)
    auto tdQsdQ_store = [&] {
        if constexpr (kOwnPartitions) {
            return smem_partition_S<typename Traits::GmemTiledCopyStore>(sdQ, tidx, tdQgdQ);  // (CPY, CPY_M, CPY_D)
        } else {
            return gmem_thr_copy_store.partition_S(sdQ);  // (CPY, CPY_M, CPY_D)
        }
    }();
    copy_to_gmem(gmem_tiled_copy_store, tdQsdQ_store, tdQgdQ, gmem_thr_copy_store.partition_D(cdQ), rows_left,
                 params.head_dim);
}

}  // namespace flash
