// The backward's launcher of one (dtype, head dim, mask): the plan's kernel family and tile set, whose launchers
// compile in translation units of their own. Included only by the generated file that registers it.
#pragma once

#include <cuda_runtime.h>

#include "launch/flash_bwd_launch_common.h"
#include "launch/kernel_registry.h"

namespace flash {

// kVariants: as in run_fwd.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_BWD_TILE_M)
    if (params.family == KernelFamily::kWgmma) {
        return run_bwd_on_wgmma<Element, kHeadDim, kCausal, kVariants>(params, stream);
    }
#endif
    // Only the Hopper kernels walk several query heads or key blocks per CTA; the plan sets them only for
    // those (built_families).
    if (params.heads_per_cta != 1 || params.key_blocks_per_cta != 1) { return cudaErrorNotSupported; }
    if (const cudaError_t err = zero_dq_accum(params, stream); err != cudaSuccess) { return err; }
    if (params.mma_sync_tile_set == MmaSyncTileSet::k99KiB) {
        return run_bwd_on_mma_sync<Element, kHeadDim, kCausal, kVariants, kSmem99KiB>(params, stream);
    }
    return run_bwd_on_mma_sync<Element, kHeadDim, kCausal, kVariants, kSmem163KiB>(params, stream);
}

}  // namespace flash
