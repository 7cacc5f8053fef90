// Which kernel families the build holds. Compiled by nvcc with the kernels' flags, which the host compiler
// does not see: FLASH_ATTN2_SM90A (sm_90a code) and the tile-tuning defines (FLASH_FWD_TILE_M,
// FLASH_BWD_TILE_M), under which the launchers run the mma.sync kernels only.
#include "host/device_info.h"

namespace flash {

bool wgmma_fwd_built() {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    return true;
#else
    return false;
#endif
}

bool wgmma_bwd_built() {
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_BWD_TILE_M)
    return true;
#else
    return false;
#endif
}

}  // namespace flash
