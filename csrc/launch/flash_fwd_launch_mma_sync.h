// The forward's mma.sync launchers (tile shapes per head dim in tile_size.h), included only by the generated
// files of that family, which the build compiles for every arch it targets.
#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_fwd_kernel.h"
#include "launch/flash_fwd_launch_common.h"
#include "launch/launch.h"

namespace flash {

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

template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd_on_mma_sync(const FwdParams& params, cudaStream_t stream) {
    if (params.head_dim_v != params.head_dim) {
        // A V narrower than Q and K that the plan left unpadded (Plan::narrow_v): the narrow-V kernels, which the
        // plans pick for plain calls without key splits.
        if constexpr (narrow_v_shape(kHeadDim).exists() && !kVariants) {
            constexpr NarrowVShape kNarrow = narrow_v_shape(kHeadDim);
            if (plain_mod_of(params) == PlainMod::kNone && params.num_splits == 1 &&
                params.head_dim_v <= kNarrow.head_dim_v) {
                return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, false, PlainMod::kNone, kNarrow.head_dim_v>(
                    params, stream);
            }
        }
        return cudaErrorInvalidConfiguration;
    }
    if constexpr (!kVariants) {
        return run_plain_mod(params, [&](auto mod) {
            return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, false, decltype(mod)::value>(params, stream);
        });
    } else {
        return run_fwd_mma_sync_set<Element, kHeadDim, kCausal, true, PlainMod::kNone>(params, stream);
    }
}

}  // namespace flash
