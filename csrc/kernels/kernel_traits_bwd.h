// Tile shapes, MMA and copy atoms, and shared-memory layouts of the mma.sync backward kernel
// (flash_bwd_kernel.h), which only consumes these types.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/kernel_traits_fwd.h"  // the MMA atom, swizzle atom and global-copy layout both passes share

namespace flash {

using namespace cute;

// Warp layout of one backward GEMM with a (kExtentM, kExtentN) output on 8 warps: 2x4 when N splits into
// 64-column slices and M into 32-row slices, else 4x2. Each warp then owns a 32x32 or larger piece
// whenever the tile allows, so every ldmatrix feeds at least two MMAs.
template <class MmaAtom, int kExtentM, int kExtentN>
struct BwdWarpTiling {
    static constexpr int kWarpsN = (kExtentN % 64 == 0 && kExtentM < 128) ? 4 : 2;
    static constexpr int kWarpsM = 8 / kWarpsN;
    static_assert(kExtentM % (16 * kWarpsM) == 0 && kExtentN % (16 * kWarpsN) == 0, "tile must cover the warp layout");
    using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                              Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;
};

// BwdWarpTiling's warps, each owning runs of kRun consecutive columns (up to 32) instead of 8-column groups
// 8 * kWarpsN apart: the column permutation sends MMA column v + 8 w + 8 kWarpsN r (atom column v, warp w, repeat
// r) to v + kRun w + 8 r. Dropout draws sixteen elements per Philox call from 32 consecutive keys (dropout.h):
// with runs of 32 a thread uses every byte of the calls it makes, with 8-column groups 32 apart a quarter.
template <class MmaAtom, int kExtentM, int kExtentN>
struct BwdKeyRunsTiling {
    using Warps = BwdWarpTiling<MmaAtom, kExtentM, kExtentN>;
    static constexpr int kRun = kExtentN / Warps::kWarpsN < 32 ? kExtentN / Warps::kWarpsN : 32;
    static_assert(kRun % 8 == 0 && kExtentN % (kRun * Warps::kWarpsN) == 0, "runs must tile the columns");
    using ColumnOrder = Layout<Shape<_8, Int<Warps::kWarpsN>, Int<kRun / 8>>, Stride<_1, Int<kRun>, _8>>;
    using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<Warps::kWarpsM>, Int<Warps::kWarpsN>, _1>>,
                              Tile<Int<16 * Warps::kWarpsM>, ColumnOrder, _16>>;
};

// Backward: one CTA owns kBlockN keys of one query head and walks the query blocks of kBlockM rows.
// Five GEMMs with three shapes, each with its own warp layout: S = Q K^T and dP = dO V^T are
// (kBlockM, kBlockN); dV += P^T dO and dK += dS^T Q are (kBlockN, kHeadDim); dQ = dS K is
// (kBlockM, kHeadDim). Operands a GEMM needs transposed are read through transposed shared-memory
// views with transposing ldmatrix.
// kSmemBudget: the shared memory per block the kernel's tile set is made for (tile_size.h), which decides its Q
// stages. kVInRegs: V is read into registers once, as dP = dO V^T's B operand, and its shared memory then holds
// P and dS, which saves their 2 * kBlockM * kBlockN elements where the budget has no room for them.
// kHeadDimV: V's, dO's and dV's head dim, below kHeadDim in a narrow-V kernel (tile_size.h, NarrowVShape).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kSmemBudget, bool kVInRegs_ = false,
          int kHeadDimV_ = kHeadDim_>
struct BwdKernelTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr bool kVInRegs = kVInRegs_;
    static constexpr int kNWarps = 8;
    static constexpr int kNThreads = kNWarps * 32;

    static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0 && kBlockM % 64 == 0 && kBlockN % 32 == 0,
                  "tiles must cover the warp layouts");
    static_assert(kHeadDimV <= kHeadDim && (!kVInRegs || kHeadDimV == kHeadDim),
                  "a narrower V keeps V in shared memory");

    using MmaAtom = typename FwdKernelTraits<Element, kHeadDim, 64, 64, 4>::MmaAtom;
    using TiledMmaSdP = typename BwdWarpTiling<MmaAtom, kBlockM, kBlockN>::TiledMma;
    // S and dP of the variants kernel, whose dropout wants consecutive keys per warp. The plain kernels keep
    // the default layout: they draw nothing, and their speed was measured with it.
    using TiledMmaSdPKeyRuns = typename BwdKeyRunsTiling<MmaAtom, kBlockM, kBlockN>::TiledMma;
    using TiledMmadKV = typename BwdWarpTiling<MmaAtom, kBlockN, kHeadDim>::TiledMma;
    using TiledMmadV = typename BwdWarpTiling<MmaAtom, kBlockN, kHeadDimV>::TiledMma;  // dKV's at kHeadDimV
    using TiledMmadQ = typename BwdWarpTiling<MmaAtom, kBlockM, kHeadDim>::TiledMma;

    // dQ is produced kDqChunk head-dim columns at a time. Its accumulator lives next to dK and dV
    // (kBlockN * kHeadDim / 128 registers); at head dim 256 one full-width dQ would push that past 255.
    static constexpr int kDqChunk = kHeadDim > 224 ? kHeadDim / 2 : kHeadDim;
    static_assert(kDqChunk % (16 * BwdWarpTiling<MmaAtom, kBlockM, kHeadDim>::kWarpsN) == 0);

    using FwdTraits = FwdKernelTraits<Element, kHeadDim, 64, 64, 4, kHeadDimV>;
    using SmemAtomD = typename FwdTraits::SmemLayoutAtom;  // rows of head_dim
    using SmemAtomDV = typename FwdTraits::template SmemLayoutAtomOf<kHeadDimV>;  // rows of V's head dim
    // Rows of keys: 64 wide (128 B, all eight 16 B chunks swizzled) where the key block allows, else 32.
    static constexpr int kSmemRowKeys = kBlockN % 64 == 0 ? 64 : 32;
    using SmemAtomN = decltype(composition(Swizzle<kSmemRowKeys == 64 ? 3 : 2, 3, 3>{},
                                           Layout<Shape<_8, Int<kSmemRowKeys>>, Stride<Int<kSmemRowKeys>, _1>>{}));

    using SmemLayoutQ = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutdO = decltype(tile_to_shape(SmemAtomDV{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K
    using SmemLayoutV = decltype(tile_to_shape(SmemAtomDV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
    using SmemLayoutPdS = decltype(tile_to_shape(SmemAtomN{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));  // P and dS
    // Transposed views: (kHeadDim, kBlockM) of Q, (kHeadDimV, kBlockM) of dO, (kHeadDim, kBlockN) of K,
    // (kBlockN, kBlockM) of P and dS.
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));
    using SmemLayoutdOt = decltype(composition(
        SmemLayoutdO{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));
    using SmemLayoutKt = decltype(composition(
        SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
    using SmemLayoutPdSt = decltype(composition(
        SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemdOElems = cosize_v<SmemLayoutdO>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;  // K's
    static constexpr int kSmemVElems = cosize_v<SmemLayoutV>;
    static constexpr int kSmemPdSElems = cosize_v<SmemLayoutPdS>;
    // Per stage: Q and dO tiles, then the LSE and D of their rows (fp32).
    static constexpr int kSmemStageBytes = (kSmemQElems + kSmemdOElems) * int(sizeof(Element)) +
                                           2 * kBlockM * int(sizeof(float));
    static_assert(!kVInRegs || 2 * kSmemPdSElems <= kSmemVElems, "P and dS must fit in V's buffer");
    static constexpr int kSmemFixedBytes = (kSmemKVElems + kSmemVElems + (kVInRegs ? 0 : 2 * kSmemPdSElems)) *
                                           int(sizeof(Element));
    // Q and dO are double-buffered (the next query block loads while this one computes) when that fits the
    // budget; otherwise the next block loads during the dQ GEMM.
    static constexpr int kSmemLimitBytes = kSmemBudget;
    static constexpr int kStagesQ = kSmemFixedBytes + 2 * kSmemStageBytes <= kSmemLimitBytes ? 2 : 1;
    static constexpr int kSmemBytes = kSmemFixedBytes + kStagesQ * kSmemStageBytes;
    static_assert(kSmemBytes <= kSmemLimitBytes);

    using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
    using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

    // Global <-> shared: 16 B per thread and access, a row of the shared-memory atom of kCols columns covered by
    // its width / 8 threads.
    template <int kCols>
    static constexpr int kGmemThreadsPerRowOf = FwdTraits::template smem_row_elems<kCols> / 8;
    template <int kCols>
    using GmemThreadLayoutOf =
        Layout<Shape<Int<kNThreads / kGmemThreadsPerRowOf<kCols>>, Int<kGmemThreadsPerRowOf<kCols>>>,
               Stride<Int<kGmemThreadsPerRowOf<kCols>>, _1>>;
    static constexpr int kGmemThreadsPerRow = kGmemThreadsPerRowOf<kHeadDim>;
    using GmemThreadLayout = GmemThreadLayoutOf<kHeadDim>;
    using GmemTiledCopyLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                                       GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyLoadV = decltype(make_tiled_copy(
        Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{}, GmemThreadLayoutOf<kHeadDimV>{},
        Layout<Shape<_1, _8>>{}));
    // dK and dV leave through shared memory (K's and V's buffers), 16 B per thread and access.
    using GmemTiledCopyStore = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{},
                                                        GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyStoreV = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{},
                                                         GmemThreadLayoutOf<kHeadDimV>{}, Layout<Shape<_1, _8>>{}));
};

}  // namespace flash
