#include "kernel_registry.h"

#include <array>

namespace flash {

namespace {

constexpr int kNumHeadDims = sizeof(kKernelHeadDims) / sizeof(kKernelHeadDims[0]);
constexpr int kNumSlots = kNumHeadDims * 2 * 2;

// Launchers are looked up on every call: an array indexed by (head dim, dtype, causal) rather than a map
// keyed by name. Returns -1 for a head dim that has no kernels.
int slot(const KernelKey& key) {
    for (int i = 0; i < kNumHeadDims; ++i) {
        if (kKernelHeadDims[i] == key.head_dim) { return (i * 2 + int(key.is_bf16)) * 2 + int(key.causal); }
    }
    return -1;
}

KernelKey key_of_slot(int index) {
    return {bool(index / 2 % 2), kKernelHeadDims[index / 4], bool(index % 2)};
}

// Function-local so registration from other translation units' static initializers is order-safe.
template <typename Launcher>
std::array<Launcher, kNumSlots>& launcher_table() {
    static std::array<Launcher, kNumSlots> table{};
    return table;
}

template <typename Launcher>
bool register_in_table(const KernelKey& key, Launcher launcher) {
    const int index = slot(key);
    if (index < 0) { return false; }
    launcher_table<Launcher>()[index] = launcher;
    return true;
}

template <typename Launcher>
Launcher find_launcher(const KernelKey& key) {
    const int index = slot(key);
    return index < 0 ? nullptr : launcher_table<Launcher>()[index];
}

template <typename Launcher>
void append_names(const char* pass, std::vector<std::string>& names) {
    for (int index = 0; index < kNumSlots; ++index) {
        if (launcher_table<Launcher>()[index] != nullptr) { names.push_back(kernel_name(pass, key_of_slot(index))); }
    }
}

}  // namespace

std::string kernel_name(const char* pass, const KernelKey& key) {
    return std::string(pass) + "_hdim" + std::to_string(key.head_dim) + (key.is_bf16 ? "_bf16" : "_fp16") +
           (key.causal ? "_causal" : "_noncausal");
}

bool register_launcher(const KernelKey& key, FwdLauncher launcher) { return register_in_table(key, launcher); }

bool register_launcher(const KernelKey& key, BwdLauncher launcher) { return register_in_table(key, launcher); }

FwdLauncher find_fwd_launcher(const KernelKey& key) { return find_launcher<FwdLauncher>(key); }

BwdLauncher find_bwd_launcher(const KernelKey& key) { return find_launcher<BwdLauncher>(key); }

std::vector<std::string> compiled_kernels() {
    std::vector<std::string> names;
    append_names<FwdLauncher>("fwd", names);
    append_names<BwdLauncher>("bwd", names);
    return names;
}

}  // namespace flash
