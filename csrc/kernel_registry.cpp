#include "kernel_registry.h"

#include <map>

namespace flash {

namespace {

// Function-local so registration from other translation units' static initializers is order-safe.
template <typename Launcher>
std::map<std::string, Launcher>& launcher_table() {
    static std::map<std::string, Launcher> table;
    return table;
}

template <typename Launcher>
Launcher find_launcher(const std::string& name) {
    const auto& table = launcher_table<Launcher>();
    const auto it = table.find(name);
    return it == table.end() ? nullptr : it->second;
}

}  // namespace

std::string kernel_name(const char* pass, const KernelKey& key) {
    return std::string(pass) + "_hdim" + std::to_string(key.head_dim) + (key.is_bf16 ? "_bf16" : "_fp16") +
           (key.causal ? "_causal" : "_noncausal");
}

bool register_launcher(const KernelKey& key, FwdLauncher launcher) {
    launcher_table<FwdLauncher>()[kernel_name("fwd", key)] = launcher;
    return true;
}

bool register_launcher(const KernelKey& key, BwdLauncher launcher) {
    launcher_table<BwdLauncher>()[kernel_name("bwd", key)] = launcher;
    return true;
}

FwdLauncher find_fwd_launcher(const KernelKey& key) { return find_launcher<FwdLauncher>(kernel_name("fwd", key)); }

BwdLauncher find_bwd_launcher(const KernelKey& key) { return find_launcher<BwdLauncher>(kernel_name("bwd", key)); }

std::vector<std::string> compiled_kernels() {
    std::vector<std::string> names;
    for (const auto& entry : launcher_table<FwdLauncher>()) { names.push_back(entry.first); }
    for (const auto& entry : launcher_table<BwdLauncher>()) { names.push_back(entry.first); }
    return names;
}

}  // namespace flash
