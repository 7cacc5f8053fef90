// Where one (sequence, head) lives in memory: its lengths, and (seqlen, head_dim) views of its rows in
// each tensor. Dense batches index sequences by batch stride; variable-length batches by cu_seqlens, whose
// entries are clamped to the tensor so that no kernel leaves it, whatever they hold. Views are
// dynamically sized; tiles that run past seqlen or head_dim are predicated.
#pragma once

#include <cute/tensor.hpp>

#include "launch/flash_params.h"

namespace flash {

using namespace cute;

// The sequence of this CTA: every grid is (blocks of a sequence, sequences, heads), and a batch of more
// sequences than grid y holds is launched in chunks that start at params.batch_offset (launch.h).
__forceinline__ __device__ int sequence_of_cta(const FwdParams& params) {
    return params.batch_offset + int(blockIdx.y);
}

struct BlockInfo {
    int q_start;   // first row of the sequence in q (0 for dense batches)
    int k_start;   // first row of the sequence in k and v (paged: of its pages, FwdParams::block_table_ptr)
    int seqlen_q;  // this sequence's lengths
    int seqlen_k;
    int k_batch;   // the batch row of k and v that holds the sequence (a cache's kv_batch_idx), else b

    __forceinline__ __device__ BlockInfo(const FwdParams& params, int b)
        : q_start(start(params.cu_seqlens_q, b, params.total_q)),
          k_start(start(params.cu_seqlens_k, b, params.total_k)),
          seqlen_q(length(params.cu_seqlens_q, b, params.total_q, params.seqlen_q)),
          seqlen_k(length(params.cu_seqlens_k, b, params.total_k, params.seqlen_k)),
          k_batch(b) {}

    // The variants kernels' sequences, which may read a KV cache (FwdParams, "KV caches"): keys end at
    // seqlens_k + seqlen_k_new, start at leftpad_k, lie in batch row kv_batch_idx, or in the sequence's pages,
    // whose rows start at 0. All clamped to the cache: at most k_capacity keys, leftpad at most the end.
    __forceinline__ __device__ static BlockInfo of_cache(const FwdParams& params, int b) {
        BlockInfo info(params, b);
        if (params.block_table_ptr != nullptr) { info.k_start = 0; }
        if (params.kv_batch_idx_ptr != nullptr) {
            info.k_batch = min(max(params.kv_batch_idx_ptr[b], 0), params.kv_batches - 1);
        }
        if (params.seqlens_k_ptr != nullptr) {
            const int cached = min(max(params.seqlens_k_ptr[b], 0), params.k_capacity);
            info.seqlen_k = min(cached + params.seqlen_k_new, params.k_capacity);
        }
        info.seqlen_k = min(info.seqlen_k, params.k_capacity);
        if (params.leftpad_k_ptr != nullptr) {
            const int leftpad = min(max(params.leftpad_k_ptr[b], 0), info.seqlen_k);
            info.k_start += leftpad;
            info.seqlen_k -= leftpad;
        }
        return info;
    }

    template <typename Element>
    __forceinline__ __device__ auto q_view(const FwdParams& p, int b, int h) const {
        return view<const Element>(p.q_ptr, b * p.q_batch_stride + h * p.q_head_stride, q_start, seqlen_q,
                                   p.q_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto k_view(const FwdParams& p, int b, int h_k) const {
        return view<const Element>(p.k_ptr, b * p.k_batch_stride + h_k * p.k_head_stride, k_start, seqlen_k,
                                   p.k_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto v_view(const FwdParams& p, int b, int h_k) const {
        return view<const Element>(p.v_ptr, b * p.v_batch_stride + h_k * p.v_head_stride, k_start, seqlen_k,
                                   p.v_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto o_view(const FwdParams& p, int b, int h) const {
        return view<Element>(p.o_ptr, b * p.o_batch_stride + h * p.o_head_stride, q_start, seqlen_q, p.o_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto do_view(const BwdParams& p, int b, int h) const {
        return view<const Element>(p.do_ptr, b * p.do_batch_stride + h * p.do_head_stride, q_start, seqlen_q,
                                   p.do_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto dq_view(const BwdParams& p, int b, int h) const {
        return view<Element>(p.dq_ptr, b * p.dq_batch_stride + h * p.dq_head_stride, q_start, seqlen_q, p.dq_row_stride,
                             p);
    }
    // dK and dV slice h: a query head's (summed over its GQA group on the host), or a key/value head's when
    // the backward CTAs walk whole groups (BwdParams::heads_per_cta).
    template <typename Element>
    __forceinline__ __device__ auto dk_view(const BwdParams& p, int b, int h) const {
        return view<Element>(p.dk_ptr, b * p.dk_batch_stride + h * p.dk_head_stride, k_start, seqlen_k, p.dk_row_stride,
                             p);
    }
    template <typename Element>
    __forceinline__ __device__ auto dv_view(const BwdParams& p, int b, int h) const {
        return view<Element>(p.dv_ptr, b * p.dv_batch_stride + h * p.dv_head_stride, k_start, seqlen_k, p.dv_row_stride,
                             p);
    }

    // Element offset of this sequence's first LSE (and D) entry for head h; rows follow contiguously.
    __forceinline__ __device__ index_t lse_offset(const FwdParams& p, int b, int h) const {
        return b * p.lse_batch_stride + h * p.lse_head_stride + q_start;
    }
    // Row of dq_accum that holds this sequence's first query row for head h. Varlen sequences are spaced one
    // query block apart, so whole-block writes past a sequence's end stay in its own slack.
    __forceinline__ __device__ index_t dq_accum_row(const BwdParams& p, int b, int h) const {
        const index_t heads = p.num_heads;
        if (p.cu_seqlens_q == nullptr) { return (b * heads + h) * p.dq_accum_seqlen; }
        return h * index_t(p.dq_accum_seqlen) + q_start + index_t(b) * kBwdMaxBlockM;
    }

  private:
    __forceinline__ __device__ static int start(const int* cu_seqlens, int b, int total) {
        return cu_seqlens == nullptr ? 0 : min(max(cu_seqlens[b], 0), total);
    }
    __forceinline__ __device__ static int length(const int* cu_seqlens, int b, int total, int max_seqlen) {
        if (cu_seqlens == nullptr) { return max_seqlen; }
        const int begin = min(max(cu_seqlens[b], 0), total);
        const int end = min(max(cu_seqlens[b + 1], begin), total);
        return min(end - begin, max_seqlen);
    }
    template <typename Element, typename Ptr>
    __forceinline__ __device__ static auto view(Ptr ptr, index_t offset, int first_row, int seqlen, index_t row_stride,
                                                const FwdParams& p) {
        Element* base = static_cast<Element*>(ptr) + offset + first_row * row_stride;
        return make_tensor(make_gmem_ptr(base), make_shape(seqlen, p.head_dim), make_stride(row_stride, _1{}));
    }
};

}  // namespace flash
