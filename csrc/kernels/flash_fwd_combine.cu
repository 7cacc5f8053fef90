#include "kernels/flash_fwd_combine.h"

#include <cmath>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "kernels/block_info.h"
#include "kernels/row_mod.h"
#include "launch/launch.h"

namespace flash {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kVec = 4;            // fp32 partial elements per 16-byte load; head_dim is a multiple of 8
constexpr int kMaxSplits = 128;    // the host caps num_splits at this
constexpr int kSplitsPerLane = kMaxSplits / 32;

// One warp per query row of one (sequence, head): the lanes first reduce the row's split LSEs, then
// each lane sums kVec columns over all splits. Grid: (row blocks of kWarps rows, batch, num_heads).
template <typename Element>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ FwdParams params) {
    __shared__ float s_weight[kWarps][kMaxSplits];  // exp(lse_s - lse) per split, for each warp's row

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarps + warp;
    const int b = sequence_of_cta(params);
    const int h = blockIdx.z;
    if (row >= params.seqlen_q) { return; }  // whole warps leave; nothing below synchronizes the block

    const int num_splits = params.num_splits;
    // Partial rows are laid out (num_splits, batch, num_heads, seqlen_q): split s of this row is
    // row_idx + s * split_stride.
    const index_t split_stride = index_t(params.batch) * params.num_heads * params.seqlen_q;
    const index_t row_idx = (index_t(b) * params.num_heads + h) * params.seqlen_q + row;

    float lse_s[kSplitsPerLane];
    float lse_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) {
        const int s = lane + 32 * i;
        lse_s[i] = s < num_splits ? params.lse_accum_ptr[row_idx + s * split_stride] : -INFINITY;
        lse_max = fmaxf(lse_max, lse_s[i]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, offset));
    }
    // Every split saw no key for this row: output 0, and the LSE of the sink alone (+inf without one: the
    // flash-attn convention). The learnable sink joins here, once, and not in the splits' own LSEs.
    const bool empty = lse_max == -INFINITY;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) { sum += empty ? 0.f : expf(lse_s[i] - lse_max); }
    for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
    // Under GQA packing (FwdParams::gqa_pack) row r of head h is query head h * gqa_pack + r.
    const RowCoord coord{params.gqa_pack > 1 ? h * params.gqa_pack + row : h};
    const float lse = finish_split_row(LearnableSink{params.learnable_sink_ptr}, {lse_max, sum}, coord);
#pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) { s_weight[warp][lane + 32 * i] = empty ? 0.f : expf(lse_s[i] - lse); }
    __syncwarp();

    const BlockInfo binfo(params, b);
    if (lane == 0) { params.lse_ptr[binfo.lse_offset(params, b, h) + row] = lse; }
    const auto out = binfo.o_view<Element>(params, b, h);  // (seqlen_q, head_dim)
    const float* o_partial = params.o_accum_ptr + row_idx * params.head_dim;
    const index_t o_split_stride = split_stride * params.head_dim;
    cutlass::NumericArrayConverter<Element, float, kVec> convert;
    for (int col = lane * kVec; col < params.head_dim; col += 32 * kVec) {
        cutlass::Array<float, kVec> acc;
        acc.fill(0.f);
        for (int s = 0; s < num_splits; ++s) {
            const float w = s_weight[warp][s];
            if (w == 0.f) { continue; }  // no key in this split (or a negligible one): skip its loads
            const auto part = *reinterpret_cast<const cutlass::Array<float, kVec>*>(o_partial + s * o_split_stride +
                                                                                    col);
#pragma unroll
            for (int j = 0; j < kVec; ++j) { acc[j] += w * part[j]; }
        }
        *reinterpret_cast<cutlass::Array<Element, kVec>*>(&out(row, col)) = convert(acc);
    }
}

}  // namespace

cudaError_t run_fwd_combine(const FwdParams& params, bool is_bf16, cudaStream_t stream) {
    if (params.num_splits < 1 || params.num_splits > kMaxSplits) { return cudaErrorInvalidValue; }
    const dim3 grid((params.seqlen_q + kWarps - 1) / kWarps, params.batch, params.num_heads);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) { return cudaSuccess; }
    auto kernel = is_bf16 ? &combine_kernel<cutlass::bfloat16_t> : &combine_kernel<cutlass::half_t>;
    return launch_in_batch_chunks(grid, params, [&](dim3 chunk_grid, const FwdParams& chunk_params) {
        kernel<<<chunk_grid, kThreads, 0, stream>>>(chunk_params);
        return cudaGetLastError();
    });
}

}  // namespace flash
