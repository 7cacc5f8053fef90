// Emulating a GPU with less shared memory per SM on a larger one (FLASH_ATTN2_MAX_SMEM), for the launchers.
// Defined in host/device_info.cpp, which reads the variable.
#pragma once

namespace flash {

// Whether FLASH_ATTN2_MAX_SMEM makes this process emulate a GPU with less shared memory (device_info.cpp; read
// once). Planning as on that GPU picks its tiles; the carveout below also gives each SM only what that GPU's SM
// holds, so that as many CTAs share an SM as would there: a tile that fits twice into an H200's 228 KiB but once
// into an A100's 164 KiB runs one CTA per SM, as on the A100.
bool smem_per_sm_emulated();
// The preferred shared-memory carveout (percent of the SM's largest) that kernels launch with on `device` under
// that emulation: the emulated GPU's shared memory per SM (its opt-in per block plus the 1 KiB the driver reserves
// per block), rounded down, which the driver rounds up to a configuration the SM offers. -1 where nothing is
// emulated, or where the emulated GPU has as much as this one.
int emulated_smem_carveout(int device);

}  // namespace flash
