// The forward's Hopper (sm_90a) warpgroup-MMA launchers (tile shapes per head dim in tile_size.h), included only by
// the generated files of that family, which the build compiles for sm_90a alone.
#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_fwd_sm90_kernel.h"
#include "kernels/flash_fwd_sm90_ws_kernel.h"
#include "launch/flash_fwd_launch_common.h"
#include "launch/launch.h"

namespace flash {

// The Hopper kernel with kTile, a tile of the wgmma set (its regular or short-key tile).
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, TileShape kTile>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
    constexpr TileSet kSet = kFwdTileSet<KernelFamily::kWgmma, kHeadDim>;
    using Traits = FwdSm90KernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.ctas_per_sm>;
    static_assert(sizeof(Element) == kElementBytes);
    static_assert(Traits::kSmemBytes ==
                      fwd_wgmma_smem_bytes(kHeadDim, kTile.block_m, kTile.block_n, kTile.ctas_per_sm, kSet.smem_budget),
                  "the plans check a GPU's shared memory by the formula");
    const dim3 grid(fwd_grid_x(params, Traits::kBlockM), params.batch, params.num_heads);
    return launch_kernel<&flash_fwd_sm90_kernel<Traits, kCausal, kVariants>, Traits::kNThreads, Traits::kSmemBytes>(
        grid, params, stream);
}

// The warp-specialized Hopper kernel on kTile (the wgmma set's ws_tile or ws_short_tile, or a narrow-V shape's
// ws_tile with kHeadDimV), for dense batches of a plain kernel without key splits or GQA packing (the plan
// checked), in its kMod form, and with kSink for calls with a learnable sink. TMA descriptors of q, k and v are
// encoded for each call: they hold the pointers and strides.
template <typename Element, int kHeadDim, bool kCausal, PlainMod kMod, bool kSink, TileShape kTile,
          int kHeadDimV = kHeadDim>
cudaError_t run_fwd_sm90_ws(const FwdParams& params, cudaStream_t stream) {
    using Traits = FwdSm90WsKernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, kHeadDimV>;
    static_assert(sizeof(Element) == kElementBytes);
    static_assert(Traits::kSmemBytes ==
                      fwd_ws_smem_bytes(kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n, kTile.stages),
                  "the plans check a GPU's shared memory by the formula");
    using TileQ = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
    using TileK = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>;
    using TileV = Shape<Int<Traits::kBlockN>, Int<kHeadDimV>>;
    using View = TmaView<Element>;
    const FwdWsParams<Traits> ws{
        params,
        View::template load<typename Traits::SmemLayoutQ, TileQ>(params.q_ptr, params.seqlen_q, params.head_dim,
                                                                 params.num_heads, params.batch, params.q_row_stride,
                                                                 params.q_head_stride, params.q_batch_stride),
        View::template load<typename Traits::SmemLayoutKV, TileK>(params.k_ptr, params.seqlen_k, params.head_dim,
                                                                  params.num_heads_k, params.batch, params.k_row_stride,
                                                                  params.k_head_stride, params.k_batch_stride),
        View::template load<typename Traits::SmemLayoutV, TileV>(params.v_ptr, params.seqlen_k, params.head_dim_v,
                                                                 params.num_heads_k, params.batch, params.v_row_stride,
                                                                 params.v_head_stride, params.v_batch_stride)};
    // Persistent: a CTA takes all of an SM's registers (setmaxnreg hands them to its warpgroups).
    const WsSchedule<Traits::kBlockM, kCausal> schedule(params.seqlen_q, params.batch, params.num_heads);
    return launch_persistent<&flash_fwd_sm90_ws_kernel<Traits, kCausal, kMod, kSink>, Traits::kNThreads,
                             Traits::kSmemBytes>(schedule.units, params, stream, ws);
}

template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd_on_wgmma(const FwdParams& params, cudaStream_t stream) {
    if (params.head_dim_v != params.head_dim) {
        // A V narrower than Q and K that the plan left unpadded (Plan::narrow_v): the narrow-V warp-specialized
        // kernel, which the plans pick for plain calls without key splits.
        if constexpr (narrow_v_shape(kHeadDim).exists() && !kVariants) {
            constexpr NarrowVShape kNarrow = narrow_v_shape(kHeadDim);
            if (plain_mod_of(params) == PlainMod::kNone && params.num_splits == 1 &&
                params.head_dim_v <= kNarrow.head_dim_v && params.warp_specialized && !params.short_key_tiles) {
                return params.learnable_sink_ptr != nullptr
                           ? run_fwd_sm90_ws<Element, kHeadDim, kCausal, PlainMod::kNone, true, kNarrow.ws_tile,
                                             kNarrow.head_dim_v>(params, stream)
                           : run_fwd_sm90_ws<Element, kHeadDim, kCausal, PlainMod::kNone, false, kNarrow.ws_tile,
                                             kNarrow.head_dim_v>(params, stream);
            }
        }
        return cudaErrorInvalidConfiguration;
    }
    constexpr TileSet kSet = kFwdTileSet<KernelFamily::kWgmma, kHeadDim>;
    static_assert(kSet.exists(), "every compiled head dim has a wgmma tile set");
    if constexpr (kSet.ws_tile.exists() && !kVariants) {
        if (params.warp_specialized) {
            return run_plain_mod(params, [&](auto mod) {
                constexpr PlainMod kMod = decltype(mod)::value;
                // Named here rather than through kSet, which the lambda would capture.
                constexpr TileSet kWsSet = kFwdTileSet<KernelFamily::kWgmma, kHeadDim>;
                constexpr bool kTileDrops = kMod != PlainMod::kDropout ||
                                            dropout_fits_key_blocks(kWsSet.ws_tile.block_n);
                // The short-key tile serves causal calls, and dropout calls where the tile's key blocks cannot
                // take dropout (make_plan): the causal files hold it, the others only its dropout form then.
                if constexpr (kWsSet.ws_short_tile.exists() && (kCausal || !kTileDrops)) {
                    if (params.short_key_tiles) {
                        return params.learnable_sink_ptr != nullptr
                                   ? run_fwd_sm90_ws<Element, kHeadDim, kCausal, kMod, true, kWsSet.ws_short_tile>(
                                         params, stream)
                                   : run_fwd_sm90_ws<Element, kHeadDim, kCausal, kMod, false, kWsSet.ws_short_tile>(
                                         params, stream);
                    }
                }
                if constexpr (!kTileDrops) {
                    return cudaErrorInvalidConfiguration;  // the plans send dropout to the short-key tile
                } else {
                    return params.learnable_sink_ptr != nullptr
                               ? run_fwd_sm90_ws<Element, kHeadDim, kCausal, kMod, true, kWsSet.ws_tile>(params, stream)
                               : run_fwd_sm90_ws<Element, kHeadDim, kCausal, kMod, false, kWsSet.ws_tile>(params,
                                                                                                          stream);
                }
            });
        }
    }
    // The other Hopper kernels' plain form has no variant at all (make_plan).
    if (!kVariants && plain_mod_of(params) != PlainMod::kNone) { return cudaErrorInvalidConfiguration; }
    if constexpr (kSet.short_tile.exists()) {
        if (params.short_key_tiles) {
            return run_fwd_sm90<Element, kHeadDim, kCausal, kVariants, kSet.short_tile>(params, stream);
        }
    }
    return run_fwd_sm90<Element, kHeadDim, kCausal, kVariants, kSet.tile_for(kCausal)>(params, stream);
}

}  // namespace flash
