// Launching a kernel that may need more than the default 48 KB of dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "launch/smem_emulation.h"

namespace flash {

constexpr int kMaxGridY = 65535;

// Every grid is (blocks of a sequence, sequences, heads), but grid y stops at kMaxGridY: a batch of more
// sequences is launched in chunks of at most kMaxGridY, each told its first sequence in params.batch_offset
// (sequence_of_cta). Launches on one stream run one after the other, so the chunks keep the CTA order that
// deterministic mode relies on. launch_one(grid, params) launches one chunk and returns its status.
template <typename Params, typename LaunchOne>
cudaError_t launch_in_batch_chunks(dim3 grid, const Params& params, LaunchOne launch_one) {
    if (params.batch <= kMaxGridY) {
        grid.y = unsigned(params.batch);
        return launch_one(grid, params);
    }
    Params chunk = params;
    for (int first = 0; first < params.batch; first += kMaxGridY) {
        chunk.batch_offset = first;
        grid.y = unsigned(std::min(params.batch - first, kMaxGridY));
        const cudaError_t err = launch_one(grid, chunk);
        if (err != cudaSuccess) { return err; }
    }
    return cudaSuccess;
}

// Launches kKernel on `stream` over `grid` (its y: the batch, see launch_in_batch_chunks) with smem_bytes (at
// most kSmemBytes, the most any launch of it takes) of dynamic shared memory and returns the launch status.
// Above 48 KB the kernel must be opted in to kSmemBytes first. The opt-in holds per device (its primary
// context) once made, so it is made on a device's first launch only: decoding-sized calls are host-bound, and
// each driver call counts. The emulated carveout (smem_emulation.h) is set the same way, on every kernel. The
// kernel is a template argument so that each kernel keeps its own record.
// kernel_arg(chunk_params) makes the kernel's argument from a chunk's params, for kernels that take more than the
// params (launch_kernel passes them as they are).
template <auto kKernel, int kThreads, int kSmemBytes, typename Params, typename KernelArg>
cudaError_t launch_kernel_with(dim3 grid, const Params& params, cudaStream_t stream, int smem_bytes,
                               KernelArg kernel_arg) {
    if (kSmemBytes > 48 * 1024 || smem_per_sm_emulated()) {
        static std::atomic<uint64_t> prepared_devices{0};  // bit d: done on device d (devices 0-63)
        int device = 0;
        cudaError_t err = cudaGetDevice(&device);
        if (err != cudaSuccess) { return err; }
        const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
        if (bit == 0 || (prepared_devices.load(std::memory_order_relaxed) & bit) == 0) {
            if constexpr (kSmemBytes > 48 * 1024) {
                err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
                if (err != cudaSuccess) { return err; }
            }
            const int carveout = emulated_smem_carveout(device);
            if (carveout >= 0) {
                err = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
                if (err != cudaSuccess) { return err; }
            }
            prepared_devices.fetch_or(bit, std::memory_order_relaxed);
        }
    }
    return launch_in_batch_chunks(grid, params, [&](dim3 chunk_grid, const Params& chunk_params) {
        kKernel<<<chunk_grid, kThreads, smem_bytes, stream>>>(kernel_arg(chunk_params));
        return cudaGetLastError();
    });
}
template <auto kKernel, int kThreads, int kSmemBytes, typename Params>
cudaError_t launch_kernel(dim3 grid, const Params& params, cudaStream_t stream, int smem_bytes = kSmemBytes) {
    return launch_kernel_with<kKernel, kThreads, kSmemBytes>(grid, params, stream, smem_bytes,
                                                             [](const Params& chunk) { return chunk; });
}

// Launches the persistent kernel kKernel, whose argument is `arg`, for `units` units of work (none: no launch): one
// CTA per SM of the current device, or one per unit where there are fewer. Its CTAs find their sequences from their
// schedule, not from grid y, so the launch is one piece whatever the batch: launch_kernel_with, which splits launches
// by params.batch, gets a one-sequence copy of the params. With group > 1 (no more than the SMs) the grid is a
// multiple of `group` CTAs, so that each round of a walk (units c, c + grid, ...) holds whole groups of units; a
// group the kernel only prefers (group_optional) is dropped where it would leave more than an eighth of the SMs
// idle.
template <auto kKernel, int kThreads, int kSmemBytes, typename Params, typename Arg>
cudaError_t launch_persistent(int units, const Params& params, cudaStream_t stream, const Arg& arg, int group = 1,
                              bool group_optional = false) {
    if (units <= 0) { return cudaSuccess; }
    int device = 0;
    int sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) { err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); }
    if (err != cudaSuccess) { return err; }
    sms = std::max(sms, 1);
    const int grouped = group > 1 && group <= sms ? sms / group * group : sms;
    const int ctas = group_optional && grouped * 8 < sms * 7 ? sms : grouped;
    const dim3 grid(unsigned(std::min(units, ctas)));
    Params one_piece = params;
    one_piece.batch = 1;
    return launch_kernel_with<kKernel, kThreads, kSmemBytes>(grid, one_piece, stream, kSmemBytes,
                                                             [&](const Params&) { return arg; });
}

}  // namespace flash
