// Input checks of the ops. Every message names the argument at fault; every check that needs no device runs
// before the device checks, so argument errors read the same on any device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "host/torch_glue.h"

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

// The attention variants of a call, as the ops take them (flash-attn 2.x semantics; -1: an unbounded window side).
struct Variants {
    int64_t window_left;
    int64_t window_right;
    double softcap;
    const std::optional<Tensor>& alibi_slopes;  // fp32 (nheads,) or (batch, nheads)
    double dropout_p;
    const std::optional<Tensor>& rng_state;  // int64 (2,): seed, offset; needed when dropout_p > 0

    bool dropout() const { return dropout_p > 0.0; }
    bool alibi() const { return alibi_slopes.has_value(); }
    // causal fixes the window's right side at 0.
    int64_t right(bool causal) const { return causal ? 0 : window_right; }
    // Whether the call runs a masked kernel: causal, or a window bounded on either side.
    bool masked(bool causal) const { return causal || window_left >= 0 || window_right >= 0; }
    // Whether the window is more than causal: a left edge, or a right edge past the diagonal ((-1, 0) is causal).
    bool window(bool causal) const { return window_left >= 0 || right(causal) > 0; }
};

// A call that reads a KV cache: fwd_kvcache's arguments, or varlen_fwd_paged's block table alone (flash-attn 2.x
// semantics). The caches are k and v of the call: (batch rows, capacity, nheads_k, head_dim), or paged
// (num_pages, page_size, nheads_k, head_dim).
struct KVCache {
    const std::optional<Tensor>& k_new;        // (batch, seqlen_new, nheads_k, head_dim): appended in place
    const std::optional<Tensor>& v_new;
    const std::optional<Tensor>& rotary_cos;   // (seqlen_ro, rotary_dim / 2), q's dtype
    const std::optional<Tensor>& rotary_sin;
    const std::optional<Tensor>& seqlens;      // int32 (batch,): the cached keys of each sequence (cache_seqlens)
    const std::optional<Tensor>& batch_idx;    // int32 (batch,): the cache batch row of each sequence
    const std::optional<Tensor>& leftpad;      // int32 (batch,): the first cache row of each sequence
    const std::optional<Tensor>& block_table;  // int32 (batch, max_pages)
    bool rotary_interleaved;

    bool paged() const { return block_table.has_value(); }
    bool appends() const { return k_new.has_value(); }
    bool rotary() const { return rotary_cos.has_value(); }
    // Rows one sequence's cache holds: the cache's seqlen, or max_pages * page_size.
    int64_t capacity(const Tensor& k_cache) const {
        return paged() ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
    }
};

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
// dout and out must match q's shape and dtype; lse is the forward's fp32 output of lse_shape.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const std::vector<int64_t>& lse_shape);
// q is on a CUDA device of compute capability 8.0 or newer, with k and v; all start 16-byte aligned.
void check_device(const Tensor& q, const Tensor& k, const Tensor& v);
void check_same_device(const Tensor& t, const char* name, const Tensor& q);
// Raises with CUDA's message, and a hint when the GPU has less shared memory than the kernels are tuned for.
void check_launch(cudaError_t err, const char* op, int device);

}  // namespace flash
