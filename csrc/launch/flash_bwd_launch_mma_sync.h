// The backward's mma.sync launchers (tile shapes per head dim in tile_size.h), included only by the generated
// files of that family, which the build compiles for every arch it targets.
#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_bwd_aux.h"
#include "kernels/flash_bwd_kernel.h"
#include "launch/flash_bwd_launch_common.h"
#include "launch/launch.h"

namespace flash {

// The mma.sync backward's tile in the set of kBudget: the table's, or in tile-tuning builds (bench/tune_tiles.py
// --pass bwd) one forced shape for every kernel of the 163 KiB set.
template <int kHeadDim, bool kCausal, int kBudget>
constexpr TileShape bwd_mma_sync_tile() {
#if defined(FLASH_BWD_TILE_M) && defined(FLASH_BWD_TILE_N)
    if constexpr (kBudget == kSmem163KiB) { return {FLASH_BWD_TILE_M, FLASH_BWD_TILE_N}; }
#endif
    return kBwdTileSet<KernelFamily::kMmaSync, kHeadDim, kBudget>.tile_for(kCausal);
}

// The mma.sync kernel of the set of kBudget, V of kHeadDimV columns, then its dQ conversion (dq_accum in its fragment
// order).
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, int kBudget, int kHeadDimV = kHeadDim>
cudaError_t run_bwd_mma_sync(const BwdParams& params, cudaStream_t stream) {
    constexpr TileShape kTile = bwd_mma_sync_tile<kHeadDim, kCausal, kBudget>();
    static_assert(kTile.block_m >= kBwdMinBlockM && kTile.block_m <= kBwdMaxBlockM);
    using Traits =
        BwdKernelTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kBudget, kTile.v_in_regs, kHeadDimV>;
    static_assert(sizeof(Element) == kElementBytes);
    static_assert(Traits::kSmemBytes == bwd_mma_sync_smem_bytes(kHeadDim, kHeadDimV, kTile.block_m, kTile.block_n,
                                                                kTile.v_in_regs, kBudget),
                  "the plans check a GPU's shared memory by the formula, for the budget the kernel is tuned for");
    // Key blocks along x: in deterministic mode a key block waits on its neighbour of the same (batch,
    // head) with the next lower CTA index, which must therefore be scheduled first.
    const dim3 grid((params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, params.batch, params.num_heads);
    const cudaError_t err =
        launch_kernel<&flash_bwd_kernel<Traits, kCausal, kVariants>, Traits::kNThreads, Traits::kSmemBytes>(
            grid, params, stream);
    if (err != cudaSuccess) { return err; }
    // Shared memory: one (kBlockM, kHeadDim) dQ tile, staged for 16 B stores.
    constexpr int kConvertSmemBytes = Traits::kSmemQElems * int(sizeof(Element));
    const dim3 convert_grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.batch, params.num_heads);
    return launch_kernel<&flash_bwd_convert_dq_kernel<Traits>, Traits::kNThreads, kConvertSmemBytes>(convert_grid,
                                                                                                     params, stream);
}

template <typename Element, int kHeadDim, bool kCausal, bool kVariants, int kBudget>
cudaError_t run_bwd_on_mma_sync(const BwdParams& params, cudaStream_t stream) {
    if (params.head_dim_v != params.head_dim) {
        // A V narrower than Q and K that the plan left unpadded (Plan::narrow_v): the narrow-V form of the kernel,
        // which the plans pick for plain calls.
        if constexpr (narrow_v_shape(kHeadDim).exists() && !kVariants) {
            constexpr NarrowVShape kNarrow = narrow_v_shape(kHeadDim);
            if (params.head_dim_v > kNarrow.head_dim_v) { return cudaErrorInvalidConfiguration; }
            return run_bwd_mma_sync<Element, kHeadDim, kCausal, false, kBudget, kNarrow.head_dim_v>(params, stream);
        }
        return cudaErrorInvalidConfiguration;
    }
    // A head dim without a 99 KiB set runs a wider one's kernel (kernel_head_dim_for): never this one.
    static_assert(kBudget == kSmem99KiB || kBwdTileSet<KernelFamily::kMmaSync, kHeadDim, kBudget>.exists(),
                  "every compiled head dim has a 163 KiB set");
    if constexpr (kBwdTileSet<KernelFamily::kMmaSync, kHeadDim, kBudget>.exists()) {
        return run_bwd_mma_sync<Element, kHeadDim, kCausal, kVariants, kBudget>(params, stream);
    }
    return cudaErrorNotSupported;
}

}  // namespace flash
