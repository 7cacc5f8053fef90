// Input checks of the ops. Every message names the argument at fault; every check that needs no device runs
// before the device checks, so argument errors read the same on any device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torch_glue.h"

namespace flash {

// A variable-length batch. Its (total, heads, head_dim) tensors travel as (1, total, heads, head_dim) views,
// so the dense checks and strides apply unchanged.
struct Varlen {
    const Tensor& cu_seqlens_q;
    const Tensor& cu_seqlens_k;
    int64_t max_seqlen_q;
    int64_t max_seqlen_k;

    int64_t batch() const { return cu_seqlens_q.size(0) - 1; }
};

// q, k, v: 4-D (varlen: the (1, total, heads, head_dim) views).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v);
// Only what needs no device synchronization: the contents of cu_seqlens are clamped by the kernels.
void check_varlen(const Varlen& varlen, const Tensor& q, const Tensor& k);
// Before the varlen tensors are viewed as 4-D: `shape` names the expected one in the message.
void check_varlen_rank(const Tensor& t, const char* name, const char* shape);
void check_scale(double softmax_scale);
void check_num_splits(int64_t num_splits);
// dout and out must match q's shape and dtype; lse is the forward's fp32 output of lse_shape.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const std::vector<int64_t>& lse_shape);
// q is on a CUDA device of compute capability 8.0 or newer, with k and v; all start 16-byte aligned.
void check_device(const Tensor& q, const Tensor& k, const Tensor& v);
void check_same_device(const Tensor& t, const char* name, const Tensor& q);
// Raises with CUDA's message, and a hint when the GPU has less shared memory than the kernels are tuned for.
void check_launch(cudaError_t err, const char* op, int device);

}  // namespace flash
