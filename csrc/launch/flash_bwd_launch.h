// The host-side launcher of the backward kernel (tile shapes per head dim in tile_size.h). Included only by
// the generated backward instantiation files.
#pragma once

#include <cuda_runtime.h>

#include "kernels/flash_bwd_kernel.h"
#include "kernels/flash_bwd_sm90_kernel.h"
#include "launch/kernel_registry.h"
#include "launch/launch.h"
#include "launch/tile_size.h"

namespace flash {

// The mma.sync backward's tile per head dim (bwd_block_m, bwd_block_n in tile_size.h).
template <int kHeadDim>
struct BwdTileConfig {
    static constexpr int kBlockM = bwd_block_m(kHeadDim);
    static constexpr int kBlockN = bwd_block_n(kHeadDim);
};

// Tile-tuning builds (bench/tune_tiles.py --pass bwd) force one tile shape on every backward kernel.
#if defined(FLASH_BWD_TILE_M) && defined(FLASH_BWD_TILE_N)
template <int kHeadDim>
struct SelectedBwdTileConfig { static constexpr int kBlockM = FLASH_BWD_TILE_M, kBlockN = FLASH_BWD_TILE_N; };
#else
template <int kHeadDim>
using SelectedBwdTileConfig = BwdTileConfig<kHeadDim>;
#endif

// Hopper (sm_90a) warpgroup-MMA backward: 64 query rows by 128 keys up to head dim 128 (16 rows for short
// queries at head dim 128), 64 by 64 (P and dS through shared memory) above. Deterministic mode runs the
// mma.sync kernel.
enum class BwdSm90Kind { kNarrow, kWide };
template <int kHeadDim>
constexpr BwdSm90Kind kBwdSm90Kind = kHeadDim <= 128 ? BwdSm90Kind::kNarrow : BwdSm90Kind::kWide;

template <class Traits, auto kKernel>
cudaError_t launch_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
    static_assert(Traits::kBlockN == bwd_sm90_block_n(Traits::kHeadDim) &&
                      (Traits::kBlockM == kBwdSm90BlockM ||
                       (Traits::kBlockM == kBwdSm90ShortBlockM && bwd_sm90_has_short_query_tile(Traits::kHeadDim))),
                  "the host sizes its grid decisions by them");
    static_assert((Traits::kStagesKV > 1) == bwd_sm90_walks_key_blocks(Traits::kHeadDim),
                  "the host sets key_blocks_per_cta by it");
    if (params.key_blocks_per_cta < 1 || (Traits::kStagesKV == 1 && params.key_blocks_per_cta != 1)) {
        return cudaErrorNotSupported;
    }
    const int n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const dim3 grid((n_blocks + params.key_blocks_per_cta - 1) / params.key_blocks_per_cta, params.batch,
                    params.num_heads / params.heads_per_cta);
    const int smem_bytes = params.key_blocks_per_cta > 1 ? Traits::kSmemBytes : Traits::kSmemBytesOneKV;
    return launch_kernel<kKernel, Traits::kNThreads, Traits::kSmemBytes>(grid, params, stream, smem_bytes);
}

// kVariants: as in run_fwd.
template <typename Element, int kHeadDim, bool kCausal, bool kVariants>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_BWD_TILE_M)
    if (params.use_wgmma && !params.deterministic) {
        if constexpr (kBwdSm90Kind<kHeadDim> == BwdSm90Kind::kNarrow) {
            if constexpr (bwd_sm90_has_short_query_tile(kHeadDim)) {
                if (params.short_query_tiles) {
                    using Traits = BwdSm90KernelTraits<Element, kHeadDim, kBwdSm90ShortBlockM, 128>;
                    return launch_bwd_sm90<Traits, &flash_bwd_sm90_kernel<Traits, kCausal, kVariants>>(params, stream);
                }
            }
            using Traits = BwdSm90KernelTraits<Element, kHeadDim, kBwdSm90BlockM, 128>;
            return launch_bwd_sm90<Traits, &flash_bwd_sm90_kernel<Traits, kCausal, kVariants>>(params, stream);
        } else if constexpr (kBwdSm90Kind<kHeadDim> == BwdSm90Kind::kWide) {
            using Traits = BwdSm90WideKernelTraits<Element, kHeadDim>;
            return launch_bwd_sm90<Traits, &flash_bwd_sm90_wide_kernel<Traits, kCausal, kVariants>>(params, stream);
        }
    }
#endif
    // Only the Hopper kernels walk several query heads or key blocks per CTA; the plan sets them only for
    // those (wgmma_bwd_built()).
    if (params.heads_per_cta != 1 || params.key_blocks_per_cta != 1) { return cudaErrorNotSupported; }
    using Config = SelectedBwdTileConfig<kHeadDim>;
    static_assert(Config::kBlockM >= kBwdMinBlockM && Config::kBlockM <= kBwdMaxBlockM);
    using Traits = BwdKernelTraits<Element, kHeadDim, Config::kBlockM, Config::kBlockN>;
    // Key blocks along x: in deterministic mode a key block waits on its neighbour of the same (batch,
    // head) with the next lower CTA index, which must therefore be scheduled first.
    const dim3 grid((params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, params.batch, params.num_heads);
    return launch_kernel<&flash_bwd_kernel<Traits, kCausal, kVariants>, Traits::kNThreads, Traits::kSmemBytes>(
        grid, params, stream);
}

}  // namespace flash
