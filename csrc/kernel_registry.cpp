#include "kernel_registry.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace flash {

namespace {

using KeyTuple = std::tuple<bool, int, bool>;

// Function-local so registration from other translation units' static initializers is order-safe.
std::map<KeyTuple, FwdLauncher>& fwd_table() {
    static std::map<KeyTuple, FwdLauncher> table;
    return table;
}

KeyTuple as_tuple(const FwdKernelKey& key) { return {key.is_bf16, key.head_dim, key.causal}; }

}  // namespace

std::string fwd_kernel_name(const FwdKernelKey& key) {
    return "fwd_hdim" + std::to_string(key.head_dim) + (key.is_bf16 ? "_bf16" : "_fp16") +
           (key.causal ? "_causal" : "_noncausal");
}

bool register_fwd_launcher(const FwdKernelKey& key, FwdLauncher launcher) {
    fwd_table()[as_tuple(key)] = launcher;
    return true;
}

FwdLauncher find_fwd_launcher(const FwdKernelKey& key) {
    auto it = fwd_table().find(as_tuple(key));
    return it == fwd_table().end() ? nullptr : it->second;
}

std::vector<std::string> compiled_fwd_kernels() {
    std::vector<std::string> names;
    for (const auto& [key, launcher] : fwd_table()) {
        names.push_back(fwd_kernel_name({std::get<0>(key), std::get<1>(key), std::get<2>(key)}));
    }
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace flash
