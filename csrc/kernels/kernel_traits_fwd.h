// Tile shapes, MMA and copy atoms, and shared-memory layouts of the mma.sync forward kernel
// (flash_fwd_kernel.h), which only consumes these types. The backward traits (kernel_traits_bwd.h) reuse
// its MMA atom, swizzle atom and global-copy thread layout, so both passes read memory the same way.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

// kHeadDimV: V's and the output's head dim, kHeadDim's unless V is narrower than Q and K (narrow_v_shape in
// tile_size.h: DeepSeek's 192 and 128).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kHeadDimV_ = kHeadDim_>
struct FwdKernelTraits {
    using Element = Element_;
    using ElementAccum = float;

    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;

    static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0, "head dims must be multiples of 32");
    static_assert(kHeadDimV <= kHeadDim, "a V wider than Q and K runs at its own head dim, Q and K zero-padded");
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles of the query block");
    static_assert(kBlockN % 16 == 0, "key block must be a multiple of the MMA's 16-column B tile");

    // Split-Q: warps tile the query rows only, so each warp owns its rows end to end.
    using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                       MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
    using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

    // Shared memory rows are 64 elements (128 B) wide when the head dim allows it, else 32 (64 B);
    // the swizzle spreads the 16 B chunks of 8 consecutive rows over all banks for ldmatrix.
    // V and the output take the same at their own head dim.
    template <int kCols>
    static constexpr int smem_row_elems = kCols % 64 == 0 ? 64 : 32;
    template <int kCols>
    using SmemLayoutAtomOf = decltype(composition(
        Swizzle<smem_row_elems<kCols> == 64 ? 3 : 2, 3, 3>{},
        Layout<Shape<_8, Int<smem_row_elems<kCols>>>, Stride<Int<smem_row_elems<kCols>>, _1>>{}));
    static constexpr int kSmemRowElems = smem_row_elems<kHeadDim>;
    using SmemLayoutAtom = SmemLayoutAtomOf<kHeadDim>;

    using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    using SmemLayoutV = decltype(tile_to_shape(SmemLayoutAtomOf<kHeadDimV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
    // V viewed as (kHeadDimV, kBlockN): the B operand of O += P V.
    using SmemLayoutVt = decltype(composition(
        SmemLayoutV{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
    // The output tile reuses Q's buffer.
    using SmemLayoutO = decltype(tile_to_shape(SmemLayoutAtomOf<kHeadDimV>{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
    static constexpr int kSmemVElems = cosize_v<SmemLayoutV>;
    static_assert(cosize_v<SmemLayoutO> <= kSmemQElems, "the output stages in Q's buffer");
    static constexpr int kSmemBytes = (kSmemQElems + kSmemKVElems + kSmemVElems) * int(sizeof(Element));

    using SmemCopyAtomQK = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomVt = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
    using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

    // Global <-> shared: every thread moves 16 B (8 elements) per access, a row of the
    // shared-memory atom is covered by kSmemRowElems / 8 threads.
    static constexpr int kGmemElemsPerAccess = 8;
    static constexpr int kGmemThreadsPerRow = kSmemRowElems / kGmemElemsPerAccess;
    static_assert(kNThreads % kGmemThreadsPerRow == 0);
    template <int kCols>
    using GmemThreadLayoutOf = Layout<Shape<Int<kNThreads / (smem_row_elems<kCols> / kGmemElemsPerAccess)>,
                                            Int<smem_row_elems<kCols> / kGmemElemsPerAccess>>,
                                      Stride<Int<smem_row_elems<kCols> / kGmemElemsPerAccess>, _1>>;
    using GmemThreadLayout = GmemThreadLayoutOf<kHeadDim>;
    // Zero-filling cp.async: rows past the sequence end and columns past head_dim read as 0.
    using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                                      GmemThreadLayout{},
                                                      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
    // V's rows, at V's head dim (GmemTiledCopyQKV's type where that is kHeadDim).
    using GmemTiledCopyV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                                    GmemThreadLayoutOf<kHeadDimV>{},
                                                    Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{},
                                                    GmemThreadLayoutOf<kHeadDimV>{},
                                                    Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
};

}  // namespace flash
