// Runtime-to-compile-time dispatch: every generated instantiation file registers its launcher here,
// and the host looks launchers up by (pass, dtype, head dim, mask). A build that skipped some
// instantiations simply has fewer entries, so the ops can name what is missing.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "launch/flash_params.h"
#include "launch/kernel_key.h"

namespace flash {

// Launch the kernel on `stream` and return the launch status.
using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);

// "fwd_hdim128_bf16_causal", the name of the generated file (kernel_list.h).
std::string kernel_name(Pass pass, const KernelKey& key);

// Called from static initializers in the instantiation files.
bool register_launcher(const KernelKey& key, FwdLauncher launcher);
bool register_launcher(const KernelKey& key, BwdLauncher launcher);

// nullptr when the build does not contain this configuration.
FwdLauncher find_fwd_launcher(const KernelKey& key);
BwdLauncher find_bwd_launcher(const KernelKey& key);

std::vector<std::string> compiled_kernels();

}  // namespace flash

// Used once per generated .cu file; RUN is run_fwd or run_bwd.
#define FLASH_REGISTER_KERNEL(RUN, ELEMENT, IS_BF16, HEAD_DIM, CAUSAL, VARIANTS, TAG)                                 \
    namespace {                                                                                                       \
    const bool registered_##TAG = ::flash::register_launcher(::flash::KernelKey{IS_BF16, HEAD_DIM, CAUSAL, VARIANTS}, \
                                                             &::flash::RUN<ELEMENT, HEAD_DIM, CAUSAL, VARIANTS>);     \
    }
