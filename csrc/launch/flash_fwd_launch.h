// The forward's launcher of one (dtype, head dim, mask): the plan's kernel family, whose launchers compile in
// translation units of their own. Included only by the generated file that registers it.
#pragma once

#include <cuda_runtime.h>

#include "launch/flash_fwd_launch_common.h"
#include "launch/kernel_registry.h"

namespace flash {

// kVariants: the variants kernel (window, softcap, ALiBi, dropout; kCausal too), else a plain one.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    if (params.family == KernelFamily::kWgmma) {
        return run_fwd_on_wgmma<Element, kHeadDim, kCausal, kVariants>(params, stream);
    }
#endif
    return run_fwd_on_mma_sync<Element, kHeadDim, kCausal, kVariants>(params, stream);
}

}  // namespace flash
