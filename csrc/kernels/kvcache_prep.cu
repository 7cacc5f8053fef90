// The append-and-rotate kernel of fwd_kvcache (kvcache_prep.h). Memory-bound and small next to the attention
// that follows (one token per sequence when decoding), so it favors plainness: one thread per pair of elements
// that rotary embedding mixes, with pairs that it leaves alone handled the same way.
#include "kernels/kvcache_prep.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace flash {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename Element>
__device__ __forceinline__ Element from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Pair j of a head's head_dim / 2 pairs: the two elements it covers, and whether rotary mixes them. Rotated pairs
// come first (j < rotary_dim / 2: elements (2j, 2j + 1) interleaved, (j, j + rotary_dim / 2) otherwise); the rest
// are (rotary_dim + 2t, rotary_dim + 2t + 1) for t = j - rotary_dim / 2, copied unchanged.
struct Pair {
    int first;
    int second;
    bool rotated;
};

__device__ __forceinline__ Pair pair_of(int j, int rotary_dim, bool interleaved) {
    const int half = rotary_dim / 2;
    if (j < half) { return interleaved ? Pair{2 * j, 2 * j + 1, true} : Pair{j, j + half, true}; }
    const int first = rotary_dim + 2 * (j - half);
    return {first, first + 1, false};
}

// Writes pair j of src to dst, rotated by the angle of `position` when the pair is a rotated one:
// (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), in float32, rounded once.
template <typename Element>
__device__ __forceinline__ void write_pair(const KVCachePrepParams& p, const Element* src, Element* dst, int j,
                                           int position, bool rotate) {
    const Pair pair = pair_of(j, rotate ? p.rotary_dim : 0, p.interleaved);
    if (!pair.rotated) {
        dst[pair.first] = src[pair.first];
        dst[pair.second] = src[pair.second];
        return;
    }
    const float x0 = to_float(src[pair.first]);
    const float x1 = to_float(src[pair.second]);
    const int64_t at = int64_t(min(max(position, 0), p.seqlen_ro - 1)) * (p.rotary_dim / 2) + j;
    const float c = to_float(static_cast<const Element*>(p.cos_ptr)[at]);
    const float s = to_float(static_cast<const Element*>(p.sin_ptr)[at]);
    dst[pair.first] = from_float<Element>(x0 * c - x1 * s);
    dst[pair.second] = from_float<Element>(x0 * s + x1 * c);
}

// The keys already cached for sequence b, clamped to the cache as the attention kernels clamp them
// (BlockInfo::of_cache), so that both agree on where the new rows go whatever cache_seqlens holds, and a row
// index (at most twice the capacity) cannot overflow.
__device__ __forceinline__ int cached_rows(const KVCachePrepParams& p, int b) {
    return min(max(p.seqlens_ptr[b], 0), p.capacity);
}

// Item ids run over the queries' pairs first (when rotating them), then the new keys' (each item also copies the
// matching pair of the new values).
template <typename Element>
__global__ void __launch_bounds__(kThreads)
    kvcache_prep_kernel(const __grid_constant__ KVCachePrepParams p, int64_t q_items, int64_t kv_items) {
    const int pairs = p.head_dim / 2;
    const bool rotary = p.cos_ptr != nullptr;
    for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < q_items + kv_items;
         item += int64_t(gridDim.x) * kThreads) {
        if (item < q_items) {
            // (b, i, h, j) of q, row-major.
            int64_t rest = item;
            const int j = int(rest % pairs);
            rest /= pairs;
            const int h = int(rest % p.num_heads);
            rest /= p.num_heads;
            const int i = int(rest % p.seqlen_q);
            const int b = int(rest / p.seqlen_q);
            const Element* src = static_cast<const Element*>(p.q_ptr) + b * p.q_strides[0] + i * p.q_strides[1] +
                                 h * p.q_strides[2];
            Element* dst = static_cast<Element*>(p.q_rot_ptr) +
                           ((int64_t(b) * p.seqlen_q + i) * p.num_heads + h) * p.head_dim;
            const int position = cached_rows(p, b) + (p.q_per_row_positions ? i : 0);
            write_pair(p, src, dst, j, position, rotary);
            continue;
        }
        int64_t rest = item - q_items;
        const int j = int(rest % pairs);
        rest /= pairs;
        const int h = int(rest % p.num_heads_k);
        rest /= p.num_heads_k;
        const int i = int(rest % p.seqlen_new);
        const int b = int(rest / p.seqlen_new);
        // The new row, in the sequence's cache rows; rows past the cache are dropped.
        const int row = cached_rows(p, b) + i;
        if (row >= p.capacity) { continue; }
        int64_t k_at;
        int64_t v_at;
        if (p.block_table_ptr != nullptr) {
            const int entry = row / p.page_size;
            const int page = min(max(p.block_table_ptr[b * p.block_table_batch_stride + entry], 0), p.num_pages - 1);
            const int in_page = row - entry * p.page_size;
            k_at = page * p.k_cache_strides[0] + in_page * p.k_cache_strides[1];
            v_at = page * p.v_cache_strides[0] + in_page * p.v_cache_strides[1];
        } else {
            const int cache_b = p.kv_batch_idx_ptr != nullptr ? min(max(p.kv_batch_idx_ptr[b], 0), p.kv_batches - 1)
                                                              : b;
            k_at = cache_b * p.k_cache_strides[0] + int64_t(row) * p.k_cache_strides[1];
            v_at = cache_b * p.v_cache_strides[0] + int64_t(row) * p.v_cache_strides[1];
        }
        Element* k_dst = static_cast<Element*>(p.k_cache_ptr) + k_at + h * p.k_cache_strides[2];
        Element* v_dst = static_cast<Element*>(p.v_cache_ptr) + v_at + h * p.v_cache_strides[2];
        const Element* k_src = static_cast<const Element*>(p.k_new_ptr) + b * p.k_new_strides[0] +
                               i * p.k_new_strides[1] + h * p.k_new_strides[2];
        const Element* v_src = static_cast<const Element*>(p.v_new_ptr) + b * p.v_new_strides[0] +
                               i * p.v_new_strides[1] + h * p.v_new_strides[2];
        write_pair(p, k_src, k_dst, j, row, rotary);
        write_pair(p, v_src, v_dst, j, row, false);
    }
}

}  // namespace

cudaError_t run_kvcache_prep(const KVCachePrepParams& params, cudaStream_t stream) {
    const int64_t pairs = params.head_dim / 2;
    const int64_t q_items = params.q_rot_ptr != nullptr
                                ? int64_t(params.batch) * params.seqlen_q * params.num_heads * pairs
                                : 0;
    const int64_t kv_items = params.k_new_ptr != nullptr
                                 ? int64_t(params.batch) * params.seqlen_new * params.num_heads_k * pairs
                                 : 0;
    if (q_items + kv_items == 0) { return cudaSuccess; }
    // Enough CTAs to fill any GPU several times over; a grid-stride loop covers larger calls.
    const int64_t blocks = std::min<int64_t>((q_items + kv_items + kThreads - 1) / kThreads, 65536);
    if (params.is_bf16) {
        kvcache_prep_kernel<__nv_bfloat16><<<unsigned(blocks), kThreads, 0, stream>>>(params, q_items, kv_items);
    } else {
        kvcache_prep_kernel<__half><<<unsigned(blocks), kThreads, 0, stream>>>(params, q_items, kv_items);
    }
    return cudaGetLastError();
}

}  // namespace flash
