// The forward ops (fwd, varlen_fwd, and the KV-cache ops fwd_kvcache and varlen_fwd_paged): checks, plan, outputs,
// params, launches (the cache append, the kernel, then the split-KV combine).
#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <optional>

#include "kernels/flash_fwd_combine.h"
#include "host/host_params.h"
#include "kernels/kvcache_prep.h"
#include "generated/ops.h"

namespace flash {
namespace {

// Whether fwd_kvcache rotates each query row at its own position (cache_seqlens[b] + i) rather than all at
// cache_seqlens[b]: flash-attn 2.x's rule, under which a causal or local call rotates per row. Like flash-attn,
// a window side at or past the cache's capacity counts as unbounded there, and one query row is never causal.
bool rotary_per_row(const Variants& variants, bool causal, int64_t seqlen_q, int64_t capacity) {
    const bool is_causal = causal && !(seqlen_q == 1 && !variants.alibi());
    const int64_t left = variants.window_left >= capacity ? -1 : variants.window_left;
    const int64_t right = variants.window_right >= capacity ? -1 : variants.window_right;
    return is_causal || left >= 0 || right >= 0;
}

// The cache fields of params, after set_fwd_params (whose sizes they correct: a cache's keys per sequence are its
// capacity, and a paged varlen call's cu_seqlens_k give lengths only, not rows of k, whose page stride
// set_fwd_params zeroed as a varlen batch stride).
void set_cache_params(FwdParams& params, const KVCache& cache, const Tensor& k_cache, const Tensor& v_cache,
                      bool varlen) {
    const int64_t capacity = cache.capacity(k_cache);
    params.k_capacity = static_cast<int>(capacity);
    params.kv_batches = static_cast<int>(k_cache.size(0));
    if (!varlen) { params.seqlen_k = static_cast<int>(capacity); }
    params.seqlens_k_ptr = cache.seqlens.has_value() ? static_cast<const int*>(cache.seqlens->data_ptr()) : nullptr;
    params.seqlen_k_new = cache.appends() ? static_cast<int>(cache.k_new->size(1)) : 0;
    params.leftpad_k_ptr = cache.leftpad.has_value() ? static_cast<const int*>(cache.leftpad->data_ptr()) : nullptr;
    params.kv_batch_idx_ptr = cache.batch_idx.has_value() ? static_cast<const int*>(cache.batch_idx->data_ptr())
                                                          : nullptr;
    if (cache.paged()) {
        params.block_table_ptr = static_cast<const int*>(cache.block_table->data_ptr());
        params.block_table_batch_stride = cache.block_table->stride(0);
        params.page_size = static_cast<int>(k_cache.size(1));
        params.num_pages = static_cast<int>(k_cache.size(0));
        params.total_k = INT32_MAX;
        params.k_batch_stride = k_cache.stride(0);
        params.v_batch_stride = v_cache.stride(0);
    }
}

// Appends k_new and v_new to the caches and rotates q (kvcache_prep.h). Returns the queries attention reads: q, or
// its rotated copy.
Tensor prepare_kvcache(const KVCache& cache, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Variants& variants, bool causal, cudaStream_t stream) {
    if (!cache.appends()) { return q; }
    KVCachePrepParams prep{};
    const Tensor& k_new = *cache.k_new;
    const Tensor& v_new = *cache.v_new;
    for (int d = 0; d < 3; ++d) {
        prep.k_new_strides[d] = k_new.stride(d);
        prep.v_new_strides[d] = v_new.stride(d);
        prep.k_cache_strides[d] = k_cache.stride(d);
        prep.v_cache_strides[d] = v_cache.stride(d);
        prep.q_strides[d] = q.stride(d);
    }
    prep.k_new_ptr = k_new.data_ptr();
    prep.v_new_ptr = v_new.data_ptr();
    prep.k_cache_ptr = k_cache.data_ptr();
    prep.v_cache_ptr = v_cache.data_ptr();
    prep.seqlens_ptr = static_cast<const int*>(cache.seqlens->data_ptr());
    prep.kv_batch_idx_ptr = cache.batch_idx.has_value() ? static_cast<const int*>(cache.batch_idx->data_ptr())
                                                        : nullptr;
    prep.kv_batches = static_cast<int>(k_cache.size(0));
    if (cache.paged()) {
        prep.block_table_ptr = static_cast<const int*>(cache.block_table->data_ptr());
        prep.block_table_batch_stride = cache.block_table->stride(0);
        prep.page_size = static_cast<int>(k_cache.size(1));
        prep.num_pages = static_cast<int>(k_cache.size(0));
    }
    const int64_t capacity = cache.capacity(k_cache);
    prep.capacity = static_cast<int>(capacity);
    prep.batch = static_cast<int>(q.size(0));
    prep.seqlen_new = static_cast<int>(k_new.size(1));
    prep.seqlen_q = static_cast<int>(q.size(1));
    prep.num_heads = static_cast<int>(q.size(2));
    prep.num_heads_k = static_cast<int>(k_cache.size(2));
    prep.head_dim = static_cast<int>(q.size(3));
    prep.is_bf16 = q.scalar_type() == ScalarType::BFloat16;
    Tensor q_rot = q;
    if (cache.rotary()) {
        q_rot = empty_like_contiguous(q);
        prep.q_ptr = q.data_ptr();
        prep.q_rot_ptr = q_rot.data_ptr();
        prep.cos_ptr = cache.rotary_cos->data_ptr();
        prep.sin_ptr = cache.rotary_sin->data_ptr();
        prep.seqlen_ro = static_cast<int>(cache.rotary_cos->size(0));
        prep.rotary_dim = static_cast<int>(2 * cache.rotary_cos->size(1));
        prep.interleaved = cache.rotary_interleaved;
        prep.q_per_row_positions = rotary_per_row(variants, causal, q.size(1), capacity);
    }
    check_launch(run_kvcache_prep(prep, stream), "flash_attn2::fwd_kvcache (append)", q.get_device_index());
    return q_rot;
}

// q, k, v are 4-D (varlen: (1, total, heads, head_dim) views); returns out in q's shape (varlen: 3-D) and the LSE.
// With a cache, k and v are the caches (KVCache), and the call first appends to them.
std::tuple<Tensor, Tensor> fwd_impl(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale,
                                    bool causal, int64_t num_splits, const std::string& plan_override,
                                    const Varlen* varlen, const Variants& variants, const KVCache* cache = nullptr) {
    if (cache == nullptr) {
        check_qkv(q, k, v);
        if (varlen != nullptr) { check_varlen(*varlen, q, k.size(1), "total_k"); }
    } else {
        check_kvcache(*cache, q, k, v, varlen);
        if (varlen != nullptr) { check_varlen(*varlen, q, cache->capacity(k), "the block table's rows"); }
    }
    check_scale(softmax_scale);
    check_variants(variants, q, varlen != nullptr ? varlen->batch() : q.size(0));
    check_num_splits(num_splits);
    const PlanOverride override = override_of(plan_override);
    check_device(q, k, v);
    const Problem problem = problem_of(Pass::kFwd, q, k, v, causal, false, varlen, variants, cache);
    const Plan plan = plan_call(problem, q, static_cast<int>(num_splits), override, find_fwd_launcher);
    const FwdLauncher launcher = require_fwd_launcher(q, plan);

    const int device = q.get_device_index();
    const DeviceGuard device_guard(device);
    const cudaStream_t stream = current_stream(device);
    const Tensor q_in = cache != nullptr ? prepare_kvcache(*cache, q, k, v, variants, causal, stream) : q;
    // A V narrower than Q and K that no narrow-V kernel runs (Plan::narrow_v) runs at Q's head dim, zero-padded:
    // its zero columns give the output zero columns, which are cut off before it is returned.
    const int64_t head_dim_v = v.size(3);
    const bool pad_v = head_dim_v < q.size(3) && !plan.narrow_v;
    const Tensor v_in = pad_v ? torch::stable::pad(v, {int64_t(0), q.size(3) - head_dim_v}) : v;
    Tensor out = empty_operand(q.size(0), q.size(1), q.size(2), v_in.size(3), q.scalar_type(), device,
                               varlen != nullptr);
    auto v_columns = [&](Tensor& o) {
        return pad_v ? torch::stable::contiguous(torch::stable::narrow(o, o.dim() - 1, 0, head_dim_v)) : o;
    };
    const std::vector<int64_t> lse_sizes = lse_shape(q, varlen);
    Tensor lse = empty_cuda(lse_sizes.data(), static_cast<int>(lse_sizes.size()), ScalarType::Float, device);
    if (out.numel() == 0) { return {v_columns(out), lse}; }
    if (varlen != nullptr && (varlen->batch() == 0 || varlen->max_seqlen_q == 0)) {
        // No query row belongs to a sequence: nothing to compute, and no grid to launch.
        zero_async(out, stream);
        return {v_columns(out), torch::stable::fill_(lse, INFINITY)};
    }

    FwdParams params{};
    set_fwd_params(params, pack_gqa(view4(q_in), plan.gqa_pack), view4(k), view4(v_in),
                   pack_gqa(view4(out), plan.gqa_pack), pack_gqa_lse(lse_view(lse), plan.gqa_pack), softmax_scale,
                   varlen, plan);
    if (cache != nullptr) { set_cache_params(params, *cache, k, v, varlen != nullptr); }
    set_variant_params(params, variants, causal);
    std::optional<Tensor> accum;  // std::optional: a default-constructed Tensor costs a shim call
    if (params.num_splits > 1) {
        // One allocation for both partials (each allocation is host time in a host-bound call): o_accum
        // (splits, rows, head_dim), then lse_accum (splits, rows), 16-byte aligned as head_dim % 8 == 0.
        const int64_t splits = params.num_splits, rows = int64_t(params.batch) * params.num_heads * params.seqlen_q;
        accum = empty_cuda({splits * rows * (params.head_dim + 1)}, ScalarType::Float, device);
        params.o_accum_ptr = static_cast<float*>(accum->data_ptr());
        params.lse_accum_ptr = params.o_accum_ptr + splits * rows * params.head_dim;
    }
    cudaError_t err = launcher(params, stream);
    if (err == cudaSuccess && params.num_splits > 1) {
        err = run_fwd_combine(params, q.scalar_type() == ScalarType::BFloat16, stream);
    }
    check_launch(err, "flash_attn2::fwd", device);
    return {v_columns(out), lse};
}

}  // namespace

std::tuple<Tensor, Tensor> fwd_op(const FwdArgs& a) {
    return fwd_impl(a.q, a.k, a.v, a.softmax_scale, a.causal, a.num_splits, a.plan_override, nullptr, a.variants);
}

std::tuple<Tensor, Tensor> varlen_fwd_op(const VarlenFwdArgs& a) {
    check_varlen_rank(a.q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(a.k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(a.v, "v", "(total_k, nheads_k, head_dim)");
    const Varlen varlen{a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k};
    return fwd_impl(torch::stable::unsqueeze(a.q, 0), torch::stable::unsqueeze(a.k, 0),
                    torch::stable::unsqueeze(a.v, 0), a.softmax_scale, a.causal, 0, a.plan_override, &varlen,
                    a.variants);
}

std::tuple<Tensor, Tensor> fwd_kvcache_op(const FwdKvcacheArgs& a) {
    const KVCache cache{a.k,
                        a.v,
                        a.rotary_cos,
                        a.rotary_sin,
                        a.cache_seqlens,
                        a.cache_batch_idx,
                        a.cache_leftpad,
                        a.block_table,
                        a.rotary_interleaved};
    return fwd_impl(a.q, a.k_cache, a.v_cache, a.softmax_scale, a.causal, a.num_splits, a.plan_override, nullptr,
                    a.variants, &cache);
}

std::tuple<Tensor, Tensor> varlen_fwd_paged_op(const VarlenFwdPagedArgs& a) {
    const std::optional<Tensor> none;
    const std::optional<Tensor> table = a.block_table;
    const KVCache cache{none, none, none, none, none, none, none, table, true};
    check_varlen_rank(a.q, "q", "(total_q, nheads, head_dim)");
    const Varlen varlen{a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k};
    return fwd_impl(torch::stable::unsqueeze(a.q, 0), a.k_cache, a.v_cache, a.softmax_scale, a.causal, 0,
                    a.plan_override, &varlen, a.variants, &cache);
}

}  // namespace flash
