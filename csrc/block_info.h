// Where one (sequence, head) lives in memory: its lengths and the element offsets of its rows.
#pragma once

#include "flash_params.h"

namespace flash {

struct BlockInfo {
    int seqlen_q;
    int seqlen_k;

    __forceinline__ __device__ explicit BlockInfo(const FwdParams& params)
        : seqlen_q(params.seqlen_q), seqlen_k(params.seqlen_k) {}

    __forceinline__ __device__ index_t q_offset(const FwdParams& p, int b, int h) const {
        return b * p.q_batch_stride + h * p.q_head_stride;
    }
    __forceinline__ __device__ index_t k_offset(const FwdParams& p, int b, int h_k) const {
        return b * p.k_batch_stride + h_k * p.k_head_stride;
    }
    __forceinline__ __device__ index_t v_offset(const FwdParams& p, int b, int h_k) const {
        return b * p.v_batch_stride + h_k * p.v_head_stride;
    }
    __forceinline__ __device__ index_t o_offset(const FwdParams& p, int b, int h) const {
        return b * p.o_batch_stride + h * p.o_head_stride;
    }
};

}  // namespace flash
