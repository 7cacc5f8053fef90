// Runtime-to-compile-time dispatch: every generated instantiation file registers its launcher here,
// and the op looks the launcher up by (dtype, head dim, causal). A build that skipped some
// instantiations simply has fewer entries, so the op can name what is missing.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "flash_params.h"

namespace flash {

// Launches the kernel on `stream` and returns the launch status.
using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);

struct FwdKernelKey {
    bool is_bf16;
    int head_dim;  // the kernel's compile-time head dim
    bool causal;
};

std::string fwd_kernel_name(const FwdKernelKey& key);

// Registers a launcher; called from static initializers in the instantiation files.
bool register_fwd_launcher(const FwdKernelKey& key, FwdLauncher launcher);

// Returns nullptr when the build does not contain this configuration.
FwdLauncher find_fwd_launcher(const FwdKernelKey& key);

std::vector<std::string> compiled_fwd_kernels();

}  // namespace flash

// Used once per generated .cu file.
#define FLASH_REGISTER_FWD(ELEMENT, IS_BF16, HEAD_DIM, CAUSAL, TAG)                                   \
    namespace {                                                                                    \
    const bool registered_##TAG = ::flash::register_fwd_launcher(                                  \
        ::flash::FwdKernelKey{IS_BF16, HEAD_DIM, CAUSAL}, &::flash::run_fwd<ELEMENT, HEAD_DIM, CAUSAL>); \
    }
