// The wgmma operations of the Hopper kernels' TiledMMAs: CuTe's, and a few shapes of our own.
//
// CuTe's ss_op_selector/rs_op_selector pick the widest wgmma N that divides a GEMM's N, from N = 8, 16, 32, 64,
// 96, 128, 192 and 256, or from every multiple of 8 with its extended-shapes header, which costs each file that
// includes it 16-23 s of front end. The GEMMs that need another N (csrc/generate.py, WGMMA_SS_SHAPES_N) get an
// operation of our own here, with the fma that csrc/generated/wgmma_shapes.h generates, so that no file includes
// that header.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include "generated/wgmma_shapes.h"

namespace flash {

// One wgmma of 64 x N x 16, fp32 accumulators, both operands through shared-memory descriptors (kMajorA/B: which
// mode of A/B is contiguous there).
template <class Element, int N, cute::SM90::GMMA::Major kMajorA, cute::SM90::GMMA::Major kMajorB>
struct WgmmaSs64xNx16F32 : WgmmaSsFma<Element, N, kMajorA, kMajorB> {
    using DRegisters = void;
    using ARegisters = uint64_t[1];
    using BRegisters = uint64_t[1];
    using CRegisters = float[N / 2];
};

constexpr bool has_own_wgmma_ss_shape(int n) {
    for (int own : kWgmmaSsShapesN) {
        if (own == n) { return true; }
    }
    return false;
}

// CuTe's wgmma fma takes the accumulators in place of C and D; MMA_Atom finds this by argument-dependent lookup
// (our operation's namespace) and hands it to CuTe's, as CuTe's own operations get it from theirs.
template <class Element, int N, cute::SM90::GMMA::Major kMajorA, cute::SM90::GMMA::Major kMajorB, class TD,
          class DLayout, class TA, class ALayout, class TB, class BLayout, class TC, class CLayout>
CUTE_HOST_DEVICE constexpr void mma_unpack(
    cute::MMA_Traits<WgmmaSs64xNx16F32<Element, N, kMajorA, kMajorB>> const& traits, cute::Tensor<TD, DLayout>& D,
    cute::Tensor<TA, ALayout> const& A, cute::Tensor<TB, BLayout> const& B, cute::Tensor<TC, CLayout> const& C) {
    cute::SM90::GMMA::mma_unpack(traits, D, A, B, C);
}

// CuTe's ss_op_selector, with our operations for the N it offers only with its extended shapes. One wgmma spans
// the GEMM's whole N where CuTe's extended selector would pick that N (the widest multiple of 8 dividing it).
template <class ElementA, class ElementB, class ElementC, class TileShapeMNK,
          cute::SM90::GMMA::Major kMajorA = cute::SM90::GMMA::Major::K,
          cute::SM90::GMMA::Major kMajorB = cute::SM90::GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto wgmma_ss_op_selector() {
    constexpr int kN = cute::size<1>(TileShapeMNK{});
    if constexpr (has_own_wgmma_ss_shape(kN) && std::is_same_v<ElementC, float>) {
        static_assert(std::is_same_v<ElementA, ElementB>, "one operand dtype");
        static_assert(cute::size<0>(TileShapeMNK{}) % 64 == 0 && cute::size<2>(TileShapeMNK{}) % 16 == 0,
                      "whole 64 x N x 16 wgmmas");
        return WgmmaSs64xNx16F32<ElementA, kN, kMajorA, kMajorB>{};
    } else {
        return cute::SM90::GMMA::ss_op_selector<ElementA, ElementB, ElementC, TileShapeMNK, kMajorA, kMajorB>();
    }
}

}  // namespace flash

namespace cute {

template <class Element, int N, SM90::GMMA::Major kMajorA, SM90::GMMA::Major kMajorB>
struct MMA_Traits<flash::WgmmaSs64xNx16F32<Element, N, kMajorA, kMajorB>> {
    using ValTypeD = float;
    using ValTypeA = Element;
    using ValTypeB = Element;
    using ValTypeC = float;

    using FrgTypeA = SM90::GMMA::smem_desc<kMajorA>;
    using FrgTypeB = SM90::GMMA::smem_desc<kMajorB>;

    using Shape_MNK = Shape<_64, Int<N>, _16>;
    using ThrID = Layout<_128>;
    using ALayout = SM90::GMMA::ABLayout<64, 16>;
    using BLayout = SM90::GMMA::ABLayout<N, 16>;
    using CLayout = SM90::GMMA::CLayout_64xN<N>;

    SM90::GMMA::ScaleOut accumulate_ = SM90::GMMA::ScaleOut::One;
};

}  // namespace cute
