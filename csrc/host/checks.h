// Input checks of the ops. Every message names the argument at fault; every check that needs no device runs
// before the device checks, so argument errors read the same on any device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "host/call.h"
#include "host/torch_glue.h"

namespace flash {

// Checks a KV-cache call: q 4-D (varlen: the (1, total_q, ...) view), the caches, and every cache argument;
// no device synchronization (the contents of cache_seqlens, cache_batch_idx, cache_leftpad and block_table are
// clamped by the kernels).
void check_kvcache(const KVCache& cache, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                   const Varlen* varlen);

// Checks the variants of a call on q (4-D) with `batch` sequences; no device synchronization.
void check_variants(const Variants& variants, const Tensor& q, int64_t batch);

// q, k, v: 4-D (varlen: the (1, total, heads, head_dim) views).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v);
// Only what needs no device synchronization: the contents of cu_seqlens are clamped by the kernels. max_seqlen_k
// is at most max_keys, the rows of k (keys_name names them in the message).
void check_varlen(const Varlen& varlen, const Tensor& q, int64_t max_keys, const char* keys_name);
// Before the varlen tensors are viewed as 4-D: `shape` names the expected one in the message.
void check_varlen_rank(const Tensor& t, const char* name, const char* shape);
void check_scale(double softmax_scale);
void check_num_splits(int64_t num_splits);
// dout and out must have q's shape with v's head dim, and q's dtype; lse is the forward's fp32 output of lse_shape.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& v, const Tensor& out, const Tensor& lse,
                      const std::vector<int64_t>& lse_shape);
// q is on a CUDA device of compute capability 8.0 or newer, with k and v; all start 16-byte aligned.
void check_device(const Tensor& q, const Tensor& k, const Tensor& v);
void check_same_device(const Tensor& t, const char* name, const Tensor& q);
// Raises with CUDA's message, and a hint when the GPU has less shared memory than the kernels are tuned for.
void check_launch(cudaError_t err, const char* op, int device);

}  // namespace flash
