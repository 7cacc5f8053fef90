// Register-layout views of warpgroup-MMA (wgmma) accumulators, the warpgroup GEMM calls, and opaque_int,
// which keeps per-thread addresses from being hoisted out of the Hopper main loops.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

// A 64xN wgmma accumulator holds, per thread, ((2 cols, 2 row halves, N/8 column groups), MMA_M, MMA_N).
// Viewed as (rows, cols) = ((2, MMA_M), ((2, N/8), MMA_N)) so the softmax and masks can loop over rows.
template <class Layout>
__forceinline__ __device__ auto gmma_acc_rowcol_layout(Layout acc) {
    static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                  decltype(size<0, 1>(acc))::value == 2);
    return make_layout(make_layout(layout<0, 1>(acc), layout<1>(acc)),
                       make_layout(layout<0, 0>(acc), layout<0, 2>(acc), layout<2>(acc)));
}

template <class Engine, class Layout>
__forceinline__ __device__ auto gmma_as_rowcol(Tensor<Engine, Layout>& acc) {
    return make_tensor(acc.data(), gmma_acc_rowcol_layout(acc.layout()));
}

// The accumulator values of 16 consecutive columns are exactly one 64x16 A-operand slice of a
// register-sourced wgmma, so P feeds O += P V without leaving registers:
// ((2, 2, N/8), MMA_M, 1) -> ((2, 2, 2), MMA_M, N/16).
template <class Layout>
__forceinline__ __device__ auto gmma_acc_as_a_operand_layout(Layout acc) {
    static_assert(decltype(size<2>(acc))::value == 1, "one wgmma spans the whole key block");
    static_assert(decltype(size<0, 2>(acc))::value % 2 == 0, "needs pairs of 8-column groups");
    auto groups = logical_divide(layout<0, 2>(acc), Shape<_2>{});  // ((2, N/16))
    return make_layout(make_layout(layout<0, 0>(acc), layout<0, 1>(acc), layout<0, 0>(groups)), layout<1>(acc),
                       layout<0, 1>(groups));
}

// acc (+)= A B over the K mode of the fragments, issued as one wgmma batch by each warpgroup and not waited
// for: the caller later runs warpgroup_wait<N>() (N = batches it lets stay in flight) and fences acc.
// kZeroInit starts from acc = 0 without clearing registers. A register-sourced A must stay untouched
// until its batch has completed.
// The K steps [kBegin, kEnd) only (kEnd = -1: to the last), so that one GEMM can be issued as two batches with other
// work between them.
template <bool kZeroInit, int kBegin = 0, int kEnd = -1, class TiledMma, class TensorA, class TensorB, class TensorC>
__forceinline__ __device__ void warpgroup_gemm_issue(TiledMma& tiled_mma, TensorA& tCrA, const TensorB& tCrB,
                                                     TensorC& acc) {
    constexpr int kSteps = decltype(size<2>(tCrA))::value;
    constexpr int kLast = kEnd < 0 ? kSteps : kEnd;
    static_assert(0 <= kBegin && kBegin < kLast && kLast <= kSteps);
    static_assert(!kZeroInit || kBegin == 0, "only the first batch can start from zero");
    // A is either wgmma shared-memory descriptors or register values.
    constexpr bool kARegisters = !is_same_v<typename TensorA::value_type, GMMA::DescriptorIterator::value_type>;
    if constexpr (kARegisters) { warpgroup_fence_operand(tCrA); }
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    if constexpr (kZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
    CUTE_UNROLL
    for (int k = kBegin; k < kLast; ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
}

// Waits until at most kInFlight wgmma batches of this warpgroup are pending, then fences acc so no read of
// it moves above the wait.
template <int kInFlight, class TensorC>
__forceinline__ __device__ void warpgroup_wait_for(TensorC& acc) {
    warpgroup_wait<kInFlight>();
    warpgroup_fence_operand(acc);
}

// warpgroup_gemm_issue, then wait for it.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
__forceinline__ __device__ void warpgroup_gemm(TiledMma& tiled_mma, TensorA& tCrA, const TensorB& tCrB, TensorC& acc) {
    warpgroup_gemm_issue<kZeroInit>(tiled_mma, tCrA, tCrB, acc);
    warpgroup_wait_for<0>(acc);
    if constexpr (!is_same_v<typename TensorA::value_type, GMMA::DescriptorIterator::value_type>) {
        warpgroup_fence_operand(tCrA);
    }
}

// A 16-bit accumulator fragment rO (tiled_mma's C layout, thread tidx's part) into the shared-memory tile sO by
// stmatrix: four 8 x 8 tiles of 16-bit values an instruction, from a partition whose per-thread part is one base
// address. Element-wise stores computed each element's swizzled address and stored 16 bits at a time: in the
// warp-specialized forward's epilogue 64 stores and their arithmetic per thread at head dim 128, with spills.
template <class TiledMma, class FragmentO, class SmemTensorO>
__forceinline__ __device__ void store_fragment_to_smem(const TiledMma& tiled_mma, int tidx, const FragmentO& rO,
                                                       SmemTensorO& sO) {
    using Element = typename FragmentO::value_type;
    static_assert(sizeof(Element) == 2, "stmatrix moves 16-bit values");
    auto smem_tiled_copy_O = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma);
    auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
    Tensor tOrO = smem_thr_copy_O.retile_S(rO);  // ((Atom, AtomNum), MMA_M, MMA_N)
    Tensor tOsO = smem_thr_copy_O.partition_D(sO);  // ((Atom, AtomNum), PIPE_M, PIPE_N)
    copy(smem_tiled_copy_O, tOrO, tOsO);
}

// Returns x unchanged, but the compiler can no longer see where it came from: values computed from the
// result inside a loop are recomputed there instead of being hoisted out and held (or spilled) across it.
__forceinline__ __device__ int opaque_int(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

}  // namespace flash
