// The host-side launcher of the forward kernel (tile shapes per head dim in tile_size.h). Included
// only by the generated instantiation files, one (dtype, head dim, mask) each.
#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_fwd_kernel.h"
#include "kernels/flash_fwd_sm90_kernel.h"
#include "launch/tile_size.h"
#include "launch/kernel_registry.h"
#include "launch/launch.h"

namespace flash {

// Query blocks times key splits (FwdTile decodes blockIdx.x).
inline unsigned fwd_grid_x(const FwdParams& params, int block_m) {
    return unsigned((params.seqlen_q + block_m - 1) / block_m) * unsigned(params.num_splits);
}

// The Hopper kernel with the tile of Config (a FwdSm90TileConfig or FwdSm90ShortKeysTileConfig).
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, class Config>
cudaError_t run_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
    using Traits = FwdSm90KernelTraits<Element, kHeadDim, Config::kBlockM, Config::kBlockN, Config::kCtasPerSm>;
    const dim3 grid(fwd_grid_x(params, Traits::kBlockM), params.batch, params.num_heads);
    return launch_kernel<&flash_fwd_sm90_kernel<Traits, kCausal, kVariants>, Traits::kNThreads, Traits::kSmemBytes>(
        grid, params, stream);
}

// kVariants: the variants kernel (window, softcap, ALiBi, dropout; kCausal too), else a plain one.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    if constexpr (FwdSm90ShortKeysTileConfig<kHeadDim, kCausal>::kEnabled) {
        if (params.use_wgmma && params.short_key_tiles) {
            return run_fwd_sm90<Element, kHeadDim, kCausal, kVariants, FwdSm90ShortKeysTileConfig<kHeadDim, kCausal>>(
                params, stream);
        }
    }
    if constexpr (FwdSm90TileConfig<kHeadDim, kCausal>::kEnabled) {
        if (params.use_wgmma) {
            return run_fwd_sm90<Element, kHeadDim, kCausal, kVariants, FwdSm90TileConfig<kHeadDim, kCausal>>(params,
                                                                                                        stream);
        }
    }
#endif
    using Config = SelectedTileConfig<kHeadDim, kCausal>;
    using Traits = FwdKernelTraits<Element, kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps>;
    const dim3 grid(fwd_grid_x(params, Traits::kBlockM), params.batch, params.num_heads);
    return launch_kernel<&flash_fwd_kernel<Traits, kCausal, kVariants>, Traits::kNThreads, Traits::kSmemBytes>(
        grid, params, stream);
}

}  // namespace flash
