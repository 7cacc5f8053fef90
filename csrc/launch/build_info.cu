// Which kernel families the build holds. Compiled by nvcc with the kernels' flags, which the host compiler
// does not see: FLASH_ATTN2_SM90A (sm_90a code) and the tile-tuning defines (FLASH_FWD_TILE_M,
// FLASH_BWD_TILE_M), under which the launchers run the mma.sync kernels only.
#include "host/device_info.h"

namespace flash {

FamilySet built_families([[maybe_unused]] Pass pass) {
    // Every launcher holds its mma.sync kernel.
    FamilySet families = FamilySet{}.with(KernelFamily::kMmaSync);
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_FWD_TILE_M)
    if (pass == Pass::kFwd) { families = families.with(KernelFamily::kWgmma); }
#endif
#if defined(FLASH_ATTN2_SM90A) && !defined(FLASH_BWD_TILE_M)
    if (pass == Pass::kBwd) { families = families.with(KernelFamily::kWgmma); }
#endif
    return families;
}

}  // namespace flash
