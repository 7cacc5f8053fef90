#include "launch/kernel_registry.h"

#include <array>
#include <cstdlib>
#include <type_traits>

namespace flash {

namespace {

constexpr int kNumSlots = kNumKernelHeadDims * kNumDtypes * kNumMasks;

// Launchers are looked up on every call: an array indexed by (head dim, dtype, mask) rather than a map
// keyed by name. Returns -1 for a head dim that has no kernels.
int slot(const KernelKey& key) {
    for (int i = 0; i < kNumKernelHeadDims; ++i) {
        if (kKernelHeadDims[i] == key.head_dim) { return (i * kNumDtypes + int(key.is_bf16)) * kNumMasks + key.mask(); }
    }
    return -1;
}

const char* name_of_slot(Pass pass, int index) {
    return kKernelNames[int(pass)][index / (kNumDtypes * kNumMasks)][index / kNumMasks % kNumDtypes][index % kNumMasks];
}

// Function-local so registration from other translation units' static initializers is order-safe.
template <typename Launcher>
std::array<Launcher, kNumSlots>& launcher_table() {
    static std::array<Launcher, kNumSlots> table{};
    return table;
}

template <typename Launcher>
constexpr Pass pass_of = std::is_same_v<Launcher, FwdLauncher> ? Pass::kFwd : Pass::kBwd;

// Kernels named in FLASH_ATTN2_HIDE_KERNELS (comma-separated names as compiled_kernels() lists them) stay out of
// the table, as if the build had skipped them. A full build has no missing kernel otherwise, so this is what lets
// the errors for a missing kernel be tested on a GPU. Read once, at the first registration.
bool hidden(Pass pass, int index) {
    static const std::string list = [] {
        const char* value = std::getenv("FLASH_ATTN2_HIDE_KERNELS");
        return value != nullptr ? "," + std::string(value) + "," : std::string();
    }();
    return !list.empty() && list.find("," + std::string(name_of_slot(pass, index)) + ",") != std::string::npos;
}

template <typename Launcher>
bool register_in_table(const KernelKey& key, Launcher launcher) {
    const int index = slot(key);
    if (index < 0) { return false; }
    if (hidden(pass_of<Launcher>, index)) { return true; }
    launcher_table<Launcher>()[index] = launcher;
    return true;
}

template <typename Launcher>
Launcher find_launcher(const KernelKey& key) {
    const int index = slot(key);
    return index < 0 ? nullptr : launcher_table<Launcher>()[index];
}

template <typename Launcher>
void append_names(Pass pass, std::vector<std::string>& names) {
    for (int index = 0; index < kNumSlots; ++index) {
        if (launcher_table<Launcher>()[index] != nullptr) { names.push_back(name_of_slot(pass, index)); }
    }
}

}  // namespace

std::string kernel_name(Pass pass, const KernelKey& key) {
    const int index = slot(key);
    return index < 0 ? "(no kernel of head dim " + std::to_string(key.head_dim) + ")" : name_of_slot(pass, index);
}

bool register_launcher(const KernelKey& key, FwdLauncher launcher) { return register_in_table(key, launcher); }

bool register_launcher(const KernelKey& key, BwdLauncher launcher) { return register_in_table(key, launcher); }

FwdLauncher find_fwd_launcher(const KernelKey& key) { return find_launcher<FwdLauncher>(key); }

BwdLauncher find_bwd_launcher(const KernelKey& key) { return find_launcher<BwdLauncher>(key); }

std::vector<std::string> compiled_kernels() {
    std::vector<std::string> names;
    append_names<FwdLauncher>(Pass::kFwd, names);
    append_names<BwdLauncher>(Pass::kBwd, names);
    return names;
}

}  // namespace flash
