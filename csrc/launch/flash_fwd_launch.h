// The host-side launcher of the forward kernel (tile shapes per head dim in tile_size.h). Included
// only by the generated instantiation files, one (dtype, head dim, mask) each.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "kernels/flash_fwd_kernel.h"
#include "kernels/flash_fwd_sm90_kernel.h"
#include "kernels/flash_fwd_sm90_ws_kernel.h"
#include "launch/tile_size.h"
#include "launch/kernel_registry.h"
#include "launch/launch.h"

namespace flash {

// Query blocks times key splits (FwdTile decodes blockIdx.x).
inline unsigned fwd_grid_x(const FwdParams& params, int block_m) {
    return unsigned((params.seqlen_q + block_m - 1) / block_m) * unsigned(params.num_splits);
}

// The forward tile set of (family, head dim, budget) that the launchers compile (tile_size.h).
template <KernelFamily kFamily, int kHeadDim, int kBudget = base_smem_budget(kFamily)>
constexpr TileSet kFwdTileSet = tile_set(kFamily, Pass::kFwd, kHeadDim, kBudget);

// The mma.sync forward's tile in the set of kBudget: the table's, or in tile-tuning builds (bench/tune_tiles.py)
// one forced shape for every kernel of the 163 KiB set. The plans read the table's either way, which only
// affects how well their heuristics fit.
template <int kHeadDim, bool kCausal, bool kVariants, int kBudget>
constexpr TileShape fwd_mma_sync_tile() {
#if defined(FLASH_FWD_TILE_M) && defined(FLASH_FWD_TILE_N) && defined(FLASH_FWD_TILE_WARPS)
    if constexpr (kBudget == kSmem163KiB) { return {FLASH_FWD_TILE_M, FLASH_FWD_TILE_N, FLASH_FWD_TILE_WARPS}; }
#endif
    return kFwdTileSet<KernelFamily::kMmaSync, kHeadDim, kBudget>.tile_for(kCausal, kVariants);
}

// The mma.sync kernel of kTile, V of kHeadDimV columns.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, PlainMod kMod, TileShape kTile,
          int kHeadDimV = kHeadDim>
cudaError_t run_fwd_mma_sync(const FwdParams& params, cudaStream_t stream) {
    using Traits = FwdKernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, kHeadDimV>;
    static_assert(sizeof(Element) == kElementBytes);
    static_assert(Traits::kSmemBytes == fwd_mma_sync_smem_bytes(kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n),
                  "the plans check a GPU's shared memory by the formula");
    const dim3 grid(fwd_grid_x(params, Traits::kBlockM), params.batch, params.num_heads);
    return launch_kernel<&flash_fwd_kernel<Traits, kCausal, kVariants, kMod>, Traits::kNThreads, Traits::kSmemBytes>(
        grid, params, stream);
}

// The mma.sync kernel of the plan's tile set (FwdParams::mma_sync_tile_set).
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, PlainMod kMod, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_mma_sync_set(const FwdParams& params, cudaStream_t stream) {
    constexpr TileShape kTile = fwd_mma_sync_tile<kHeadDim, kCausal, kVariants, kSmem163KiB>();
    constexpr TileShape kSmallTile = fwd_mma_sync_tile<kHeadDim, kCausal, kVariants, kSmem99KiB>();
    // Where the 99 KiB set repeats the 163 KiB set's tile, both run the one kernel.
    constexpr bool kSameTile = kSmallTile.block_m == kTile.block_m && kSmallTile.block_n == kTile.block_n &&
                               kSmallTile.warps == kTile.warps;
    if constexpr (!kSameTile) {
        if (params.mma_sync_tile_set == MmaSyncTileSet::k99KiB) {
            return run_fwd_mma_sync<Element, kHeadDim, kCausal, kVariants, kMod, kSmallTile, kHeadDimV>(params, stream);
        }
    }
    return run_fwd_mma_sync<Element, kHeadDim, kCausal, kVariants, kMod, kTile, kHeadDimV>(params, stream);
}

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

// The plain kernel of the call's form (plain_mod_of: a plain plan with softcap or dropout set is a call whose one
// variant that is, make_plan), by `run`, a launcher templated on PlainMod.
template <class Run>
cudaError_t run_plain_mod(const FwdParams& params, const Run& run) {
    switch (plain_mod_of(params)) {
        case PlainMod::kSoftcap: return run(std::integral_constant<PlainMod, PlainMod::kSoftcap>{});
        case PlainMod::kDropout: return run(std::integral_constant<PlainMod, PlainMod::kDropout>{});
        case PlainMod::kNone: break;
    }
    return run(std::integral_constant<PlainMod, PlainMod::kNone>{});
}

// kVariants: the variants kernel (window, softcap, ALiBi, dropout; kCausal too), else a plain one.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
    if (params.head_dim_v != params.head_dim) {
        // A V narrower than Q and K that the plan left unpadded (Plan::narrow_v): the narrow-V kernels, which the
        // plans pick for plain calls without key splits, on Hopper's warp-specialized kernel only.
        if constexpr (narrow_v_shape(kHeadDim).exists() && !kVariants) {
            constexpr NarrowVShape kNarrow = narrow_v_shape(kHeadDim);
            const bool plain = plain_mod_of(params) == PlainMod::kNone && params.num_splits == 1 &&
                               params.head_dim_v <= kNarrow.head_dim_v;
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
            if (plain && params.family == KernelFamily::kWgmma && params.warp_specialized && !params.short_key_tiles) {
                return params.learnable_sink_ptr != nullptr
                           ? run_fwd_sm90_ws<Element, kHeadDim, kCausal, PlainMod::kNone, true, kNarrow.ws_tile,
                                             kNarrow.head_dim_v>(params, stream)
                           : run_fwd_sm90_ws<Element, kHeadDim, kCausal, PlainMod::kNone, false, kNarrow.ws_tile,
                                             kNarrow.head_dim_v>(params, stream);
            }
#endif
            if (plain && params.family == KernelFamily::kMmaSync) {
                return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, false, PlainMod::kNone, kNarrow.head_dim_v>(
                    params, stream);
            }
        }
        return cudaErrorInvalidConfiguration;
    }
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    if (params.family == KernelFamily::kWgmma) {
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
                                   ? run_fwd_sm90_ws<Element, kHeadDim, kCausal, kMod, true, kWsSet.ws_tile>(params,
                                                                                                             stream)
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
#endif
    if constexpr (!kVariants) {
        return run_plain_mod(params, [&](auto mod) {
            return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, false, decltype(mod)::value>(params, stream);
        });
    } else {
        return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, true, PlainMod::kNone>(params, stream);
    }
}

}  // namespace flash
