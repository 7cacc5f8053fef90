// What one call is, beyond its q, k and v: a variable-length batch, the attention variants, a KV cache. The ops'
// entry points (csrc/generated/ops.h) hand these to the shared forward and backward paths (fwd.cpp, bwd.cpp).
#pragma once

#include <cstdint>
#include <optional>

#include "generated/op_args.h"
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

// The attention variants of a call, as the ops take them (flash-attn 2.x semantics; -1: an unbounded window side):
// the generated group of csrc/op_table.py, and what the host asks of it.
struct Variants : VariantArgs {
    bool dropout() const { return dropout_p > 0.0; }
    bool alibi() const { return alibi_slopes.has_value(); }
    bool sink() const { return learnable_sink.has_value(); }
    // causal fixes the window's right side at 0.
    int64_t right(bool causal) const { return causal ? 0 : window_right; }
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

}  // namespace flash
