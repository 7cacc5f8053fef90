// The backward's Hopper (sm_90a) warpgroup-MMA launchers (tile shapes per head dim in tile_size.h), included only
// by the generated files of that family, which the build compiles for sm_90a alone.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/flash_bwd_aux.h"
#include "kernels/flash_bwd_sm90_kernel.h"
#include "kernels/flash_bwd_sm90_ws_kernel.h"
#include "launch/flash_bwd_launch_common.h"
#include "launch/launch.h"

namespace flash {

// Hopper (sm_90a) warpgroup-MMA backward: the narrow kernel up to head dim 128, the wide one above
// (bwd_sm90_narrow). Deterministic mode runs the mma.sync kernel.
enum class BwdSm90Kind { kNarrow, kWide };
template <int kHeadDim>
constexpr BwdSm90Kind kBwdSm90Kind = bwd_sm90_narrow(kHeadDim) ? BwdSm90Kind::kNarrow : BwdSm90Kind::kWide;

// dq = softmax_scale * dq_accum, from dq_accum in the dQ GEMM's fragment order of Traits' kernel.
template <class Traits>
cudaError_t run_bwd_sm90_convert_dq(const BwdParams& params, cudaStream_t stream) {
    const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.batch, params.num_heads);
    constexpr int kSmemBytes = Traits::kSmemQElems * int(sizeof(typename Traits::Element));
    return launch_kernel<&flash_bwd_sm90_convert_dq_kernel<Traits>, Traits::kNThreads, kSmemBytes>(grid, params,
                                                                                                   stream);
}

// Launches kKernel of Traits, whose tile is kTile of the wgmma set.
template <class Traits, auto kKernel, TileShape kTile>
cudaError_t launch_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
    static_assert(Traits::kBlockM == kTile.block_m && Traits::kBlockN == kTile.block_n,
                  "the host sizes its grid decisions by the table's tile");
    static_assert((Traits::kStagesKV > 1) == bwd_sm90_walks_key_blocks(Traits::kHeadDim),
                  "the host sets key_blocks_per_cta by it");
    static_assert(sizeof(typename Traits::Element) == kElementBytes);
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kHeadDimV = Traits::kHeadDimV;
    static_assert(
        Traits::kSmemBytesOneKV == bwd_wgmma_smem_bytes(kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n, false) &&
            Traits::kSmemBytes ==
                bwd_wgmma_smem_bytes(kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n, Traits::kStagesKV > 1),
        "the plans check a GPU's shared memory by the formula");
    if (params.key_blocks_per_cta < 1 || (Traits::kStagesKV == 1 && params.key_blocks_per_cta != 1)) {
        return cudaErrorNotSupported;
    }
    const int n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const dim3 grid((n_blocks + params.key_blocks_per_cta - 1) / params.key_blocks_per_cta, params.batch,
                    params.num_heads / params.heads_per_cta);
    // The tail past kSmemBytesOneKV holds the second K/V buffer, or the dQ tiles of kDqThroughSmem in a CTA of one
    // key block.
    const bool second_kv_buffer = params.key_blocks_per_cta > 1 || Traits::kDqThroughSmem;
    static_assert(Traits::kDqThroughSmem == bwd_sm90_dq_through_smem(kHeadDim, Traits::kBlockM));
    const int smem_bytes = second_kv_buffer ? Traits::kSmemBytes : Traits::kSmemBytesOneKV;
    const cudaError_t err = launch_kernel<kKernel, Traits::kNThreads, Traits::kSmemBytes>(grid, params, stream,
                                                                                          smem_bytes);
    if (err != cudaSuccess) { return err; }
    if constexpr (Traits::kDqTransposed) {
        // The short-query tile adds dQ^T into dq_accum in (row, column) order.
        return run_bwd_convert_dq(params, std::is_same_v<typename Traits::Element, cutlass::bfloat16_t>, stream);
    } else {
        // The others in the dQ GEMM's fragment order (dq_accum.h), which their own conversion reads back.
        return run_bwd_sm90_convert_dq<Traits>(params, stream);
    }
}

// The warp-specialized Hopper kernel of the wgmma set's ws_tile, for plain calls with one key block per CTA (the plan
// checked), then the narrow kernel's dQ conversion: the consumers are that kernel's threads, so dq_accum is
// in its fragment order. TMA descriptors of q, dout, k and v are encoded for each call.
template <typename Element, int kHeadDim, bool kCausal>
cudaError_t run_bwd_sm90_ws(const BwdParams& call_params, cudaStream_t stream) {
    constexpr TileShape kTile = kBwdTileSet<KernelFamily::kWgmma, kHeadDim>.ws_tile;
    using Traits = BwdSm90WsKernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n>;
    static_assert(sizeof(Element) == kElementBytes);
    static_assert(Traits::kSmemBytes == bwd_ws_smem_bytes(kHeadDim, kTile.block_m, kTile.block_n),
                  "the plans check a GPU's shared memory by the formula");
    if (call_params.key_blocks_per_cta != 1 || call_params.gqa_pack != 1) { return cudaErrorNotSupported; }
    // dq_accum is not zeroed: each query block's first dQ tile is stored, which the flags track (dq_turns.h).
    BwdParams params = call_params;
    params.dq_accum_stored = true;
    if (!params.deterministic) {
        const cudaError_t err = cudaMemsetAsync(params.dq_semaphore_ptr, 0,
                                                static_cast<size_t>(params.dq_semaphore_bytes), stream);
        if (err != cudaSuccess) { return err; }
    }
    // Variable-length batches: each view is one batch of all the sequences' rows (the kernel offsets each sequence).
    const bool varlen = params.cu_seqlens_q != nullptr;
    const int rows_q = varlen ? params.total_q : params.seqlen_q;
    const int rows_k = varlen ? params.total_k : params.seqlen_k;
    const int batches = varlen ? 1 : params.batch;
    using TileQ = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>;
    using SmemLayoutQ = typename Traits::SmemLayoutQ;
    using SmemLayoutKV = typename Traits::SmemLayoutKV;
    using View = TmaView<Element>;
    const BwdWsParams<Traits> ws{
        params,
        View::template load<SmemLayoutQ, TileQ>(params.q_ptr, rows_q, params.head_dim, params.num_heads, batches,
                                                params.q_row_stride, params.q_head_stride, params.q_batch_stride),
        View::template load<SmemLayoutQ, TileQ>(params.do_ptr, rows_q, params.head_dim, params.num_heads, batches,
                                                params.do_row_stride, params.do_head_stride, params.do_batch_stride),
        View::template load<SmemLayoutKV, TileKV>(params.k_ptr, rows_k, params.head_dim, params.num_heads_k, batches,
                                                  params.k_row_stride, params.k_head_stride, params.k_batch_stride),
        View::template load<SmemLayoutKV, TileKV>(params.v_ptr, rows_k, params.head_dim, params.num_heads_k, batches,
                                                  params.v_row_stride, params.v_head_stride, params.v_batch_stride)};
    const WsSchedule<Traits::kBlockN, kCausal> schedule(params.seqlen_k, params.batch,
                                                        params.num_heads / params.heads_per_cta);
    // Deterministic mode: every round of the walk holds whole (sequence, head)s where a head's units fit the SMs.
    // Under a causal mask the kernel's dQ order needs it (BwdWsTile::dq_turn), and the plan takes this kernel there
    // only where they fit. Without one it is a preference: it keeps a head's key blocks on the same CTAs from round
    // to round, so that the offsets between them that the order sets up in the first round hold in the later ones.
    const int group = params.deterministic ? schedule.units_per_head : 1;
    const bool group_optional = !kCausal;
    // The kernel's variable-length form for variable-length batches (kVarlen).
    auto launch = [&](auto varlen_form) {
        constexpr bool kVarlen = decltype(varlen_form)::value;
        return launch_persistent<&flash_bwd_sm90_ws_kernel<Traits, kCausal, kVarlen>, Traits::kNThreads,
                                 Traits::kSmemBytes>(schedule.units, params, stream, ws, group, group_optional);
    };
    const cudaError_t err = varlen ? launch(std::true_type{}) : launch(std::false_type{});
    if (err != cudaSuccess) { return err; }
    return run_bwd_sm90_convert_dq<typename Traits::Base>(params, stream);
}

template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_bwd_on_wgmma(const BwdParams& params, cudaStream_t stream) {
    constexpr TileSet kSet = kBwdTileSet<KernelFamily::kWgmma, kHeadDim>;
    static_assert(kSet.exists(), "every compiled head dim has a wgmma tile set");
    if constexpr (kSet.ws_tile.exists() && !kVariants) {
        if (params.warp_specialized && params.head_dim_v == params.head_dim) {
            return run_bwd_sm90_ws<Element, kHeadDim, kCausal>(params, stream);
        }
    }
    // The other kernels add every dQ tile into dq_accum.
    if (const cudaError_t err = zero_dq_accum(params, stream); err != cudaSuccess) { return err; }
    if (params.head_dim_v != params.head_dim) {
        // A V narrower than Q and K that the plan left unpadded (Plan::narrow_v): the narrow-V form of the wide
        // kernel, which the plans pick for plain calls.
        if constexpr (narrow_v_shape(kHeadDim).exists() && !kVariants) {
            constexpr NarrowVShape kNarrow = narrow_v_shape(kHeadDim);
            if (params.head_dim_v > kNarrow.head_dim_v) { return cudaErrorInvalidConfiguration; }
            static_assert(kBwdSm90Kind<kHeadDim> == BwdSm90Kind::kWide);
            using Traits = BwdSm90WideKernelTraits<Element, kHeadDim, kNarrow.head_dim_v>;
            return launch_bwd_sm90<Traits, &flash_bwd_sm90_wide_kernel<Traits, kCausal, false>, kSet.tile_for(kCausal)>(
                params, stream);
        }
        return cudaErrorInvalidConfiguration;
    }
    if constexpr (kBwdSm90Kind<kHeadDim> == BwdSm90Kind::kNarrow) {
        // Deterministic mode at these head dims runs the warp-specialized kernel or the mma.sync one (the plan).
        if (params.deterministic) { return cudaErrorNotSupported; }
        if constexpr (kSet.short_tile.exists()) {
            if (params.short_query_tiles) {
                constexpr TileShape kTile = kSet.short_tile;
                using Traits = BwdSm90KernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n>;
                return launch_bwd_sm90<Traits, &flash_bwd_sm90_kernel<Traits, kCausal, kVariants>, kTile>(params,
                                                                                                          stream);
            }
        }
        constexpr TileShape kTile = kSet.tile_for(kCausal);
        using Traits = BwdSm90KernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n>;
        return launch_bwd_sm90<Traits, &flash_bwd_sm90_kernel<Traits, kCausal, kVariants>, kTile>(params, stream);
    } else {
        using Traits = BwdSm90WideKernelTraits<Element, kHeadDim>;
        return launch_bwd_sm90<Traits, &flash_bwd_sm90_wide_kernel<Traits, kCausal, kVariants>, kSet.tile_for(kCausal)>(
            params, stream);
    }
}

}  // namespace flash
