// Plain parameter block shared by the host launcher and the forward kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "launch/kernel_key.h"

namespace flash {

using index_t = int64_t;

struct FwdParams {
    // Input tensors, laid out (batch, seqlen, heads, head_dim) with a unit stride on head_dim.
    const void* __restrict__ q_ptr;  // (batch, seqlen_q, num_heads, head_dim)
    const void* __restrict__ k_ptr;  // (batch, seqlen_k, num_heads_k, head_dim)
    const void* __restrict__ v_ptr;  // (batch, seqlen_k, num_heads_k, head_dim)
    void* __restrict__ o_ptr;        // (batch, seqlen_q, num_heads, head_dim), written by the kernel
    float* __restrict__ lse_ptr;     // natural-log LSE per query row; dense (batch, num_heads, seqlen_q),
                                  // varlen (num_heads, total_q); rows are contiguous
    // Variable-length batches: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b + 1]) of a
    // (total, heads, head_dim) tensor, and every batch stride above is 0. Both nullptr for dense batches.
    const int* __restrict__ cu_seqlens_q;  // (batch + 1,) int32
    const int* __restrict__ cu_seqlens_k;  // (batch + 1,) int32

    index_t q_batch_stride;  // elements between consecutive batches of q
    index_t q_row_stride;  // elements between consecutive tokens of q
    index_t q_head_stride;  // elements between consecutive heads of q
    index_t k_batch_stride;  // same three for k
    index_t k_row_stride;
    index_t k_head_stride;
    index_t v_batch_stride;  // same three for v
    index_t v_row_stride;
    index_t v_head_stride;
    index_t o_batch_stride;  // same three for out
    index_t o_row_stride;
    index_t o_head_stride;
    index_t lse_batch_stride;  // elements between consecutive batches of lse (0 for varlen)
    index_t lse_head_stride;  // elements between consecutive heads of lse

    int batch;  // number of sequences
    int batch_offset;  // the first sequence of this launch: grid y counts sequences from it (launch.h)
    int seqlen_q;  // query tokens per sequence (varlen: the maximum, which sizes the grid)
    int seqlen_k;  // key/value tokens per sequence (varlen: the maximum)
    int total_q;  // varlen: rows of q; cu_seqlens_q is clamped to it so no kernel leaves the tensor
    int total_k;  // varlen: rows of k and v
    int num_heads;  // query heads
    int num_heads_k;  // key/value heads; num_heads is a multiple of it (MQA/GQA)
    int head_dim;  // actual head dim, a multiple of 8, at most the kernel's kHeadDim
    int gqa_pack;  // 1, or the query heads of a key/value head that run as rows of one head (Plan::gqa_pack):
                   // then row r of "head" h is query head h * gqa_pack + r, all at query position 0

    float softmax_scale;  // multiplies QK^T before the softmax; the backward scales dK and dQ by it
    float softmax_scale_log2;  // score_scale * log2(e): the kernels' exp2 factor on a modified score (score_mod.h)
    float score_scale;  // softmax_scale, or softcap when softcapping: the LSE is row_max * score_scale + log(sum)

    // Attention variants (flash-attn 2.x semantics), all runtime: the host fills them in set_variant_params.
    // Window: query position p (row + seqlen_k - seqlen_q) sees keys [p - window_left, p + window_right]. Read
    // only by the masked kernels (kCausal), which serve causal ((unbounded, 0)) and every bounded window; an
    // unbounded side holds a bound past every key (host_params.cpp), so no kernel tests for -1.
    int window_left;
    int window_right;
    float softcap_prescale;  // > 0: scores become tanh(q.k * softcap_prescale), softcap_prescale = softmax_scale /
                             // softcap
    const float* __restrict__ alibi_slopes_ptr;  // nullptr, or fp32 slopes: sequence b, head h at b *
                                                 // alibi_batch_stride + h
    index_t alibi_batch_stride;  // 0 for (nheads,) slopes
    // nullptr, or fp32 (query heads,): each head's learnable sink, a logit that joins every row's softmax
    // denominator and carries no value (row_mod.h). The LSE includes it; a row that sees no key gets output 0 and
    // LSE sink_h.
    const float* __restrict__ learnable_sink_ptr;
    // Dropout: nullptr, or int64 (2,) [seed, offset] on the device (dropout.h says how they make the mask).
    const int64_t* __restrict__ rng_state_ptr;
    uint32_t dropout_threshold;  // in [1, 255] with dropout (0: none): an element is dropped when its 8 random
                                 // bits are below it
    float dropout_keep_scale;  // 1 / (1 - dropout_p), dropout_p as the caller gave it: flash-attn 2.x's scale

    // KV caches (fwd_kvcache, varlen_fwd_paged), read by the variants kernels only (BlockInfo::of_cache). Key rows
    // count in a sequence's own cache: its row of k_ptr (batch stride), or, paged, the rows of its pages in
    // block-table order. Every index read from a tensor is clamped, so no value makes a kernel leave the cache.
    const int* __restrict__ seqlens_k_ptr;  // nullptr, or (batch,) int32: sequence b's keys end at cache row
                                            // seqlens_k_ptr[b] + seqlen_k_new (fwd_kvcache's cache_seqlens)
    int seqlen_k_new;  // keys this call appends (kvcache_prep.cu wrote them before the kernel)
    // v's and out's head dim, a multiple of 8: head_dim, or less in a call whose kernel has a narrower V than Q
    // and K (Plan::head_dim_v). Here, in the padding before leftpad_k_ptr, so that no later field moves.
    int head_dim_v;
    const int* __restrict__ leftpad_k_ptr;  // nullptr, or (batch,) int32: sequence b's keys start at this row
    const int* __restrict__ kv_batch_idx_ptr;  // nullptr, or (batch,) int32: sequence b reads this batch row of the
                                               // cache
    int kv_batches;  // batch rows of the cache (kv_batch_idx_ptr is clamped to them)
    int k_capacity;  // rows a sequence's cache holds; its keys end at most here
    // Paged caches: k_ptr and v_ptr hold (num_pages, page_size, num_heads_k, head_dim) with the page stride in
    // k_batch_stride / v_batch_stride; row r of sequence b lies in page block_table[b][r / page_size].
    const int* __restrict__ block_table_ptr;  // nullptr (not paged), or (batch, max_pages) int32
    index_t block_table_batch_stride;
    int page_size;  // a multiple of 16
    int num_pages;

    KernelFamily family;  // the plan's kernel family, which the launchers run (Plan::family)
    bool short_key_tiles;  // with the wgmma family: the forward runs the tile set's short-key tile, or with
                           // warp_specialized that kernel's (ws_short_tile; the plan checked it exists)
    MmaSyncTileSet mma_sync_tile_set;  // with the mma.sync family: the tile set the launchers run (Plan::tile_budget;
                                       // one byte, in the padding before num_splits)
    bool warp_specialized;  // with the wgmma family: the forward runs the warp-specialized TMA kernel of the tile
                            // set's ws_tile (Plan::warp_specialized; the last byte of that padding)

    // Split-KV forward (dense batches only): each (query block, sequence, head) is computed by num_splits
    // CTAs over disjoint key ranges, which write fp32 partials that run_fwd_combine merges into o_ptr/lse_ptr.
    int num_splits;  // 1: no split, the kernel writes o_ptr and lse_ptr itself
    float* __restrict__ o_accum_ptr;  // (num_splits, batch, num_heads, seqlen_q, head_dim) contiguous: each
                                      // split's output, normalized by its own row sums
    float* __restrict__ lse_accum_ptr;  // (num_splits, batch, num_heads, seqlen_q) contiguous: each split's
                                        // natural-log LSE, -inf for rows that saw no key in that split
};

// The plain forward kernel form that a call without the variants kernel runs: the plans leave a call plain with
// softcap or dropout only when that is its one variant (Problem::plain_mod), so the parameters say which.
constexpr PlainMod plain_mod_of(const FwdParams& params) {
    if (params.softcap_prescale > 0.f) { return PlainMod::kSoftcap; }
    return params.dropout_threshold != 0u ? PlainMod::kDropout : PlainMod::kNone;
}

// KernelFamily took the place of a bool (use_wgmma) without moving a field: the kernels take these structs by
// value, and their code must not change with the host's.
static_assert(sizeof(KernelFamily) == sizeof(bool) && alignof(KernelFamily) == alignof(bool));
static_assert(offsetof(FwdParams, warp_specialized) + 1 == offsetof(FwdParams, num_splits),
              "the one-byte choices fill the padding before num_splits, so no later field moves");
static_assert(offsetof(FwdParams, head_dim_v) + sizeof(int) == offsetof(FwdParams, leftpad_k_ptr),
              "head_dim_v fills the padding before leftpad_k_ptr, so no later field moves");

// Query rows per block of the mma.sync backward kernels lie in [kBwdMinBlockM, kBwdMaxBlockM]: the host sizes
// the deterministic-mode semaphores (mma.sync, and the warp-specialized Hopper kernel's 64 and 128 rows) for the
// smallest and pads dq_accum for the largest, which every backward's blocks, the Hopper ones' 16 and 64 rows
// included, divide.
constexpr int kBwdMinBlockM = 64;
constexpr int kBwdMaxBlockM = 128;

// The backward reads everything the forward read (q, k, v, out, lse) plus these.
struct BwdParams : FwdParams {
    const void* __restrict__ do_ptr;  // (batch, seqlen_q, num_heads, head_dim), gradient of out
    float* __restrict__ dsum_ptr;  // (batch, num_heads, seqlen_q) contiguous: rowsum(dout * out), fp32
    float* __restrict__ sink_grad_rows_ptr;  // with a learnable sink: each row's share of the sink's gradient,
                                             // -exp(sink_h - lse) * rowsum(dout * out), laid out as dsum
    float* __restrict__ dq_accum_ptr;  // fp32, rows of dq_accum_head_dim: dense (batch, num_heads,
                                       // dq_accum_seqlen, .); varlen (num_heads, dq_accum_seqlen, .), where
                                       // sequence b starts at row cu_seqlens_q[b] + b * kBwdMaxBlockM. The
                                       // Hopper kernels keep each query block's rows in (row, column) order,
                                       // the mma.sync kernel in its fragment order (flash_bwd_kernel.h).
                                       // Zeroed by the launchers whose kernels add every dQ tile into it,
                                       // all but the warp-specialized Hopper one (dq_turns.h)
    int64_t dq_accum_bytes;
    void* __restrict__ dq_ptr;  // dq_accum * scale, at the dq_*_stride strides
    void* __restrict__ dk_ptr;  // (batch, seqlen_k, num_heads / heads_per_cta, head_dim): one slice per
                                // query head, or per key/value head when heads_per_cta > 1
    void* __restrict__ dv_ptr;  // likewise, head_dim_v wide
    bool dkv_fp32;  // dk_ptr and dv_ptr hold fp32 (per-query-head GQA slices, summed on the
                    // host), else the input dtype
    int heads_per_cta;  // query heads one CTA walks: 1, or num_heads / num_heads_k (Hopper
                        // kernels only), when the grid's z runs over key/value heads
    int key_blocks_per_cta;  // consecutive key blocks one CTA walks, the next one's K and V loading while
                             // it finishes the current one: 1, or more for the Hopper kernel of head
                             // dims <= 128 (bwd_sm90_walks_key_blocks)
    bool stagger;  // the wide Hopper kernel without a mask: key block n starts its walk at query block n mod
                   // (query blocks); in deterministic mode only where every key block of a sequence fits
                   // (Plan::staggered, BwdSm90Block::dq_turn)
    int* dq_semaphore_ptr;  // (batch, num_heads, ceil(seqlen_q / kBwdMinBlockM)): in deterministic mode the
                            // semaphores (dq_turns.h for the Hopper kernels), zeroed by the host; otherwise
                            // the warp-specialized Hopper kernel's dQ flags (dq_turns.h), zeroed by its launcher
    int64_t dq_semaphore_bytes;

    index_t do_batch_stride;  // elements between consecutive batches of dout
    index_t do_row_stride;  // elements between consecutive tokens of dout
    index_t do_head_stride;  // elements between consecutive heads of dout
    index_t dq_batch_stride;  // same three for dq (0 for varlen)
    index_t dq_row_stride;
    index_t dq_head_stride;
    index_t dk_batch_stride;  // same three for dk (0 for varlen)
    index_t dk_row_stride;
    index_t dk_head_stride;
    index_t dv_batch_stride;  // and for dv, whose head dim is head_dim_v
    index_t dv_row_stride;
    index_t dv_head_stride;

    int dq_accum_seqlen;  // dense: seqlen_q rounded up to whole kBwdMaxBlockM blocks; varlen: total_q + batch *
                          // kBwdMaxBlockM
    int dq_accum_head_dim;  // the kernel's compile-time head dim (>= head_dim)

    bool deterministic;  // key blocks add into dQ in a fixed order (dq_semaphore_ptr)
    bool dq_accum_stored;  // set by the launcher of a kernel that stores each query block's first dQ tile
                           // (dq_turns.h): the conversion writes zeros where the flag shows none
    bool short_query_tiles;  // the Hopper kernel runs 16-row query blocks (tile_size.h)
};

}  // namespace flash
