#include "host/device_info.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "launch/smem_emulation.h"

namespace flash {

int device_attribute(cudaDeviceAttr attr, int device) {
    constexpr cudaDeviceAttr kCachedAttrs[] = {cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
                                               cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               cudaDevAttrMaxSharedMemoryPerMultiprocessor};
    constexpr int kNumAttrs = sizeof(kCachedAttrs) / sizeof(kCachedAttrs[0]);
    constexpr int kMaxCachedDevices = 64;
    static std::atomic<int> cache[kNumAttrs][kMaxCachedDevices];  // value + 1; 0: not queried yet
    const int slot = int(std::find(kCachedAttrs, kCachedAttrs + kNumAttrs, attr) - kCachedAttrs);
    const bool cached = slot < kNumAttrs && device >= 0 && device < kMaxCachedDevices;
    if (cached) {
        const int stored = cache[slot][device].load(std::memory_order_relaxed);
        if (stored > 0) { return stored - 1; }
    }
    int value = 0;
    if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) { return -1; }
    if (cached) { cache[slot][device].store(value + 1, std::memory_order_relaxed); }
    return value;
}

namespace {

// FLASH_ATTN2_DISABLE_WGMMA=1 runs the mma.sync kernels on Hopper for the whole process. Read once, at the
// first call: per-call choices are op arguments (plan_override), which torch.compile and CUDA graphs see.
FamilySet disabled_families() {
    static const FamilySet disabled = [] {
        const char* value = std::getenv("FLASH_ATTN2_DISABLE_WGMMA");
        const bool wgmma_off = value != nullptr && std::strcmp(value, "1") == 0;
        return wgmma_off ? FamilySet{}.with(KernelFamily::kWgmma) : FamilySet{};
    }();
    return disabled;
}

// FLASH_ATTN2_MAX_SMEM=bytes plans every call of the process as on a GPU with at most that much shared memory
// per block, as plan_override's max_smem does per call: a test run of the 99 KiB tile sets on a larger GPU.
// Read once; -1 when unset, 0 when not an integer in [1, kMaxForcedSmem] (target_of refuses it).
int max_smem_limit() {
    static const int limit = [] {
        const char* value = std::getenv("FLASH_ATTN2_MAX_SMEM");
        if (value == nullptr) { return -1; }
        char* end = nullptr;
        const long bytes = std::strtol(value, &end, 10);
        const bool valid = end != value && *end == '\0' && bytes > 0 && bytes <= kMaxForcedSmem;
        return valid ? static_cast<int>(bytes) : 0;
    }();
    return limit;
}

}  // namespace

bool smem_per_sm_emulated() { return max_smem_limit() > 0; }

int emulated_smem_carveout(int device) {
    if (!smem_per_sm_emulated()) { return -1; }
    const int emulated_per_sm = max_smem_limit() + kSmemReservedPerBlock;
    const int per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (per_sm <= 0 || emulated_per_sm >= per_sm) { return -1; }
    return static_cast<int>(int64_t(100) * emulated_per_sm / per_sm);
}

Target target_of(int device, bool noncausal_built) {
    Target target{};
    target.cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
    target.cc_minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
    target.num_sms = std::max(device_attribute(cudaDevAttrMultiProcessorCount, device), 1);
    target.max_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    target.smem_per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (max_smem_limit() == 0) {
        throw std::invalid_argument(
            "FLASH_ATTN2_MAX_SMEM must be bytes of shared memory per block, an integer in [1, " +
            std::to_string(kMaxForcedSmem) + "], got '" + std::getenv("FLASH_ATTN2_MAX_SMEM") + "'");
    }
    if (max_smem_limit() > 0) { limit_smem(target, max_smem_limit()); }
    target.fwd_built = built_families(Pass::kFwd);
    target.bwd_built = built_families(Pass::kBwd);
    target.disabled = disabled_families();
    target.noncausal_built = noncausal_built;
    return target;
}

}  // namespace flash
