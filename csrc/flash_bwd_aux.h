// The two small kernels around the backward main kernel: D = rowsum(dO * O) before it, and the
// conversion of the fp32 dQ accumulator after it.
#pragma once

#include <cuda_runtime.h>

#include "flash_params.h"

namespace flash {

// Writes params.dsum_ptr from params.do_ptr and params.o_ptr.
cudaError_t run_bwd_dot_do_o(const BwdParams& params, bool is_bf16, cudaStream_t stream);

// Writes params.dq_ptr = params.dq_accum_ptr * softmax_scale in the input dtype.
cudaError_t run_bwd_convert_dq(const BwdParams& params, bool is_bf16, cudaStream_t stream);

// Whether the build has the Hopper backward kernels (sm_90a, not a tile-tuning build): on an sm_90 GPU
// outside deterministic mode they run, and they can walk a whole GQA group per CTA (BwdParams::heads_per_cta)
// and, up to head dim 128, several key blocks (BwdParams::key_blocks_per_cta).
bool has_sm90_bwd_kernels();

}  // namespace flash
