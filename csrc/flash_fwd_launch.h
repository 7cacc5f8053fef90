// Per-head-dim tile choice and the host-side launcher of the forward kernel. Included only by the
// generated instantiation files, one (dtype, head dim, causal) each.
#pragma once

#include <cuda_runtime.h>

#include "flash_fwd_kernel.h"
#include "flash_fwd_sm90_kernel.h"
#include "kernel_registry.h"
#include "launch.h"

namespace flash {

// (kBlockM, kBlockN, warps) per head dim, measured on an H200 with bench/tune_tiles.py for head dims
// 64, 128 and 256 (bench/results/h200/tune_fwd_nvidia-h200.md); 32 and 96 follow 64 and 128, and 160 to 224
// follow 256. Up to head dim 128, 128-row tiles on four warps (32 query rows a warp) beat eight warps of
// 16 rows even with a few bytes of spills: each K/V fragment read from shared memory feeds twice the MMAs.
// Causal hdim 128 prefers 64-row query blocks (less work wasted on the diagonal). Above 128 the
// accumulators leave no registers for 32 rows a warp, and 64x64 tiles on four warps win.
template <int kHeadDim, bool kCausal>
struct FwdTileConfig;
template <bool kCausal> struct FwdTileConfig<32, kCausal> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<64, kCausal> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<96, kCausal> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdTileConfig<128, false> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4; };
template <> struct FwdTileConfig<128, true> { static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<160, kCausal> { static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<192, kCausal> { static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<224, kCausal> { static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4; };
template <bool kCausal> struct FwdTileConfig<256, kCausal> { static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4; };

// Tile-tuning builds (bench/tune_tiles.py) force one tile shape on every kernel.
#if defined(FLASH_FWD_TILE_M) && defined(FLASH_FWD_TILE_N) && defined(FLASH_FWD_TILE_WARPS)
template <int kHeadDim, bool kCausal>
struct ForcedTileConfig { static constexpr int kBlockM = FLASH_FWD_TILE_M, kBlockN = FLASH_FWD_TILE_N, kNWarps = FLASH_FWD_TILE_WARPS; };
template <int kHeadDim, bool kCausal>
using SelectedTileConfig = ForcedTileConfig<kHeadDim, kCausal>;
#else
template <int kHeadDim, bool kCausal>
using SelectedTileConfig = FwdTileConfig<kHeadDim, kCausal>;
#endif

// Hopper (sm_90a) warpgroup-MMA kernel: (kBlockM, kBlockN, CTAs per SM) per head dim, warpgroups of 64 query
// rows. Head dims 32 and 64 fit two CTAs per SM in registers (at most 128 per thread), so one CTA's softmax and
// loads overlap the other's MMAs. 96 follows 128, and 160 and 224 follow 192 and 256.
template <int kHeadDim, bool kCausal>
struct FwdSm90TileConfig { static constexpr bool kEnabled = false; };
template <bool kCausal> struct FwdSm90TileConfig<32, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 2; };
template <bool kCausal> struct FwdSm90TileConfig<64, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 2; };
template <bool kCausal> struct FwdSm90TileConfig<96, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 128, kCtasPerSm = 1; };
template <bool kCausal> struct FwdSm90TileConfig<128, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 128, kCtasPerSm = 1; };
template <bool kCausal> struct FwdSm90TileConfig<160, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 1; };
template <bool kCausal> struct FwdSm90TileConfig<192, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 1; };
template <bool kCausal> struct FwdSm90TileConfig<224, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 1; };
template <bool kCausal> struct FwdSm90TileConfig<256, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 128, kBlockN = 64, kCtasPerSm = 1; };

template <typename Element, int kHeadDim, bool kCausal>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    if constexpr (FwdSm90TileConfig<kHeadDim, kCausal>::kEnabled) {
        if (params.use_wgmma) {
            using Config = FwdSm90TileConfig<kHeadDim, kCausal>;
            using Traits = FwdSm90KernelTraits<Element, kHeadDim, Config::kBlockM, Config::kBlockN, Config::kCtasPerSm>;
            const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.batch, params.num_heads);
            return launch_kernel<Traits::kNThreads, Traits::kSmemBytes>(&flash_fwd_sm90_kernel<Traits, kCausal>, grid,
                                                                        params, stream);
        }
    }
#endif
    using Config = SelectedTileConfig<kHeadDim, kCausal>;
    using Traits = FwdKernelTraits<Element, kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps>;
    const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.batch, params.num_heads);
    return launch_kernel<Traits::kNThreads, Traits::kSmemBytes>(&flash_fwd_kernel<Traits, kCausal>, grid, params,
                                                                stream);
}

}  // namespace flash
