// Plain parameter block shared by the host launcher and the forward kernel.
#pragma once

#include <cstdint>

namespace flash {

using index_t = int64_t;

struct FwdParams {
    // Input tensors, laid out (batch, seqlen, heads, head_dim) with a unit stride on head_dim.
    const void* __restrict__ q_ptr;  // (batch, seqlen_q, num_heads, head_dim)
    const void* __restrict__ k_ptr;  // (batch, seqlen_k, num_heads_k, head_dim)
    const void* __restrict__ v_ptr;  // (batch, seqlen_k, num_heads_k, head_dim)
    void* __restrict__ o_ptr;        // (batch, seqlen_q, num_heads, head_dim), written by the kernel
    float* __restrict__ lse_ptr;     // (batch, num_heads, seqlen_q) contiguous, natural-log LSE

    index_t q_batch_stride;  // elements between consecutive batches of q
    index_t q_row_stride;    // elements between consecutive tokens of q
    index_t q_head_stride;   // elements between consecutive heads of q
    index_t k_batch_stride;  // same three for k
    index_t k_row_stride;
    index_t k_head_stride;
    index_t v_batch_stride;  // same three for v
    index_t v_row_stride;
    index_t v_head_stride;
    index_t o_batch_stride;  // same three for out
    index_t o_row_stride;
    index_t o_head_stride;

    int batch;         // number of sequences
    int seqlen_q;      // query tokens per sequence
    int seqlen_k;      // key/value tokens per sequence
    int num_heads;     // query heads
    int num_heads_k;   // key/value heads; num_heads is a multiple of it (MQA/GQA)
    int head_dim;      // actual head dim, a multiple of 8, at most the kernel's kHeadDim

    float softmax_scale;       // multiplies QK^T before the softmax
    float softmax_scale_log2;  // softmax_scale * log2(e), so the kernel can use exp2
};

}  // namespace flash
