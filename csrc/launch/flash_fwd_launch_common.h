// What the forward's launchers share: the grid's x extent, the tile sets, the plain kernels' forms, and the entry
// point of each kernel family. Each family's launchers compile in translation units of their own
// (flash_fwd_launch_mma_sync.h, flash_fwd_launch_sm90.h), which the build compiles for that family's archs only;
// flash_fwd_launch.h picks between them.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "launch/flash_params.h"
#include "launch/tile_size.h"

namespace flash {

// Query blocks times key splits (FwdTile decodes blockIdx.x).
inline unsigned fwd_grid_x(const FwdParams& params, int block_m) {
    return unsigned((params.seqlen_q + block_m - 1) / block_m) * unsigned(params.num_splits);
}

// The forward tile set of (family, head dim, budget) that the launchers compile (tile_size.h).
template <KernelFamily kFamily, int kHeadDim, int kBudget = base_smem_budget(kFamily)>
constexpr TileSet kFwdTileSet = tile_set(kFamily, Pass::kFwd, kHeadDim, kBudget);

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

// The forward of one (dtype, head dim, mask) on each family's kernels, for the plan's tile set and form
// (kVariants: the variants kernel, with window, softcap, ALiBi and dropout; kCausal too; else a plain one).
// Defined in flash_fwd_launch_mma_sync.h and flash_fwd_launch_sm90.h, instantiated in the generated files.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd_on_mma_sync(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_fwd_on_wgmma(const FwdParams& params, cudaStream_t stream);

}  // namespace flash

// One family's forward of one (dtype, head dim, mask), compiled in the generated file that names it.
#define FLASH_INSTANTIATE_FWD(FAMILY_RUN, ELEMENT, HEAD_DIM, CAUSAL, VARIANTS) \
    template cudaError_t flash::FAMILY_RUN<ELEMENT, HEAD_DIM, CAUSAL, VARIANTS>(const flash::FwdParams&, cudaStream_t);
