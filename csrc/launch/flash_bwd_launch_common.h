// What the backward's launchers share: the tile sets and the entry point of each kernel family. Each family's
// launchers compile in translation units of their own (flash_bwd_launch_mma_sync.h, flash_bwd_launch_sm90.h), which
// the build compiles for that family's archs only. flash_bwd_launch.h picks between them.
#pragma once

#include <cuda_runtime.h>

#include "launch/flash_params.h"
#include "launch/tile_size.h"

namespace flash {

// The backward tile set of (family, head dim, budget) that the launchers compile (tile_size.h); !exists() where
// the table has none (a head dim that runs a wider one's kernel on that budget).
template <KernelFamily kFamily, int kHeadDim, int kBudget = base_smem_budget(kFamily)>
constexpr TileSet kBwdTileSet = tile_set(kFamily, Pass::kBwd, kHeadDim, kBudget);

// dq_accum zeroed, for a kernel that adds every dQ tile into it (BwdParams::dq_accum_ptr).
inline cudaError_t zero_dq_accum(const BwdParams& params, cudaStream_t stream) {
    return params.dq_accum_bytes == 0
               ? cudaSuccess
               : cudaMemsetAsync(params.dq_accum_ptr, 0, static_cast<size_t>(params.dq_accum_bytes), stream);
}

// The backward of one (dtype, head dim, mask) on each family's kernels: the mma.sync kernel of the set of kBudget,
// and the Hopper kernels. Defined in flash_bwd_launch_mma_sync.h and flash_bwd_launch_sm90.h, instantiated in the
// generated files.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants, int kBudget>
cudaError_t run_bwd_on_mma_sync(const BwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_bwd_on_wgmma(const BwdParams& params, cudaStream_t stream);

}  // namespace flash

// One family's backward of one (dtype, head dim, mask), compiled in the generated file that names it: the mma.sync
// one, per tile set (BUDGET), in one file or a file per set (csrc/generate.py, kernel_parts). Each file names what
// the others compile with the EXTERN forms, so that it does not compile those kernels again.
#define FLASH_BWD_MMA_SYNC_LAUNCHER(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET)                                 \
    cudaError_t flash::run_bwd_on_mma_sync<ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET>(const flash::BwdParams&, \
                                                                                        cudaStream_t)
#define FLASH_INSTANTIATE_BWD_MMA_SYNC(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET) \
    template FLASH_BWD_MMA_SYNC_LAUNCHER(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET);
#define FLASH_EXTERN_BWD_MMA_SYNC(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET) \
    extern template FLASH_BWD_MMA_SYNC_LAUNCHER(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS, BUDGET);
#define FLASH_INSTANTIATE_BWD_WGMMA(ELEMENT, HEAD_DIM, CAUSAL, VARIANTS)                                       \
    template cudaError_t flash::run_bwd_on_wgmma<ELEMENT, HEAD_DIM, CAUSAL, VARIANTS>(const flash::BwdParams&, \
                                                                                      cudaStream_t);
