// What fwd_kvcache does before attention: append the new keys and values to the cache in place (rotating the keys
// when rotary embedding is on), and rotate the queries into a new tensor. One launch for both, on the attention's
// stream, so the kernel that follows reads the updated cache.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flash {

struct KVCachePrepParams {
    // New keys and values, (batch, seqlen_new, num_heads_k, head_dim); nullptr when the call appends nothing.
    const void* k_new_ptr;
    const void* v_new_ptr;
    int64_t k_new_strides[3];  // batch, row, head (elements)
    int64_t v_new_strides[3];
    // The caches: (batch rows, capacity, num_heads_k, head_dim), or paged (num_pages, page_size, ., .).
    void* k_cache_ptr;
    void* v_cache_ptr;
    int64_t k_cache_strides[3];  // batch row or page, row, head
    int64_t v_cache_strides[3];
    const int* seqlens_ptr;  // (batch,) int32: where sequence b's new keys go (cache_seqlens); required to append
    const int* kv_batch_idx_ptr;  // nullptr, or (batch,): the cache batch row of sequence b (clamped)
    int kv_batches;
    const int* block_table_ptr;  // nullptr, or (batch, max_pages) int32
    int64_t block_table_batch_stride;
    int page_size;
    int num_pages;
    int capacity;  // rows per sequence: new rows at or past it are dropped (the attention clamps its keys alike)

    // Queries to rotate, (batch, seqlen_q, num_heads, head_dim), into q_rot_ptr (contiguous); nullptr without rotary.
    const void* q_ptr;
    int64_t q_strides[3];
    void* q_rot_ptr;
    // Rotary embedding: cos and sin (seqlen_ro, rotary_dim / 2), contiguous, in the inputs' dtype; nullptr for none.
    const void* cos_ptr;
    const void* sin_ptr;
    int seqlen_ro;
    int rotary_dim;
    bool interleaved;  // pairs (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)
    bool q_per_row_positions;  // query row i sits at cache_seqlens[b] + i (causal or local), else at cache_seqlens[b]

    int batch;
    int seqlen_new;
    int seqlen_q;
    int num_heads;
    int num_heads_k;
    int head_dim;
    bool is_bf16;
};

// Launches the append and rotation on `stream` (nothing when there is neither) and returns the launch status.
cudaError_t run_kvcache_prep(const KVCachePrepParams& params, cudaStream_t stream);

}  // namespace flash
