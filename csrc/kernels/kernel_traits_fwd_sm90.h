// Tile shapes, warpgroup MMAs and shared-memory layouts of the Hopper (sm_90a) forward kernels
// (flash_fwd_sm90_kernel.h and the warp-specialized flash_fwd_sm90_ws_kernel.h), which only consume these types.
// The Hopper backward traits (kernel_traits_bwd_sm90.h) reuse the first one's global-copy atoms.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/wgmma_ops.h"
#include "launch/flash_params.h"

namespace flash {

using namespace cute;

// What both Hopper forward kernels compute with: warpgroups of 64 query rows (kBlockM / 64 of them) whose
// GEMMs read K and V, and Q for S, straight from shared memory by descriptor, and those buffers' swizzled layouts.
// kHeadDimV: V's and the output's head dim, kHeadDim's unless V is narrower than Q and K (the warp-specialized
// kernel's (192, 128), DeepSeek's MLA shape).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kHeadDimV_ = kHeadDim_>
struct FwdSm90Operands {
    using Element = Element_;
    using ElementAccum = float;

    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarpgroups = kBlockM / 64;  // the warpgroups that compute

    static_assert(kBlockM % 64 == 0, "a warpgroup MMA covers 64 query rows");
    static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0, "shared-memory rows of whole 64 B or 128 B swizzle atoms");
    static_assert(kHeadDimV <= kHeadDim, "a V wider than Q and K runs at its own head dim, Q and K zero-padded");

    using WarpgroupLayout = Layout<Shape<Int<kNWarpgroups>, _1, _1>>;
    // S = Q K^T: both operands in shared memory, head dim contiguous (K-major).
    using TiledMmaS = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
        WarpgroupLayout{}));
    // O += P V: P from registers, V^T read from V's buffer, where the head dim (O's N) is contiguous.
    using TiledMmaO = decltype(make_tiled_mma(
        SM90::GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>,
                                   GMMA::Major::K, GMMA::Major::MN>(),
        WarpgroupLayout{}));

    // 8 rows of 64 elements with the 128 B swizzle where the head dim is a multiple of 64, else 8 rows of 32
    // elements with the 64 B swizzle (head dims 32, 96, 160, 224).
    static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
    using SmemAtom =
        std::conditional_t<kSmemRowElems == 64, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>;
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // one block
    // V's and the output's rows, the same way at their own head dim.
    static constexpr int kSmemRowElemsV = kHeadDimV % 64 == 0 ? 64 : 32;
    using SmemAtomV =
        std::conditional_t<kSmemRowElemsV == 64, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>;
    using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));  // one block
};

// One CTA holds kBlockM / 64 warpgroups; each owns 64 query rows end to end (split-Q at warpgroup
// granularity), and all of them load (cp.async) and compute.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kCtasPerSm_>
struct FwdSm90KernelTraits : FwdSm90Operands<Element_, kHeadDim_, kBlockM_, kBlockN_> {
    using Base = FwdSm90Operands<Element_, kHeadDim_, kBlockM_, kBlockN_>;
    using Element = Element_;
    using SmemLayoutQ = typename Base::SmemLayoutQ;
    using SmemLayoutKV = typename Base::SmemLayoutKV;

    static constexpr int kNThreads = Base::kNWarpgroups * 128;
    static constexpr int kCtasPerSm = kCtasPerSm_;  // caps registers per thread at 64K / (kNThreads * kCtasPerSm)

    static_assert(kBlockN_ % 64 == 0 && kBlockN_ <= 256, "wgmma N is at most 256");

    // V viewed as (kHeadDim, kBlockN), the B operand of O += P V.
    using SmemLayoutVt = decltype(composition(
        SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim_>, Int<kBlockN_>>{}, Stride<Int<kBlockN_>, _1>{})));
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
    static constexpr int kGmemThreadsPerRow = Base::kSmemRowElems / 8;
    using GmemThreadLayout = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                    Stride<Int<kGmemThreadsPerRow>, _1>>;
    // Zero-filling cp.async: rows past the sequence end and columns past head_dim read as 0.
    using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                                      GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreadLayout{},
                                                    Layout<Shape<_1, _8>>{}));
};

}  // namespace flash

namespace flash {

// The global view that the warp-specialized kernels' TMA descriptors address: a (batch, seqlen, heads, head_dim)
// tensor as (seqlen, head_dim, heads, batch), head dim contiguous, and the type of a TMA load of tiles of Tile
// elements into SmemLayout from it.
template <typename Element>
struct TmaView {
    using GmemLayout = Layout<Shape<int, int, int, int>, Stride<int64_t, _1, int64_t, int64_t>>;
    // TMA takes every stride as a multiple of 16 bytes; the checks allow any stride on a dimension of size 1, whose
    // only index is 0, so such a stride is replaced by one past the dimensions inside it.
    static auto gmem_tensor(const void* ptr, int seqlen, int head_dim, int heads, int batch, int64_t row_stride,
                            int64_t head_stride, int64_t batch_stride) {
        auto stride_of = [](int size, int64_t stride, int64_t inner_extent) {
            return size > 1 ? stride : (inner_extent + 7) / 8 * 8;
        };
        const int64_t rows = stride_of(seqlen, row_stride, head_dim);
        const int64_t heads_s = stride_of(heads, head_stride, rows * seqlen);
        const int64_t batches = stride_of(batch, batch_stride, heads_s * heads);
        return make_tensor(
            make_gmem_ptr(static_cast<const Element*>(ptr)),
            GmemLayout(make_shape(seqlen, head_dim, heads, batch), make_stride(rows, _1{}, heads_s, batches)));
    }
    using GmemTensor = decltype(gmem_tensor(nullptr, 0, 0, 0, 0, 0, 0, 0));
    template <class SmemLayout, class Tile>
    using Load = decltype(make_tma_atom(SM90_TMA_LOAD{}, std::declval<GmemTensor>(), SmemLayout{}, Tile{}));
    // The TMA load of Tile-sized blocks into SmemLayout from the rows of one of a call's (batch, seqlen, heads,
    // head_dim) tensors (the host encodes its descriptor). Columns past head_dim load as zeros.
    template <class SmemLayout, class Tile>
    static Load<SmemLayout, Tile> load(const void* ptr, int seqlen, int head_dim, int heads, int batch,
                                       int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
        return make_tma_atom(SM90_TMA_LOAD{},
                             gmem_tensor(ptr, seqlen, head_dim, heads, batch, row_stride, head_stride, batch_stride),
                             SmemLayout{}, Tile{});
    }
};

// The warp-specialized Hopper forward (flash_fwd_sm90_ws_kernel.h): one producer warpgroup whose first warp
// issues the TMA loads, and kConsumerWarpgroups warpgroups of 64 query rows each that only compute. K and V
// have kStages buffers each, filled and drained through mbarriers, so the producer runs ahead of the GEMMs
// without any CTA-wide barrier in the main loop.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kHeadDimV_ = kHeadDim_>
struct FwdSm90WsKernelTraits : FwdSm90Operands<Element_, kHeadDim_, kBlockM_, kBlockN_, kHeadDimV_> {
    using Base = FwdSm90Operands<Element_, kHeadDim_, kBlockM_, kBlockN_, kHeadDimV_>;
    using Element = Element_;
    using SmemAtom = typename Base::SmemAtom;
    using SmemAtomV = typename Base::SmemAtomV;
    using SmemLayoutQ = typename Base::SmemLayoutQ;
    using SmemLayoutKV = typename Base::SmemLayoutKV;
    using SmemLayoutV = typename Base::SmemLayoutV;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockN = kBlockN_;

    static constexpr int kStages = kStages_;
    static constexpr int kConsumerWarpgroups = Base::kNWarpgroups;
    static constexpr int kNThreads = (kConsumerWarpgroups + 1) * 128;
    static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
    static constexpr int kConsumerWarps = kConsumerThreads / 32;
    // setmaxnreg budgets: the producer keeps the minimum, the consumers share the rest of what the launch gave the
    // CTA, kLaunchRegs per thread (ptxas's count under __launch_bounds__(kNThreads, 1): 64K registers over the
    // threads, in multiples of 8). Moving registers between warpgroups cannot exceed it: a consumer warpgroup's
    // setmaxnreg.inc waits until the producer's dec has freed enough, and waits forever if that is not enough.
    static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
    static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;
    static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= (kConsumerWarpgroups + 1) * kLaunchRegs,
                  "setmaxnreg only moves the registers the launch allocated");

    static_assert(kConsumerWarpgroups >= 2 && kConsumerWarpgroups <= 3, "two or three consumer warpgroups");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "P V's k-steps are 16 keys; wgmma N is at most 256");
    static_assert((kBlockN / 8) % 2 == 0, "P feeds P V in pairs of 8-column groups");

    using SmemLayoutKStages = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    using SmemLayoutVStages = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
    // V viewed as (kHeadDimV, kBlockN, stage), the B operand of O += P V.
    using SmemLayoutVtStages = decltype(composition(SmemLayoutVStages{},
                                                    make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                                                                Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDimV>>{})));
    // Each consumer warpgroup stages its output rows in its own rows of sO; V's swizzle, at V's head dim.
    using SmemLayoutO = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockM_>, Int<kHeadDimV>>{}));

    static constexpr int kQBytes = cosize_v<SmemLayoutQ> * int(sizeof(Element));
    static constexpr int kOBytes = cosize_v<SmemLayoutO> * int(sizeof(Element));
    static constexpr int kKStageBytes = cosize_v<SmemLayoutKV> * int(sizeof(Element));
    static constexpr int kVStageBytes = cosize_v<SmemLayoutV> * int(sizeof(Element));
    static_assert(kQBytes % 1024 == 0 && kKStageBytes % 1024 == 0 && kVStageBytes % 1024 == 0,
                  "buffers start on swizzle-atom boundaries");
    static_assert(kOBytes <= kQBytes, "the output may stage in Q's buffer");
    // The output tile gets a buffer of its own where that fits: Q's buffer is then free once a tile's last S GEMM
    // has read it, and the next tile's Q loads while this tile's output is stored. Otherwise (head dims 192 and 256)
    // the output stages in Q's buffer, which the next Q may fill only after the store.
    static constexpr bool kSeparateO = kQBytes + kOBytes + kStages * (kKStageBytes + kVStageBytes) + 1024 <= 227 * 1024;
    // Staged in Q's buffer, a warpgroup's output rows must land on its own Q rows, which only its own S GEMMs read,
    // while the others may still read theirs: the same swizzle atom, tiled the same way, puts row r of both at the
    // same place.
    static_assert(kSeparateO || std::is_same_v<SmemAtomV, SmemAtom>,
                  "an output staged in Q's buffer needs Q's swizzle atom (V's head dim a multiple of 64 where Q's is)");

    template <bool kWithO, int kDummy = 0>
    struct OBuffer {
        alignas(1024) Element o[cosize_v<SmemLayoutO>];
    };
    template <int kDummy>  // a partial specialization: a class may not fully specialize its member template
    struct OBuffer<false, kDummy> {};

    struct SharedStorage {
        alignas(1024) Element q[cosize_v<SmemLayoutQ>];
        alignas(1024) Element k[cosize_v<SmemLayoutKStages>];
        alignas(1024) Element v[cosize_v<SmemLayoutVStages>];
        OBuffer<kSeparateO> o_buffer;
        // mbarriers: Q landed (full) or its buffer may be refilled (empty); K/V stage s landed or was read.
        alignas(16) uint64_t q_full;
        uint64_t q_empty;
        uint64_t k_full[kStages];
        uint64_t k_empty[kStages];
        uint64_t v_full[kStages];
        uint64_t v_empty[kStages];
    };
    // The output's staging buffer.
    __forceinline__ __device__ static Element* o_smem(SharedStorage& storage) {
        if constexpr (kSeparateO) {
            return storage.o_buffer.o;
        } else {
            return storage.q;
        }
    }
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 gives a block at most 227 KiB of shared memory");

    using TmaQ = typename TmaView<Element>::template Load<SmemLayoutQ, Shape<Int<kBlockM_>, Int<kHeadDim>>>;
    using TmaK = typename TmaView<Element>::template Load<SmemLayoutKV, Shape<Int<kBlockN>, Int<kHeadDim>>>;
    using TmaV = typename TmaView<Element>::template Load<SmemLayoutV, Shape<Int<kBlockN>, Int<kHeadDimV>>>;

    // Output rows from shared to global memory: 16 B per thread access by one consumer warpgroup.
    static constexpr int kGmemThreadsPerRow = Base::kSmemRowElemsV / 8;
    using GmemTiledCopyO = decltype(make_tiled_copy(
        Copy_Atom<UniversalCopy<uint128_t>, Element>{},
        Layout<Shape<Int<128 / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
        Layout<Shape<_1, _8>>{}));
};

// The warp-specialized kernel's one argument: the call's parameters and the TMA descriptors of q, k and v,
// which the host encodes per call (the descriptors hold the pointers and strides).
template <class Traits>
struct FwdWsParams {
    FwdParams base;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaK tma_k;
    typename Traits::TmaV tma_v;
};

}  // namespace flash
