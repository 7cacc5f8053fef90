// Tile shapes, warpgroup MMAs and shared-memory layouts of the Hopper (sm_90a) forward kernel
// (flash_fwd_sm90_kernel.h), which only consumes these types. The Hopper backward traits
// (kernel_traits_bwd_sm90.h) reuse its global-copy atoms.
#pragma once

#include <type_traits>

#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

// One CTA holds kBlockM / 64 warpgroups; each owns 64 query rows end to end (split-Q at warpgroup
// granularity), and reads its MMA operands straight from shared memory with wgmma.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kCtasPerSm_>
struct FwdSm90KernelTraits {
    using Element = Element_;
    using ElementAccum = float;

    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarpgroups = kBlockM / 64;
    static constexpr int kNThreads = kNWarpgroups * 128;
    static constexpr int kCtasPerSm = kCtasPerSm_;  // caps registers per thread at 64K / (kNThreads * kCtasPerSm)

    static_assert(kBlockM % 64 == 0, "a warpgroup MMA covers 64 query rows");
    static_assert(kHeadDim % 32 == 0, "shared-memory rows of whole 64 B or 128 B swizzle atoms");
    static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "wgmma N is at most 256");

    using WarpgroupLayout = Layout<Shape<Int<kNWarpgroups>, _1, _1>>;
    // S = Q K^T: both operands in shared memory, head dim contiguous (K-major).
    using TiledMmaS = decltype(make_tiled_mma(
        SM90::GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
        WarpgroupLayout{}));
    // O += P V: P from registers, V^T read from V's buffer, where the head dim (O's N) is contiguous.
    using TiledMmaO = decltype(make_tiled_mma(
        SM90::GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                                   GMMA::Major::K, GMMA::Major::MN>(),
        WarpgroupLayout{}));

    // 8 rows of 64 elements with the 128 B swizzle where the head dim is a multiple of 64, else 8 rows of 32
    // elements with the 64 B swizzle (head dims 32, 96, 160, 224).
    static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
    using SmemAtom =
        std::conditional_t<kSmemRowElems == 64, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>;
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    // V viewed as (kHeadDim, kBlockN), the B operand of O += P V.
    using SmemLayoutVt = decltype(composition(
        SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
    using SmemLayoutO = SmemLayoutQ;  // the output tile reuses Q's buffer

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
    // Q, then stages of (K, V): with three, two key blocks are in flight while one computes, which
    // memory-bound calls (decoding) need to keep the loads streaming; two where three do not fit.
    static constexpr int kStagesKV = (kSmemQElems + 6 * kSmemKVElems) * int(sizeof(Element)) * kCtasPerSm <= 227 * 1024
                                         ? 3
                                         : 2;
    static constexpr int kSmemBytes = (kSmemQElems + 2 * kStagesKV * kSmemKVElems) * int(sizeof(Element));
    static_assert(kSmemBytes * kCtasPerSm <= 227 * 1024, "sm_90 has 227 KiB of shared memory per SM for blocks");

    // Global <-> shared: 16 B per thread access, one thread per 8 elements of a shared-memory row.
    static constexpr int kGmemThreadsPerRow = kSmemRowElems / 8;
    using GmemThreadLayout = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                    Stride<Int<kGmemThreadsPerRow>, _1>>;
    // Zero-filling cp.async: rows past the sequence end and columns past head_dim read as 0.
    using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                                      GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreadLayout{},
                                                    Layout<Shape<_1, _8>>{}));
};

}  // namespace flash
