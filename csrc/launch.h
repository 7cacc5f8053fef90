// Launching a kernel that may need more than the default 48 KB of dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

namespace flash {

// Opts `kernel` in to kSmemBytes of dynamic shared memory when that exceeds 48 KB (the setting is per
// device, so it is made at every launch; a cheap driver call), launches it on `stream`, and returns the
// launch status.
template <int kThreads, int kSmemBytes, typename Params>
cudaError_t launch_kernel(void (*kernel)(Params), dim3 grid, const Params& params, cudaStream_t stream) {
    if constexpr (kSmemBytes > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        if (err != cudaSuccess) { return err; }
    }
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
    return cudaGetLastError();
}

}  // namespace flash
