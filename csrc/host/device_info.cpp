#include "host/device_info.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flash {

int device_attribute(cudaDeviceAttr attr, int device) {
    constexpr cudaDeviceAttr kCachedAttrs[] = {cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
                                               cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin};
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

}  // namespace

Target target_of(int device, bool noncausal_built) {
    Target target{};
    target.cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
    target.cc_minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
    target.num_sms = std::max(device_attribute(cudaDevAttrMultiProcessorCount, device), 1);
    target.max_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    target.fwd_built = built_families(Pass::kFwd);
    target.bwd_built = built_families(Pass::kBwd);
    target.disabled = disabled_families();
    target.noncausal_built = noncausal_built;
    return target;
}

}  // namespace flash
