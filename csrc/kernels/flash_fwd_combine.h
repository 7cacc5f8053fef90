// Second step of a split-KV forward: merges the per-split fp32 partials into the output and LSE.
#pragma once

#include <cuda_runtime.h>

#include "launch/flash_params.h"

namespace flash {

// Reads params.o_accum_ptr and params.lse_accum_ptr (params.num_splits > 1) and writes params.o_ptr in the
// input dtype and params.lse_ptr: lse = log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) * o_s.
cudaError_t run_fwd_combine(const FwdParams& params, bool is_bf16, cudaStream_t stream);

}  // namespace flash
