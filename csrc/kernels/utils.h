// Small device helpers of the mma.sync kernels (and tile copies the Hopper kernels share): register-layout
// views of MMA accumulators, fragment conversion, warp-quad reductions, the two GEMM shapes (both operands
// in smem, or A in registers), a zero-filling global -> shared tile copy, its predicated shared -> global
// counterpart, and views of pipeline stages.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flash {

using namespace cute;

// An SM80 accumulator fragment is ((2 cols, 2 row halves), MMA_M, MMA_N). Viewed as
// (rows, cols) = ((2, MMA_M), (2, MMA_N)) so softmax code can loop over rows and columns.
template <class Layout>
__forceinline__ __device__ auto acc_rowcol_layout(Layout acc) {
    static_assert(decltype(rank<0>(acc))::value == 2 && decltype(size<0>(acc))::value == 4);
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class Engine, class Layout>
__forceinline__ __device__ auto as_rowcol(Tensor<Engine, Layout>& acc) {
    return make_tensor(acc.data(), acc_rowcol_layout(acc.layout()));
}

// Two neighbouring 16x8 accumulator tiles hold exactly the values of one 16x16 A-operand tile,
// so the probabilities can feed the second GEMM without leaving registers:
// ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N / 2).
template <class Layout>
__forceinline__ __device__ auto acc_as_a_operand_layout(Layout acc) {
    static_assert(decltype(size<2>(acc))::value % 2 == 0, "needs pairs of N tiles");
    auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
    return make_layout(make_layout(get<0, 0>(split), get<0, 1>(split), get<2, 0>(split)), get<1>(split),
                       get<2, 1>(split));
}

template <typename To, class Engine, class Layout>
__forceinline__ __device__ auto convert_fragment(const Tensor<Engine, Layout>& src) {
    using From = typename Engine::value_type;
    constexpr int kN = decltype(size(src))::value;
    auto frag = *reinterpret_cast<const cutlass::Array<From, kN>*>(src.data());
    cutlass::NumericArrayConverter<To, From, kN> convert;
    auto out = convert(frag);
    Tensor dst = make_tensor<To>(src.layout());
    *reinterpret_cast<cutlass::Array<To, kN>*>(dst.data()) = out;
    return dst;
}

// A thread's register fragment of tiled_mma's A (or B) operand for a shared-memory tile: sized from the tile's
// shape alone. ThrMMA::partition_fragment_A(tile) partitions the tile itself first; that made the same PTX for
// the mma.sync kernels, but on the swizzled layouts the partitions cost the compiler's front end about half a GiB
// per backward kernel (docs/design-notes.md, 'Where a backward kernel's compile memory goes').
template <class Element, class TiledMma, class SmemTile>
__forceinline__ __device__ auto register_fragment_A(const TiledMma& tiled_mma, const SmemTile& tile) {
    return make_tensor<Element>(partition_shape_A(tiled_mma, shape(tile)));
}
template <class Element, class TiledMma, class SmemTile>
__forceinline__ __device__ auto register_fragment_B(const TiledMma& tiled_mma, const SmemTile& tile) {
    return make_tensor<Element>(partition_shape_B(tiled_mma, shape(tile)));
}

// Each row of an accumulator is spread over the 4 threads of a quad (lanes 4r..4r+3).
template <class Op>
__forceinline__ __device__ float quad_allreduce(float x, Op op) {
    x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
    x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
    return x;
}

// The default after_k of gemm_smem_smem: nothing.
struct NoAfterK {
    __forceinline__ __device__ void operator()(int) const {}
};

// acc += A B^T with A and B in shared memory; the ldmatrix of k-slice i+1 is issued before the
// MMAs of slice i so shared-memory latency hides behind tensor-core work. after_k(k) runs after the MMAs
// of slice k, in the GEMM's basic block; ptxas still schedules it by its dependencies, so work that needs
// nothing from the GEMM may be issued ahead of it; what the callback buys is one basic block, no branch between.
template <class TiledMma, class AccTensor, class RegA, class RegB, class SmemA, class SmemB, class CopyA, class CopyB,
          class AfterK = NoAfterK>
__forceinline__ __device__ void gemm_smem_smem(const TiledMma& tiled_mma, AccTensor& acc, RegA& tCrA, RegB& tCrB,
                                               const SmemA& tCsA, const SmemB& tCsB, const CopyA& copy_a,
                                               const CopyB& copy_b, auto& tCrA_view, auto& tCrB_view,
                                               AfterK after_k = {}) {
    copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
    copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
        if (k + 1 < size<2>(tCrA)) {
            copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
            copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
        }
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
        after_k(k);
    }
}

// acc += A B^T with A already in registers and B in shared memory.
template <class TiledMma, class AccTensor, class RegA, class RegB, class SmemB, class CopyB>
__forceinline__ __device__ void gemm_reg_smem(const TiledMma& tiled_mma, AccTensor& acc, const RegA& tCrA, RegB& tCrB,
                                              const SmemB& tCsB, const CopyB& copy_b, auto& tCrB_view) {
    copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
        if (k + 1 < size<2>(tCrA)) { copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1)); }
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    }
}

// acc += A B^T with A in shared memory and B already in registers.
template <class TiledMma, class AccTensor, class RegA, class RegB, class SmemA, class CopyA>
__forceinline__ __device__ void gemm_smem_reg(const TiledMma& tiled_mma, AccTensor& acc, RegA& tCrA, const RegB& tCrB,
                                              const SmemA& tCsA, const CopyA& copy_a, auto& tCrA_view) {
    copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
        if (k + 1 < size<2>(tCrA)) { copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1)); }
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    }
}

// Copies a (CPY, CPY_ROWS, CPY_COLS) partition global -> shared with cp.async, zero-filling every
// 16 B chunk whose row is >= max_row or whose column is >= max_col. coords holds the chunk positions.
template <class TiledCopy, class SrcTensor, class DstTensor, class CoordTensor>
__forceinline__ __device__ void copy_zfill(const TiledCopy& tiled_copy, const SrcTensor& src, DstTensor& dst,
                                           const CoordTensor& coords, int max_row, int max_col) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
        const bool row_ok = get<0>(coords(0, m, 0)) < max_row;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(src); ++k) {
            const bool ok = row_ok && get<1>(coords(0, m, k)) < max_col;
            copy(tiled_copy.with(ok), src(_, m, k), dst(_, m, k));
        }
    }
}

// Copies a (CPY, CPY_ROWS, CPY_COLS) partition shared -> global through registers, skipping every 16 B
// chunk whose row is >= max_row or whose column is >= max_col. coords holds the chunk positions.
template <class TiledCopy, class SrcTensor, class DstTensor, class CoordTensor>
__forceinline__ __device__ void copy_to_gmem(const TiledCopy& tiled_copy, const SrcTensor& src, DstTensor&& dst,
                                             const CoordTensor& coords, int max_row, int max_col) {
    Tensor reg = make_tensor<typename SrcTensor::value_type>(shape(src));  // (CPY, CPY_ROWS, CPY_COLS)
    copy(tiled_copy, src, reg);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(reg); ++m) {
        if (get<0>(coords(0, m, 0)) >= max_row) { continue; }
        CUTE_UNROLL
        for (int k = 0; k < size<2>(reg); ++k) {
            if (get<1>(coords(0, m, k)) < max_col) { copy(tiled_copy, reg(_, m, k), dst(_, m, k)); }
        }
    }
}

// A view of the same tensor one pipeline stage further on in shared memory. Stages are whole
// multiples of the swizzle period apart, so offsetting the pointer equals offsetting the layout.
template <int kStageElems, class SmemTensor>
__forceinline__ __device__ auto at_stage(const SmemTensor& t, int stage) {
    return make_tensor(t.data() + stage * kStageElems, t.layout());
}

}  // namespace flash
