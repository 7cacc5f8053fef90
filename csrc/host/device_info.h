// What the host asks of the GPU and of the build: device attributes (cached), and the Target a plan is made
// for.
#pragma once

#include <cuda_runtime.h>

#include "host/plan.h"

namespace flash {

// cudaDeviceGetAttribute, cached per device for the attributes every call asks for. -1 when the query fails.
int device_attribute(cudaDeviceAttr attr, int device);

// The build's Hopper kernels (build_info.cu, compiled with the kernels' flags).
bool wgmma_fwd_built();
bool wgmma_bwd_built();

// `device` and this build. noncausal_built: whether the call's dtype and head dim have a non-causal kernel.
Target target_of(int device, bool noncausal_built);

}  // namespace flash
