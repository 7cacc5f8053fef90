// Where one (sequence, head) lives in memory: its lengths, and (seqlen, head_dim) views of its rows in
// each tensor. Views are dynamically sized; tiles that run past seqlen or head_dim are predicated.
#pragma once

#include <cute/tensor.hpp>

#include "flash_params.h"

namespace flash {

using namespace cute;

struct BlockInfo {
    int seqlen_q;
    int seqlen_k;

    __forceinline__ __device__ explicit BlockInfo(const FwdParams& params)
        : seqlen_q(params.seqlen_q), seqlen_k(params.seqlen_k) {}

    template <typename Element>
    __forceinline__ __device__ auto q_view(const FwdParams& p, int b, int h) const {
        return view<const Element>(p.q_ptr, b * p.q_batch_stride + h * p.q_head_stride, seqlen_q, p.q_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto k_view(const FwdParams& p, int b, int h_k) const {
        return view<const Element>(p.k_ptr, b * p.k_batch_stride + h_k * p.k_head_stride, seqlen_k, p.k_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto v_view(const FwdParams& p, int b, int h_k) const {
        return view<const Element>(p.v_ptr, b * p.v_batch_stride + h_k * p.v_head_stride, seqlen_k, p.v_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto o_view(const FwdParams& p, int b, int h) const {
        return view<Element>(p.o_ptr, b * p.o_batch_stride + h * p.o_head_stride, seqlen_q, p.o_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto do_view(const BwdParams& p, int b, int h) const {
        return view<const Element>(p.do_ptr, b * p.do_batch_stride + h * p.do_head_stride, seqlen_q, p.do_row_stride, p);
    }
    // dK and dV have one slice per query head (summed over each GQA group on the host).
    template <typename Element>
    __forceinline__ __device__ auto dk_view(const BwdParams& p, int b, int h) const {
        return view<Element>(p.dk_ptr, b * p.dk_batch_stride + h * p.dk_head_stride, seqlen_k, p.dk_row_stride, p);
    }
    template <typename Element>
    __forceinline__ __device__ auto dv_view(const BwdParams& p, int b, int h) const {
        return view<Element>(p.dv_ptr, b * p.dk_batch_stride + h * p.dk_head_stride, seqlen_k, p.dk_row_stride, p);
    }

  private:
    template <typename Element, typename Ptr>
    __forceinline__ __device__ static auto view(Ptr ptr, index_t offset, int seqlen, index_t row_stride,
                                                const FwdParams& p) {
        Element* base = static_cast<Element*>(ptr) + offset;
        return make_tensor(make_gmem_ptr(base), make_shape(seqlen, p.head_dim), make_stride(row_stride, _1{}));
    }
};

}  // namespace flash
