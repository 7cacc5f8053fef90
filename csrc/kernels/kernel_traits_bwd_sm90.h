// Tile shapes, warpgroup MMAs and shared-memory layouts of the two Hopper (sm_90a) backward kernels
// (flash_bwd_sm90_kernel.h), which only consume these types.
#pragma once

#include <type_traits>

#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/wgmma_ops.h"
#include "kernels/kernel_traits_fwd_sm90.h"  // the global-copy atoms and the TMA view both passes share

namespace flash {

using namespace cute;

// What both Hopper backward kernels share: two warpgroups, Q and dO in kStagesQ stages of (kBlockM, kHeadDim) and
// (kBlockM, kHeadDimV), K and V of (kBlockN, kHeadDim) and (kBlockN, kHeadDimV), swizzled with the head dim
// contiguous (kSmemRowElems, kSmemRowElemsV), plus transposed views. kHeadDimV is below kHeadDim only in the wide
// kernel's narrow-V form (tile_size.h, NarrowVShape).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kSmemRowElems_, int kHeadDimV_ = kHeadDim_,
          int kSmemRowElemsV_ = kSmemRowElems_>
struct BwdSm90BaseTraits {
    using Element = Element_;
    using ElementAccum = float;

    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarpgroups = 2;
    static constexpr int kNThreads = kNWarpgroups * 128;
    // Elements per 8-row swizzle atom row of Q, dO, K and V: 64 (128 B swizzle), 32 (64 B) or 16 (32 B). Each
    // kernel picks the widest whose atoms tile every head-dim slice its warpgroups read.
    static constexpr int kSmemRowElems = kSmemRowElems_;
    static constexpr int kSmemRowElemsV = kSmemRowElemsV_;  // likewise for dO and V
    static_assert(kHeadDim % kSmemRowElems == 0 && kHeadDimV % kSmemRowElemsV == 0,
                  "shared-memory rows of whole swizzle atoms");
    static_assert(kHeadDimV <= kHeadDim);

    using KeysAlongM = Layout<Shape<Int<kNWarpgroups>, _1, _1>>;  // warpgroups split GEMM M
    using SplitN = Layout<Shape<_1, Int<kNWarpgroups>, _1>>;      // warpgroups split GEMM N

    template <int kRowElems>
    using SmemAtomOf = std::conditional_t<
        kRowElems == 64, GMMA::Layout_K_SW128_Atom<Element>,
        std::conditional_t<kRowElems == 32, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;
    using SmemAtom = SmemAtomOf<kSmemRowElems>;
    using SmemAtomV = SmemAtomOf<kSmemRowElemsV>;
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutdO = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K
    using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
    // Transposed views: (kHeadDim, kBlockM) of Q, (kHeadDimV, kBlockM) of dO, (kHeadDim, kBlockN) of K.
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));
    using SmemLayoutdOt = decltype(composition(
        SmemLayoutdO{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));
    using SmemLayoutKt = decltype(composition(
        SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemdOElems = cosize_v<SmemLayoutdO>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;  // K's
    static constexpr int kSmemVElems = cosize_v<SmemLayoutV>;
    static constexpr int kStagesQ = 2;  // Q, dO, LSE and D of the next query block load during this one

    // Shared memory with one buffer of K and V and scratch_elems more elements for the kernel's own tiles.
    static constexpr int smem_bytes(int scratch_elems) {
        return (kStagesQ * (kSmemQElems + kSmemdOElems) + kSmemKVElems + kSmemVElems + scratch_elems) *
                   int(sizeof(Element)) +
               2 * kStagesQ * kBlockM * int(sizeof(float));
    }

    using GmemTiledCopyLoad = typename FwdSm90KernelTraits<Element, kHeadDim, 128, 64, 1>::GmemTiledCopyQKV;
    using GmemTiledCopyLoadV = typename FwdSm90KernelTraits<Element, kHeadDimV, 128, 64, 1>::GmemTiledCopyQKV;
    static_assert(FwdSm90KernelTraits<Element, kHeadDim, 128, 64, 1>::kNThreads == kNThreads);
    using GmemTiledCopyQ = GmemTiledCopyLoad;  // Q
    using GmemTiledCopydO = GmemTiledCopyLoadV;
    using GmemTiledCopyStore = typename FwdSm90KernelTraits<Element, kHeadDim, 128, 64, 1>::GmemTiledCopyO;  // dK
    using GmemTiledCopyStoreV = typename FwdSm90KernelTraits<Element, kHeadDimV, 128, 64, 1>::GmemTiledCopyO;  // dV
    static constexpr bool kDqTransposed = false;  // whether dQ is computed as dQ^T = K^T dS^T (BwdSm90KernelTraits)
    // Whether dQ reaches dq_accum through shared memory by bulk reductions, and the floats of each of its tiles
    // (BwdSm90KernelTraits).
    static constexpr bool kDqThroughSmem = false;
    static constexpr int kSmemDqTileFloats = 0;
    // Whether the kernel has a deterministic mode (BwdSm90Block::dq_turn): the wide kernel's.
    static constexpr bool kDqTurns = false;
    // dq_accum's conversion (convert_dq_tile, for dQ GEMMs with query rows): one chunk of the whole head dim,
    // the dQ fragments into a Q-shaped tile with stmatrix.
    static constexpr int kDqChunk = kHeadDim;
    using SmemCopyAtomStore = Copy_Atom<SM90_U32x4_STSM_N, Element>;
};

// Head dims 32 to 128 (flash_bwd_sm90_kernel): each warpgroup owns 64 keys for the four GEMMs that produce
// key-indexed results, computed transposed so that P^T and dS^T come out of S^T = K Q^T and dP^T = V dO^T
// already in the A-operand registers of dV += P^T dO and dK += dS^T Q. dQ = dS K (query rows) reads dS^T
// back from shared memory, the warpgroups splitting the head dim.
// kBlockM is 64, or 16 for short queries at head dim 128 (kBwdSm90ShortBlockM): the query block is the N of
// the score GEMMs and the K of dV and dK, where wgmma takes 16, but it cannot be the M of dQ = dS K, so the
// 16-row tile computes dQ^T = K^T dS^T instead, the warpgroups splitting the head dim as its M.
// 128 B swizzle rows where the head dim is a multiple of 64; else (32 and 96) 32 B rows, so that each
// warpgroup's half of the head dim in dQ = dS K is whole atoms of K^T.
template <int kHeadDim>
constexpr int kBwdNarrowSmemRowElems = kHeadDim % 64 == 0 ? 64 : 16;

// dQ = dS K: (kBlockM, kHeadDim / 2) per warpgroup; dS read from dS^T (query contiguous), K^T head-dim
// contiguous. Transposed, dQ^T = K^T dS^T: (kHeadDim / 2, kBlockM) per warpgroup, the same operands. Where the
// query block gives each warpgroup 64 rows (128 rows, head dims up to 64), the warpgroups split the rows instead:
// (64, kHeadDim) each, one wgmma of N = kHeadDim a K step, where a split head dim would take two of half the N
// and read each dS slice twice.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kNWarpgroups, bool kTransposed>
auto bwd_sm90_tiled_mma_dq() {
    if constexpr (kTransposed) {
        return make_tiled_mma(wgmma_ss_op_selector<Element, Element, float,
                                                   Shape<Int<kHeadDim / kNWarpgroups>, Int<kBlockM>, Int<kBlockN>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<Int<kNWarpgroups>, _1, _1>>{});
    } else if constexpr (kBlockM == 64 * kNWarpgroups) {
        return make_tiled_mma(wgmma_ss_op_selector<Element, Element, float,
                                                   Shape<Int<kBlockM / kNWarpgroups>, Int<kHeadDim>, Int<kBlockN>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<Int<kNWarpgroups>, _1, _1>>{});
    } else {
        return make_tiled_mma(wgmma_ss_op_selector<Element, Element, float,
                                                   Shape<Int<kBlockM>, Int<kHeadDim / kNWarpgroups>, Int<kBlockN>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<_1, Int<kNWarpgroups>, _1>>{});
    }
}

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct BwdSm90KernelTraits
    : BwdSm90BaseTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kBwdNarrowSmemRowElems<kHeadDim_>> {
    using Base = BwdSm90BaseTraits<Element_, kHeadDim_, kBlockM_, kBlockN_, kBwdNarrowSmemRowElems<kHeadDim_>>;
    using typename Base::Element;
    using typename Base::ElementAccum;
    using typename Base::SmemAtom;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;

    static_assert(kBlockN == 64 * Base::kNWarpgroups, "each warpgroup owns 64 keys");
    static_assert(kBlockM == 64 || (kBlockM == 128 && kHeadDim <= 64) ||
                      (kBlockM == 16 && kHeadDim == 64 * Base::kNWarpgroups),
                  "64 query rows, 128 at head dims up to 64, or 16 where the head dim gives each warpgroup 64 rows "
                  "of dQ^T");
    static_assert(kHeadDim <= 128, "dK and dV of 64 keys stay in one warpgroup's registers");
    static constexpr bool kDqTransposed = kBlockM < 64;

    // S^T = K Q^T and dP^T = V dO^T: (kBlockN, kBlockM), operands K-major in shared memory.
    using TiledMmaSdP = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
        typename Base::KeysAlongM{}));
    // dV += P^T dO and dK += dS^T Q: (kBlockN, kHeadDim), A from registers, B (dO^T, Q^T) head-dim contiguous.
    using TiledMmadKV = decltype(make_tiled_mma(
        SM90::GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                                   GMMA::Major::K, GMMA::Major::MN>(),
        typename Base::KeysAlongM{}));
    using TiledMmadQ =
        decltype(bwd_sm90_tiled_mma_dq<Element, kHeadDim, kBlockM, kBlockN, Base::kNWarpgroups, kDqTransposed>());

    // dS^T rows are kBlockM queries: 128 B swizzle atoms at 64 and 128, 32 B at 16.
    using SmemAtomdSt =
        std::conditional_t<kBlockM % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>;
    using SmemLayoutdSt = decltype(tile_to_shape(SmemAtomdSt{}, Shape<Int<kBlockN>, Int<kBlockM>>{}));  // dS^T
    using SmemLayoutdS = decltype(composition(
        SmemLayoutdSt{},
        make_layout(Shape<Int<kBlockM>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));  // (kBlockM, kBlockN)
    // dS^T registers -> shared memory: stmatrix writes 8x8 tiles whose 16 B rows hold 8 consecutive queries.
    using SmemCopyAtomdSt = Copy_Atom<SM90_U32x4_STSM_N, Element>;

    // Q and dO: a 16-row tile spreads each row over 16 threads (the K/V copy covers 32 rows at a time).
    static_assert(kBlockM != 16 || kHeadDim == 16 * 8, "16 threads of 8 elements cover one row");
    using GmemTiledCopyQ = std::conditional_t<
        kBlockM == 16,
        decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{},
                                 Layout<Shape<_16, Int<Base::kNThreads / 16>>, Stride<Int<Base::kNThreads / 16>, _1>>{},
                                 Layout<Shape<_1, _8>>{})),
        typename Base::GmemTiledCopyLoad>;
    using GmemTiledCopydO = GmemTiledCopyQ;

    static constexpr int kSmemScratchElems = cosize_v<SmemLayoutdSt>;
    // Two K/V buffers: a CTA that walks several key blocks (BwdParams::key_blocks_per_cta) loads the next
    // block's K and V while it finishes this one. The second lies past everything else, from a 1 KiB boundary
    // (where swizzle atoms repeat), so that a launch of one key block per CTA keeps the smaller carve-out it
    // had before (kSmemBytesOneKV); the larger carve-out serves only CTAs that walk several key blocks.
    static constexpr int kStagesKV = 2;
    static constexpr int kSmemBytesOneKV = (Base::smem_bytes(kSmemScratchElems) + 1023) / 1024 * 1024;

    // Tiles whose dQ GEMM has query rows add a step's dQ through shared memory (BwdSm90Block::add_dq): two
    // (kBlockM, kHeadDim) fp32 tiles in the GEMM's fragment order, past kSmemBytesOneKV, in the place of the second
    // K/V buffer, which a CTA of one key block does not use. The 64-row tile's are as large as that buffer; the
    // 128-row one's (head dim 64) twice as large.
    static constexpr bool kDqThroughSmem = !kDqTransposed;
    static constexpr int kSmemDqTileFloats = kBlockM * kHeadDim;
    static constexpr int kSmemTailBytes = cute::max(2 * Base::kSmemKVElems * int(sizeof(Element)),
                                                    kDqThroughSmem ? 2 * kSmemDqTileFloats * int(sizeof(float)) : 0);
    static constexpr int kSmemBytes = kSmemBytesOneKV + kSmemTailBytes;
    static_assert(kSmemBytes <= 227 * 1024);
};

// The warp-specialized Hopper backward (flash_bwd_sm90_ws_kernel.h) on the narrow kernel's tile, MMAs and layouts:
// its two warpgroups become consumers that only compute, and a third, the producer warpgroup, loads (TMA for K, V,
// Q and dO; cp.async for the LSE and D) and adds each step's dQ tile into dq_accum. Every buffer that the two sides
// hand over has an mbarrier pair (full, empty), so the main loop has one named barrier a step, among the consumers
// (dS^T complete).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct BwdSm90WsKernelTraits : BwdSm90KernelTraits<Element_, kHeadDim_, kBlockM_, kBlockN_> {
    using Base = BwdSm90KernelTraits<Element_, kHeadDim_, kBlockM_, kBlockN_>;
    using typename Base::Element;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static_assert(Base::kDqThroughSmem, "each step's dQ tile reaches dq_accum through shared memory");

    // The consumers are the narrow kernel's threads: its MMAs, its dQ fragment order and its dQ conversion apply.
    static constexpr int kConsumerThreads = Base::kNThreads;
    static constexpr int kConsumerWarps = kConsumerThreads / 32;
    static constexpr int kNThreads = kConsumerThreads + 128;
    // setmaxnreg budgets, as in the warp-specialized forward (FwdSm90WsKernelTraits): the launch gives every thread
    // kLaunchRegs, the producer warpgroup returns all but kProducerRegs, the consumers take kConsumerRegs each.
    static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * kLaunchRegs,
                  "setmaxnreg only moves the registers the launch allocated");

    static constexpr int kStagesQ = Base::kStagesQ;  // Q, dO, LSE and D: one step ahead
    static constexpr int kQBytes = Base::kSmemQElems * int(sizeof(Element));
    static constexpr int kKVBytes = Base::kSmemKVElems * int(sizeof(Element));
    static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "buffers start on swizzle-atom boundaries");

    struct SharedStorage {
        alignas(1024) Element q[kStagesQ][Base::kSmemQElems];
        alignas(1024) Element d_o[kStagesQ][Base::kSmemQElems];
        alignas(1024) Element k[Base::kSmemKVElems];  // the dK tile on its way out, after the tile's last step
        alignas(1024) Element v[Base::kSmemKVElems];  // likewise dV
        alignas(1024) Element dst[2][Base::kSmemScratchElems];  // dS^T, by step parity
        alignas(1024) float dq[2][Base::kSmemDqTileFloats];  // a step's dQ in the dQ GEMM's fragment order, by parity
        alignas(16) float lse[kStagesQ][kBlockM];
        float dsum[kStagesQ][kBlockM];
        // mbarriers: K and V landed (full) or may be refilled (empty); Q stage s with its dO, LSE and D; dQ tile t
        // written by the consumers (full) or read by its bulk reduction (empty).
        uint64_t kv_full;
        uint64_t kv_empty;
        uint64_t q_full[kStagesQ];
        uint64_t q_empty[kStagesQ];
        uint64_t dq_full[2];
        uint64_t dq_empty[2];
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 gives a block at most 227 KiB of shared memory");

    using TmaQ = typename TmaView<Element>::template Load<typename Base::SmemLayoutQ,
                                                          Shape<Int<kBlockM>, Int<kHeadDim>>>;  // Q and dO
    using TmaKV = typename TmaView<Element>::template Load<typename Base::SmemLayoutKV,
                                                           Shape<Int<kBlockN>, Int<kHeadDim>>>;  // K and V
};

// The warp-specialized backward's one argument: the call's parameters and the TMA descriptors of q, dout, k and v,
// encoded by the host per call.
template <class Traits>
struct BwdWsParams {
    BwdParams base;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaQ tma_do;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
};

// Head dims 160 to 256 (flash_bwd_sm90_wide_kernel): the warpgroups split the keys of S = Q K^T and
// dP = dO V^T (kBlockN / 2 each), write P and dS to shared memory, and split the head dim of dV += P^T dO,
// dK += dS^T Q and dQ = dS K, so each holds dK and dV of all kBlockN keys over half the head dim.
// The widest atom whose rows tile each warpgroup's half of the head dim (80, 96, 112 or 128 columns).
template <int kHeadDim>
constexpr int kBwdWideSmemRowElems = (kHeadDim / 2) % 64 == 0   ? 64
                                     : (kHeadDim / 2) % 32 == 0 ? 32
                                                                : 16;

// With kHeadDimV below kHeadDim (a narrow-V shape, tile_size.h), dO, V, dP's reduction and dV are kHeadDimV wide:
// against V padded to kHeadDim, a third less dP and dV work at (192, 128), and 24 KiB less shared memory.
template <typename Element_, int kHeadDim_, int kHeadDimV_ = kHeadDim_>
struct BwdSm90WideKernelTraits : BwdSm90BaseTraits<Element_, kHeadDim_, 64, 64, kBwdWideSmemRowElems<kHeadDim_>,
                                                   kHeadDimV_, kBwdWideSmemRowElems<kHeadDimV_>> {
    using Base = BwdSm90BaseTraits<Element_, kHeadDim_, 64, 64, kBwdWideSmemRowElems<kHeadDim_>, kHeadDimV_,
                                   kBwdWideSmemRowElems<kHeadDimV_>>;
    using typename Base::Element;
    using typename Base::ElementAccum;
    using typename Base::SmemAtom;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = 64;
    static constexpr int kBlockN = 64;
    static constexpr int kHalfD = kHeadDim / Base::kNWarpgroups;
    static constexpr int kHalfDV = kHeadDimV / Base::kNWarpgroups;
    static_assert(kHalfD % Base::kSmemRowElems == 0 && kHalfDV % Base::kSmemRowElemsV == 0,
                  "each warpgroup's half of dO^T, Q^T and K^T is whole atoms");

    // S and dP: (kBlockM, kBlockN), operands K-major in shared memory.
    using TiledMmaSdP = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim>>>(),
        typename Base::SplitN{}));
    // dK: (kBlockN, kHeadDim); A = dS^T (key contiguous), B = Q^T (head dim contiguous).
    using TiledMmadKV = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kHalfD>, Int<kBlockM>>,
                             GMMA::Major::MN, GMMA::Major::MN>(),
        typename Base::SplitN{}));
    // dV: (kBlockN, kHeadDimV); A = P^T, B = dO^T. The same MMA as dK's where V is as wide as K.
    using TiledMmadV = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockN>, Int<kHalfDV>, Int<kBlockM>>,
                             GMMA::Major::MN, GMMA::Major::MN>(),
        typename Base::SplitN{}));
    // dQ = dS K: (kBlockM, kHeadDim); A = dS K-major, B = K^T head-dim contiguous.
    using TiledMmadQ = decltype(make_tiled_mma(
        wgmma_ss_op_selector<Element, Element, ElementAccum, Shape<Int<kBlockM>, Int<kHalfD>, Int<kBlockN>>,
                             GMMA::Major::K, GMMA::Major::MN>(),
        typename Base::SplitN{}));

    using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));  // P and dS
    using SmemLayoutPt = decltype(composition(
        SmemLayoutP{},
        make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));  // (kBlockN, kBlockM)
    // P and dS registers -> shared memory with stmatrix (16 B rows of 8 consecutive keys).
    using SmemCopyAtomPdS = Copy_Atom<SM90_U32x4_STSM_N, Element>;

    static constexpr int kSmemPElems = cosize_v<SmemLayoutP>;
    static constexpr int kSmemScratchElems = 2 * kSmemPElems;
    static constexpr int kStagesKV = 1;  // one key block per CTA: a second K/V buffer would not fit at head dim 256
    static constexpr bool kDqTurns = true;
    static constexpr int kSmemBytesOneKV = Base::smem_bytes(kSmemScratchElems);
    static constexpr int kSmemBytes = kSmemBytesOneKV;
    static_assert(kSmemBytes <= 227 * 1024);
};

}  // namespace flash
