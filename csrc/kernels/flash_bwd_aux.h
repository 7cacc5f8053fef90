// The two small kernels around the backward main kernel: D = rowsum(dO * O) before it, and the
// conversion of the fp32 dQ accumulator after it.
#pragma once

#include <cuda_runtime.h>

#include "launch/flash_params.h"

namespace flash {

// Writes params.dsum_ptr from params.do_ptr and params.o_ptr.
cudaError_t run_bwd_dot_do_o(const BwdParams& params, bool is_bf16, cudaStream_t stream);

// Writes params.dq_ptr = params.dq_accum_ptr * softmax_scale in the input dtype, for a dq_accum in (row, column)
// order (the Hopper backward's short-query tile's; the other kernels' dq_accum is in fragment order, dq_accum.h).
cudaError_t run_bwd_convert_dq(const BwdParams& params, bool is_bf16, cudaStream_t stream);

}  // namespace flash
