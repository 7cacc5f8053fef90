// The tile shape of every kernel, per head dim: read by the launchers, which instantiate them, and by the host's
// plans (plan.cpp), whose heuristics need the block sizes. Plain constants: this header is also compiled by the
// host compiler.
#pragma once

#include <cstddef>
#include <utility>

#include "generated/kernel_list.h"

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

// Head dim 128 over short key sequences (FwdParams::short_key_tiles): a 128-row CTA with one CTA per SM sees
// only a few key blocks, so its Q load and output store are a large share of its time, with nothing else on
// the SM to overlap them. One-warpgroup CTAs of 64 rows and 64-key blocks fit two per SM in shared memory and
// registers, so one CTA's prologue and epilogue run under the other's MMAs.
template <int kHeadDim, bool kCausal>
struct FwdSm90ShortKeysTileConfig { static constexpr bool kEnabled = false; };
template <bool kCausal> struct FwdSm90ShortKeysTileConfig<128, kCausal> { static constexpr bool kEnabled = true; static constexpr int kBlockM = 64, kBlockN = 64, kCtasPerSm = 2; };
// The plans (plan.cpp) pick it at the short seqlen_k where it pays.

// (kBlockM, kBlockN, CTAs resident per SM) of the forward kernel that run_fwd launches, for the host's
// split-KV heuristic. Tile-tuning builds (FLASH_FWD_TILE_*, defined for nvcc only) and builds without sm_90a
// code launch other tiles than reported here; that only affects how well the heuristic fits.
struct FwdBlockShape {
    int block_m;
    int block_n;
    int ctas_per_sm;
};

template <int kHeadDim, bool kCausal>
constexpr FwdBlockShape fwd_block_shape_of(bool wgmma, bool short_keys) {
    if constexpr (FwdSm90ShortKeysTileConfig<kHeadDim, kCausal>::kEnabled) {
        using Config = FwdSm90ShortKeysTileConfig<kHeadDim, kCausal>;
        if (wgmma && short_keys) { return {Config::kBlockM, Config::kBlockN, Config::kCtasPerSm}; }
    }
    if constexpr (FwdSm90TileConfig<kHeadDim, kCausal>::kEnabled) {
        using Config = FwdSm90TileConfig<kHeadDim, kCausal>;
        if (wgmma) { return {Config::kBlockM, Config::kBlockN, Config::kCtasPerSm}; }
    }
    return {FwdTileConfig<kHeadDim, kCausal>::kBlockM, FwdTileConfig<kHeadDim, kCausal>::kBlockN, 1};
}

// kernel_head_dim: one of the compiled head dims (kKernelHeadDims).
template <bool kCausal, std::size_t... kIndex>
constexpr FwdBlockShape fwd_block_shape(int kernel_head_dim, bool wgmma, bool short_keys,
                                        std::index_sequence<kIndex...>) {
    FwdBlockShape shape{};
    ((kernel_head_dim == kKernelHeadDims[kIndex] &&
      (shape = fwd_block_shape_of<kKernelHeadDims[kIndex], kCausal>(wgmma, short_keys), true)) ||
     ...);
    return shape;
}

constexpr FwdBlockShape fwd_block_shape(int kernel_head_dim, bool causal, bool wgmma, bool short_keys) {
    constexpr auto kIndices = std::make_index_sequence<kNumKernelHeadDims>{};
    return causal ? fwd_block_shape<true>(kernel_head_dim, wgmma, short_keys, kIndices)
                  : fwd_block_shape<false>(kernel_head_dim, wgmma, short_keys, kIndices);
}

// Whether the Hopper forward of this kernel head dim has a short-key tile (FwdSm90ShortKeysTileConfig).
template <std::size_t... kIndex>
constexpr bool fwd_has_short_key_tile(int kernel_head_dim, std::index_sequence<kIndex...>) {
    return ((kernel_head_dim == kKernelHeadDims[kIndex] &&
             FwdSm90ShortKeysTileConfig<kKernelHeadDims[kIndex], false>::kEnabled) ||
            ...);
}
constexpr bool fwd_has_short_key_tile(int kernel_head_dim) {
    return fwd_has_short_key_tile(kernel_head_dim, std::make_index_sequence<kNumKernelHeadDims>{});
}

// The mma.sync backward's (query rows, keys) per block: dK and dV of kBlockN keys stay in registers, so wide
// heads take fewer keys per CTA. At head dim 64 the registers leave room for 128-row query blocks, which halve
// the steps (and barriers) per key block: 6% faster on an H200 (bench/results/h200/tune_bwd_nvidia-h200.md).
// BwdTileConfig (flash_bwd_launch.h) instantiates this rule.
constexpr int bwd_block_m(int kernel_head_dim) { return kernel_head_dim == 64 ? 128 : 64; }
constexpr int bwd_block_n(int kernel_head_dim) { return kernel_head_dim <= 128 ? 128 : 64; }

// Query rows per step and keys per CTA of the Hopper backward kernels (flash_bwd_launch.h), for the plans'
// choice of grid (flash_bwd_launch.h asserts its kernels match).
constexpr int kBwdSm90BlockM = 64;
constexpr int bwd_sm90_block_n(int head_dim) { return head_dim <= 128 ? 128 : 64; }
// Query rows per step of the Hopper backward's short-query tile (BwdParams::short_query_tiles), and the head
// dims that have one.
constexpr int kBwdSm90ShortBlockM = 16;
constexpr bool bwd_sm90_has_short_query_tile(int head_dim) { return head_dim == 128; }
// Query rows per step of the Hopper backward that a launch runs.
constexpr int bwd_sm90_block_m(int head_dim, bool short_query_tiles) {
    return short_query_tiles && bwd_sm90_has_short_query_tile(head_dim) ? kBwdSm90ShortBlockM : kBwdSm90BlockM;
}
// Whether that kernel can walk several key blocks per CTA (BwdParams::key_blocks_per_cta).
constexpr bool bwd_sm90_walks_key_blocks(int head_dim) { return head_dim <= 128; }

}  // namespace flash
