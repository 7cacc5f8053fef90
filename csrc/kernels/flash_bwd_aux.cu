#include "kernels/flash_bwd_aux.h"

#include "kernels/block_info.h"
#include "kernels/row_mod.h"
#include "launch/launch.h"

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                                  // elements per 16-byte access
constexpr int kLanesPerRow = 8;                          // D: a row is summed by 8 lanes, 64 columns per step
constexpr int kTokensPerBlock = kThreads / kLanesPerRow;  // both kernels: grid (token blocks, batch, heads)

// D = rowsum(dO * O) for kTokensPerBlock tokens of one (batch, head), written in the LSE layout; with a learnable
// sink, also each row's share of the sink's gradient (row_mod.h, hook c), in the same layout, which the host sums
// per head.
template <typename Element>
__global__ void __launch_bounds__(kThreads) dot_do_o_kernel(const __grid_constant__ BwdParams params) {
    const int s = blockIdx.x * kTokensPerBlock + threadIdx.x / kLanesPerRow;
    const int b = sequence_of_cta(params);
    const int h = blockIdx.z;
    const int lane = threadIdx.x % kLanesPerRow;
    const BlockInfo binfo(params, b);
    const bool valid = s < binfo.seqlen_q;
    float sum = 0.f;
    if (valid) {
        const auto dout = binfo.do_view<Element>(params, b, h);  // (seqlen_q, head_dim_v)
        const auto out = binfo.o_view<Element>(params, b, h);    // (seqlen_q, head_dim_v)
        for (int col = lane * kVec; col < params.head_dim_v; col += kLanesPerRow * kVec) {
            const auto d = *reinterpret_cast<const cutlass::Array<Element, kVec>*>(&dout(s, col));
            const auto o = *reinterpret_cast<const cutlass::Array<Element, kVec>*>(&out(s, col));
#pragma unroll
            for (int i = 0; i < kVec; ++i) { sum += float(d[i]) * float(o[i]); }
        }
    }
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
    if (valid && lane == 0) {
        const index_t row = binfo.lse_offset(params, b, h) + s;
        params.dsum_ptr[row] = sum;
        if (params.learnable_sink_ptr != nullptr) {
            // Under GQA packing (BwdParams::gqa_pack) row s of head h is query head h * gqa_pack + s.
            const RowCoord coord{params.gqa_pack > 1 ? h * params.gqa_pack + s : h};
            params.sink_grad_rows_ptr[row] = LearnableSink{params.learnable_sink_ptr}.grad_term(
                sum, params.lse_ptr[row], coord);
        }
    }
}

// dq = softmax_scale * dq_accum for kTokensPerBlock tokens of one (batch, head), written at the dq strides
// (dense (batch, seqlen_q, num_heads, head_dim) or a GQA-packed view of it; varlen (total_q, num_heads,
// head_dim)).
template <typename Element>
__global__ void __launch_bounds__(kThreads) convert_dq_kernel(const __grid_constant__ BwdParams params) {
    const int b = sequence_of_cta(params);
    const int h = blockIdx.z;
    const BlockInfo binfo(params, b);
    const int first = blockIdx.x * kTokensPerBlock;
    const int tokens = min(kTokensPerBlock, binfo.seqlen_q - first);
    const int vecs_per_row = params.head_dim / kVec;
    const float* src = params.dq_accum_ptr +
                       (binfo.dq_accum_row(params, b, h) + first) * int64_t(params.dq_accum_head_dim);
    const int64_t dst_row_stride = params.dq_row_stride;
    auto* dst = static_cast<Element*>(params.dq_ptr) + b * params.dq_batch_stride +
                (binfo.q_start + first) * dst_row_stride + h * params.dq_head_stride;
    cutlass::NumericArrayConverter<Element, float, kVec> convert;
    for (int idx = threadIdx.x; idx < tokens * vecs_per_row; idx += kThreads) {
        const int t = idx / vecs_per_row;
        const int col = (idx % vecs_per_row) * kVec;
        auto acc = *reinterpret_cast<const cutlass::Array<float, kVec>*>(src + t * params.dq_accum_head_dim + col);
#pragma unroll
        for (int j = 0; j < kVec; ++j) { acc[j] *= params.softmax_scale; }
        *reinterpret_cast<cutlass::Array<Element, kVec>*>(dst + t * dst_row_stride + col) = convert(acc);
    }
}

using AuxKernel = void (*)(BwdParams);

cudaError_t launch(AuxKernel kernel, const BwdParams& params, cudaStream_t stream) {
    const dim3 grid((params.seqlen_q + kTokensPerBlock - 1) / kTokensPerBlock, params.batch, params.num_heads);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) { return cudaSuccess; }
    return launch_in_batch_chunks(grid, params, [&](dim3 chunk_grid, const BwdParams& chunk_params) {
        kernel<<<chunk_grid, kThreads, 0, stream>>>(chunk_params);
        return cudaGetLastError();
    });
}

}  // namespace

cudaError_t run_bwd_dot_do_o(const BwdParams& params, bool is_bf16, cudaStream_t stream) {
    return launch(is_bf16 ? &dot_do_o_kernel<cutlass::bfloat16_t> : &dot_do_o_kernel<cutlass::half_t>, params, stream);
}

cudaError_t run_bwd_convert_dq(const BwdParams& params, bool is_bf16, cudaStream_t stream) {
    return launch(is_bf16 ? &convert_dq_kernel<cutlass::bfloat16_t> : &convert_dq_kernel<cutlass::half_t>, params,
                  stream);
}

}  // namespace flash
