// What the host asks of the GPU and of the build: device attributes (cached), the kernel families the build
// holds, and the Target a plan is made for.
#pragma once

#include <cuda_runtime.h>

#include "host/plan.h"

namespace flash {

// cudaDeviceGetAttribute, cached per device for the attributes every call asks for. -1 when the query fails.
int device_attribute(cudaDeviceAttr attr, int device);

// The kernel families whose kernels of `pass` the build holds (build_info.cu, compiled with the kernels'
// flags): mma.sync always; wgmma with sm_90a code, outside tile-tuning builds of that pass.
FamilySet built_families(Pass pass);

// The documented opt-in shared memory per block, in bytes, of compute capability cc_major.cc_minor (the CUDA
// programming guide's table of compute capabilities), or -1 for a GPU not listed: the plan op's default for a
// named arch.
constexpr int documented_max_smem(int cc_major, int cc_minor) {
    const int arch = cc_major * 10 + cc_minor;
    switch (arch) {
        case 80:
        case 87: return 163 * 1024;
        case 86:
        case 89:
        case 120:
        case 121: return 99 * 1024;
        case 90:
        case 100:
        case 103: return 227 * 1024;
        default: return -1;
    }
}

// `device` and this build. noncausal_built: whether the call's dtype and head dim have a non-causal kernel.
Target target_of(int device, bool noncausal_built);

}  // namespace flash
