#include "host/checks.h"

#include <algorithm>
#include <cmath>

#include "host/device_info.h"
#include "host/plan.h"
#include "launch/tile_size.h"

namespace flash {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGridZ = 65535;  // heads index the grid's z; batches of any size go in chunks (launch.h)

// The kernel moves 16-byte chunks: unit stride on head_dim, the other strides multiples of 8 elements.
void check_layout(const Tensor& t, const char* name) {
    FLASH_CHECK_ARG(t.stride(3) == 1, name, " must have a contiguous last dimension (stride 1), got stride ",
                    num(t.stride(3)));
    for (int64_t d = 0; d < 3; ++d) {
        FLASH_CHECK_ARG(t.size(d) <= 1 || t.stride(d) % 8 == 0, name,
                        " must have strides that are multiples of 8 elements, got ", shape_str(t.strides()));
    }
}

template <typename Sizes>
bool same_sizes(torch::headeronly::IntHeaderOnlyArrayRef a, const Sizes& b) {
    if (a.size() != b.size()) { return false; }
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i] != b[i]) { return false; }
    }
    return true;
}

}  // namespace

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
    FLASH_CHECK_ARG(q.dim() == 4, "q must have shape (batch, seqlen_q, nheads, head_dim), got ", num(q.dim()), " dims");
    FLASH_CHECK_ARG(k.dim() == 4, "k must have shape (batch, seqlen_k, nheads_k, head_dim), got ", num(k.dim()),
                    " dims");
    FLASH_CHECK_ARG(v.dim() == 4, "v must have shape (batch, seqlen_k, nheads_k, head_dim), got ", num(v.dim()),
                    " dims");

    const auto dtype = q.scalar_type();
    FLASH_CHECK_ARG(dtype == ScalarType::Half || dtype == ScalarType::BFloat16, "q must be float16 or bfloat16, got ",
                    dtype);
    FLASH_CHECK_ARG(k.scalar_type() == dtype, "k must have the same dtype as q (", dtype, "), got ", k.scalar_type());
    FLASH_CHECK_ARG(v.scalar_type() == dtype, "v must have the same dtype as q (", dtype, "), got ", v.scalar_type());

    const int64_t batch = q.size(0);
    const int64_t nheads = q.size(2);
    const int64_t head_dim = q.size(3);
    const int64_t nheads_k = k.size(2);
    FLASH_CHECK_ARG(k.size(0) == batch, "k must have the same batch size as q (", num(batch), "), got ",
                    num(k.size(0)));
    FLASH_CHECK_ARG(v.size(0) == batch, "v must have the same batch size as q (", num(batch), "), got ",
                    num(v.size(0)));
    FLASH_CHECK_ARG(v.size(1) == k.size(1), "v must have the same seqlen_k as k (", num(k.size(1)), "), got ",
                    num(v.size(1)));
    FLASH_CHECK_ARG(v.size(2) == nheads_k, "v must have the same nheads_k as k (", num(nheads_k), "), got ",
                    num(v.size(2)));
    FLASH_CHECK_ARG(k.size(3) == head_dim, "k must have the same head_dim as q (", num(head_dim), "), got ",
                    num(k.size(3)));
    const bool head_dim_ok = head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % 8 == 0;
    FLASH_CHECK_ARG(head_dim_ok,
                    "head_dim must be a multiple of 8 in [8, 256] (flash_attn_func pads other sizes), got ",
                    num(head_dim));
    // V may be narrower than Q and K (DeepSeek's 192 and 128); a wider one is the caller's to pad Q and K for.
    FLASH_CHECK_ARG(v.size(3) > 0 && v.size(3) <= head_dim && v.size(3) % 8 == 0,
                    "v's head_dim must be a multiple of 8 in [8, head_dim of q = ", num(head_dim),
                    "] (flash_attn_func pads other sizes), got ", num(v.size(3)));
    const bool heads_ok = nheads_k > 0 && nheads % nheads_k == 0;
    FLASH_CHECK_ARG(heads_ok, "nheads (", num(nheads), ") must be a multiple of nheads_k (", num(nheads_k), ")");
    FLASH_CHECK_ARG(batch <= INT32_MAX, "batch must be at most ", num(INT32_MAX), ", got ", num(batch));
    FLASH_CHECK_ARG(nheads <= kMaxGridZ, "nheads must be at most ", num(kMaxGridZ), ", got ", num(nheads));
    // Block arithmetic on sequence positions is 32-bit; leave room for one block past the end.
    constexpr int64_t kMaxSeqlen = INT32_MAX - 256;
    FLASH_CHECK_ARG(q.size(1) <= kMaxSeqlen && k.size(1) <= kMaxSeqlen, "seqlen_q and seqlen_k must be at most ",
                    num(kMaxSeqlen));
    check_layout(q, "q");
    check_layout(k, "k");
    check_layout(v, "v");
}

void check_varlen(const Varlen& varlen, const Tensor& q, int64_t max_keys, const char* keys_name) {
    for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{varlen.cu_seqlens_q, "cu_seqlens_q"},
                                  std::pair<const Tensor&, const char*>{varlen.cu_seqlens_k, "cu_seqlens_k"}}) {
        FLASH_CHECK_ARG(t.scalar_type() == ScalarType::Int, name, " must be int32, got ", t.scalar_type());
        FLASH_CHECK_ARG(t.dim() == 1 && t.size(0) >= 1, name, " must have shape (batch + 1,), got ",
                        shape_str(t.sizes()));
        FLASH_CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
        FLASH_CHECK_ARG(same_device(t, q), name, " must be on the device of q (", device_str(q), "), got ",
                        device_str(t));
    }
    FLASH_CHECK_ARG(varlen.cu_seqlens_k.size(0) == varlen.cu_seqlens_q.size(0),
                    "cu_seqlens_k must have the length of cu_seqlens_q (", num(varlen.cu_seqlens_q.size(0)), "), got ",
                    num(varlen.cu_seqlens_k.size(0)));
    FLASH_CHECK_ARG(varlen.batch() <= INT32_MAX, "batch (len(cu_seqlens_q) - 1) must be at most ", num(INT32_MAX),
                    ", got ", num(varlen.batch()));
    FLASH_CHECK_ARG(varlen.max_seqlen_q >= 0 && varlen.max_seqlen_q <= q.size(1),
                    "max_seqlen_q must be in [0, total_q = ", num(q.size(1)), "], got ", num(varlen.max_seqlen_q));
    FLASH_CHECK_ARG(varlen.max_seqlen_k >= 0 && varlen.max_seqlen_k <= max_keys, "max_seqlen_k must be in [0, ",
                    keys_name, " = ", num(max_keys), "], got ", num(varlen.max_seqlen_k));
}

namespace {

// An int32 (batch,) argument of a KV-cache call.
void check_per_sequence(const std::optional<Tensor>& t, const char* name, int64_t batch, const Tensor& q) {
    if (!t.has_value()) { return; }
    FLASH_CHECK_ARG(t->scalar_type() == ScalarType::Int, name, " must be int32, got ", t->scalar_type());
    FLASH_CHECK_ARG(t->dim() == 1 && t->size(0) == batch, name, " must have shape (batch,) = (", num(batch), ",), got ",
                    shape_str(t->sizes()));
    FLASH_CHECK_ARG(t->is_contiguous(), name, " must be contiguous");
    FLASH_CHECK_ARG(same_device(*t, q), name, " must be on the device of q (", device_str(q), "), got ",
                    device_str(*t));
}

}  // namespace

void check_kvcache(const KVCache& cache, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                   const Varlen* varlen) {
    FLASH_CHECK_ARG(q.dim() == 4, "q must have shape (batch, seqlen_q, nheads, head_dim), got ", num(q.dim()), " dims");
    const char* cache_shape = cache.paged() ? "(num_pages, page_size, nheads_k, head_dim) with a block_table"
                                            : "(batch_cache, seqlen_cache, nheads_k, head_dim)";
    FLASH_CHECK_ARG(k_cache.dim() == 4, "k_cache must have shape ", cache_shape, ", got ", num(k_cache.dim()), " dims");
    FLASH_CHECK_ARG(same_sizes(v_cache.sizes(), k_cache.sizes()), "v_cache must have the shape of k_cache ",
                    shape_str(k_cache.sizes()), ", got ", shape_str(v_cache.sizes()));
    const auto dtype = q.scalar_type();
    FLASH_CHECK_ARG(dtype == ScalarType::Half || dtype == ScalarType::BFloat16, "q must be float16 or bfloat16, got ",
                    dtype);
    FLASH_CHECK_ARG(k_cache.scalar_type() == dtype, "k_cache must have the dtype of q (", dtype, "), got ",
                    k_cache.scalar_type());
    FLASH_CHECK_ARG(v_cache.scalar_type() == dtype, "v_cache must have the dtype of q (", dtype, "), got ",
                    v_cache.scalar_type());
    const int64_t batch = varlen != nullptr ? varlen->batch() : q.size(0);
    const int64_t nheads = q.size(2);
    const int64_t head_dim = q.size(3);
    const int64_t nheads_k = k_cache.size(2);
    FLASH_CHECK_ARG(k_cache.size(3) == head_dim, "k_cache must have the head_dim of q (", num(head_dim), "), got ",
                    num(k_cache.size(3)));
    FLASH_CHECK_ARG(head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % 8 == 0,
                    "head_dim must be a multiple of 8 in [8, 256] (flash_attn_with_kvcache pads other sizes), got ",
                    num(head_dim));
    FLASH_CHECK_ARG(nheads_k > 0 && nheads % nheads_k == 0, "nheads (", num(nheads),
                    ") must be a multiple of nheads_k (", num(nheads_k), ")");
    FLASH_CHECK_ARG(batch <= INT32_MAX, "batch must be at most ", num(INT32_MAX), ", got ", num(batch));
    FLASH_CHECK_ARG(nheads <= kMaxGridZ, "nheads must be at most ", num(kMaxGridZ), ", got ", num(nheads));
    FLASH_CHECK_ARG(k_cache.size(0) >= 1 && k_cache.size(0) <= INT32_MAX, "k_cache must have between 1 and ",
                    num(INT32_MAX), " ", cache.paged() ? "pages" : "batch rows", ", got ", num(k_cache.size(0)));
    constexpr int64_t kMaxSeqlen = INT32_MAX - 256;
    if (cache.paged()) {
        const Tensor& table = *cache.block_table;
        FLASH_CHECK_ARG(table.scalar_type() == ScalarType::Int, "block_table must be int32, got ", table.scalar_type());
        FLASH_CHECK_ARG(table.dim() == 2 && table.size(0) == batch,
                        "block_table must have shape (batch, max_pages) = (", num(batch), ", max_pages), got ",
                        shape_str(table.sizes()));
        FLASH_CHECK_ARG(table.size(1) <= 1 || table.stride(1) == 1,
                        "block_table must have a contiguous last dimension");
        FLASH_CHECK_ARG(same_device(table, q), "block_table must be on the device of q (", device_str(q), "), got ",
                        device_str(table));
        const int64_t page_size = k_cache.size(1);
        FLASH_CHECK_ARG(page_size > 0 && page_size % 16 == 0,
                        "k_cache: the page size (dim 1 of a paged cache) must be a positive multiple of 16, got ",
                        num(page_size));
        FLASH_CHECK_ARG(
            !cache.batch_idx.has_value(),
            "cache_batch_idx cannot be combined with block_table (the block table maps sequences to pages)");
    }
    const int64_t capacity = cache.capacity(k_cache);
    FLASH_CHECK_ARG(capacity <= kMaxSeqlen, "the cache must hold at most ", num(kMaxSeqlen), " rows per sequence, got ",
                    num(capacity));
    if (!cache.paged() && varlen == nullptr && !cache.batch_idx.has_value()) {
        FLASH_CHECK_ARG(k_cache.size(0) >= batch, "k_cache must have a batch row per sequence of q (", num(batch),
                        "), got ", num(k_cache.size(0)), "; or pass cache_batch_idx");
    }
    check_per_sequence(cache.seqlens, "cache_seqlens", batch, q);
    check_per_sequence(cache.batch_idx, "cache_batch_idx", batch, q);
    check_per_sequence(cache.leftpad, "cache_leftpad", batch, q);
    FLASH_CHECK_ARG(cache.k_new.has_value() == cache.v_new.has_value(), "k and v must be given together");
    if (cache.appends()) {
        FLASH_CHECK_ARG(cache.seqlens.has_value(), "cache_seqlens must be given with k and v (where to append them)");
        for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{*cache.k_new, "k"},
                                      std::pair<const Tensor&, const char*>{*cache.v_new, "v"}}) {
            FLASH_CHECK_ARG(t.dim() == 4 && t.size(0) == batch && t.size(2) == nheads_k && t.size(3) == head_dim, name,
                            " must have shape (batch, seqlen_new, nheads_k, head_dim) = (", num(batch),
                            ", seqlen_new, ", num(nheads_k), ", ", num(head_dim), "), got ", shape_str(t.sizes()));
            FLASH_CHECK_ARG(t.scalar_type() == dtype, name, " must have the dtype of q (", dtype, "), got ",
                            t.scalar_type());
            FLASH_CHECK_ARG(same_device(t, q), name, " must be on the device of q (", device_str(q), "), got ",
                            device_str(t));
        }
        FLASH_CHECK_ARG(cache.v_new->size(1) == cache.k_new->size(1), "v must have the seqlen_new of k (",
                        num(cache.k_new->size(1)), "), got ", num(cache.v_new->size(1)));
        FLASH_CHECK_ARG(cache.k_new->size(1) <= capacity, "k: seqlen_new (", num(cache.k_new->size(1)),
                        ") must fit in the cache (", num(capacity), " rows per sequence)");
    }
    FLASH_CHECK_ARG(cache.rotary_cos.has_value() == cache.rotary_sin.has_value(),
                    "rotary_cos and rotary_sin must be given together");
    if (cache.rotary()) {
        FLASH_CHECK_ARG(cache.appends(),
                        "rotary_cos and rotary_sin need k and v (rotary embedding applies to the new keys)");
        const Tensor& cos = *cache.rotary_cos;
        const Tensor& sin = *cache.rotary_sin;
        FLASH_CHECK_ARG(cos.dim() == 2, "rotary_cos must have shape (seqlen_ro, rotary_dim / 2), got ",
                        shape_str(cos.sizes()));
        FLASH_CHECK_ARG(same_sizes(sin.sizes(), cos.sizes()), "rotary_sin must have the shape of rotary_cos ",
                        shape_str(cos.sizes()), ", got ", shape_str(sin.sizes()));
        const int64_t rotary_dim = 2 * cos.size(1);
        FLASH_CHECK_ARG(rotary_dim > 0 && rotary_dim <= head_dim, "rotary_cos: rotary_dim (2 * ", num(cos.size(1)),
                        ") must be in [2, head_dim = ", num(head_dim), "]");
        const int64_t positions = std::max<int64_t>(capacity, 1);
        FLASH_CHECK_ARG(cos.size(0) >= positions, "rotary_cos must have a row per cache position (at least ",
                        num(positions), "), got ", num(cos.size(0)));
        for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{cos, "rotary_cos"},
                                      std::pair<const Tensor&, const char*>{sin, "rotary_sin"}}) {
            FLASH_CHECK_ARG(t.scalar_type() == dtype, name, " must have the dtype of q (", dtype, "), got ",
                            t.scalar_type());
            FLASH_CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
            FLASH_CHECK_ARG(same_device(t, q), name, " must be on the device of q (", device_str(q), "), got ",
                            device_str(t));
        }
    }
    check_layout(q, "q");
    check_layout(k_cache, "k_cache");
    check_layout(v_cache, "v_cache");
    if (cache.appends()) {
        check_layout(*cache.k_new, "k");
        check_layout(*cache.v_new, "v");
    }
}

void check_varlen_rank(const Tensor& t, const char* name, const char* shape) {
    FLASH_CHECK_ARG(t.dim() == 3, name, " must have shape ", shape, ", got ", num(t.dim()), " dims");
}

void check_scale(double softmax_scale) {
    // The kernels take each row's maximum of the unscaled scores, which is the maximum of the scaled
    // ones only for a non-negative scale (flash_attn_func handles a negative scale by negating q).
    // The scale also has to stay finite once it is a float multiplied by log2(e).
    FLASH_CHECK_ARG(std::isfinite(static_cast<float>(softmax_scale * M_LOG2E)) && softmax_scale >= 0,
                    "softmax_scale must be finite and non-negative, got ", std::to_string(softmax_scale));
}

void check_variants(const Variants& variants, const Tensor& q, int64_t batch) {
    // Sizes past the sequences are clamped (host_params.cpp): any such window is unbounded on that side.
    FLASH_CHECK_ARG(variants.window_left >= -1 && variants.window_right >= -1,
                    "window_size must hold integers >= -1 (-1: unbounded), got (", num(variants.window_left), ", ",
                    num(variants.window_right), ")");
    FLASH_CHECK_ARG(std::isfinite(variants.softcap) && variants.softcap >= 0.0,
                    "softcap must be finite and non-negative (0: none), got ", std::to_string(variants.softcap));
    FLASH_CHECK_ARG(variants.dropout_p >= 0.0 && variants.dropout_p < 1.0, "dropout_p must be in [0, 1), got ",
                    std::to_string(variants.dropout_p));
    const int64_t nheads = q.size(2);
    if (variants.alibi()) {
        const Tensor& slopes = *variants.alibi_slopes;
        FLASH_CHECK_ARG(slopes.scalar_type() == ScalarType::Float, "alibi_slopes must be float32, got ",
                        slopes.scalar_type());
        const bool shape_ok = (slopes.dim() == 1 && slopes.size(0) == nheads) ||
                              (slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == nheads);
        FLASH_CHECK_ARG(shape_ok, "alibi_slopes must have shape (nheads,) = (", num(nheads),
                        ",) or (batch, nheads) = (", num(batch), ", ", num(nheads), "), got ",
                        shape_str(slopes.sizes()));
        FLASH_CHECK_ARG(slopes.stride(slopes.dim() - 1) == 1 || nheads == 1,
                        "alibi_slopes must have a contiguous last dimension (stride 1)");
        FLASH_CHECK_ARG(same_device(slopes, q), "alibi_slopes must be on the device of q (", device_str(q), "), got ",
                        device_str(slopes));
    }
    if (variants.dropout()) {
        FLASH_CHECK_ARG(variants.rng_state.has_value(),
                        "rng_state must be given when dropout_p > 0 (int64 (2,): seed, offset)");
        const Tensor& rng = *variants.rng_state;
        FLASH_CHECK_ARG(rng.scalar_type() == ScalarType::Long && rng.dim() == 1 && rng.size(0) == 2 &&
                            rng.is_contiguous(),
                        "rng_state must be a contiguous int64 tensor of shape (2,), got ", rng.scalar_type(), " ",
                        shape_str(rng.sizes()));
        FLASH_CHECK_ARG(same_device(rng, q), "rng_state must be on the device of q (", device_str(q), "), got ",
                        device_str(rng));
    }
    if (variants.sink()) {
        // The public functions convert a bf16 or fp16 sink (and its gradient back); the ops take fp32 only.
        const Tensor& sink = *variants.learnable_sink;
        FLASH_CHECK_ARG(sink.scalar_type() == ScalarType::Float, "learnable_sink must be float32, got ",
                        sink.scalar_type());
        FLASH_CHECK_ARG(sink.dim() == 1 && sink.size(0) == nheads, "learnable_sink must have shape (nheads,) = (",
                        num(nheads), ",), got ", shape_str(sink.sizes()));
        FLASH_CHECK_ARG(sink.is_contiguous(), "learnable_sink must be contiguous");
        FLASH_CHECK_ARG(same_device(sink, q), "learnable_sink must be on the device of q (", device_str(q), "), got ",
                        device_str(sink));
    }
}

void check_num_splits(int64_t num_splits) {
    FLASH_CHECK_ARG(num_splits >= 0 && num_splits <= kMaxForcedSplits, "num_splits must be in [0, ",
                    num(kMaxForcedSplits), "] (0: chosen per call), got ", num(num_splits));
}

void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& v, const Tensor& out, const Tensor& lse,
                      const std::vector<int64_t>& lse_shape) {
    // out and dout: q's shape with v's head dim.
    std::vector<int64_t> out_shape(q.sizes().begin(), q.sizes().end());
    out_shape.back() = v.size(v.dim() - 1);
    FLASH_CHECK_ARG(same_sizes(dout.sizes(), out_shape), "dout must have the shape of out ",
                    shape_str(out_shape.data(), out_shape.size()), ", got ", shape_str(dout.sizes()));
    FLASH_CHECK_ARG(same_sizes(out.sizes(), out_shape), "out must have q's shape with v's head_dim ",
                    shape_str(out_shape.data(), out_shape.size()), ", got ", shape_str(out.sizes()));
    FLASH_CHECK_ARG(dout.scalar_type() == q.scalar_type(), "dout must have the dtype of q (", q.scalar_type(),
                    "), got ", dout.scalar_type());
    FLASH_CHECK_ARG(out.scalar_type() == q.scalar_type(), "out must have the dtype of q (", q.scalar_type(), "), got ",
                    out.scalar_type());
    FLASH_CHECK_ARG(lse.scalar_type() == ScalarType::Float, "softmax_lse must be float32, got ", lse.scalar_type());
    FLASH_CHECK_ARG(same_sizes(lse.sizes(), lse_shape), "softmax_lse must have shape ",
                    shape_str(lse_shape.data(), lse_shape.size()), ", got ", shape_str(lse.sizes()));
    check_layout(dout, "dout");
    check_layout(out, "out");
}

void check_same_device(const Tensor& t, const char* name, const Tensor& q) {
    FLASH_CHECK_ARG(same_device(t, q), name, " must be on the same device as q (", device_str(q), "), got ",
                    device_str(t));
    FLASH_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " must start at a 16-byte aligned address");
}

void check_device(const Tensor& q, const Tensor& k, const Tensor& v) {
    FLASH_CHECK_ARG(q.is_cuda(), "q must be a CUDA tensor, got device ", device_str(q));
    check_same_device(q, "q", q);
    check_same_device(k, "k", q);
    check_same_device(v, "v", q);
    const int cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, q.get_device_index());
    FLASH_CHECK(cc_major >= 0, "could not query the compute capability of ", device_str(q));
    FLASH_CHECK(cc_major >= 8, "flash_attn_cuda needs an Ampere (sm_80) or newer GPU, got compute capability ",
                num(cc_major), ".x on ", device_str(q));
}

// A kernel that needs more shared memory per block than the GPU offers is refused before its launch (plan_call);
// a launch that fails all the same on a GPU below the mma.sync tiles' budget (sm_86, sm_89, sm_120) still says
// what the GPU offers, the likeliest cause of CUDA's bare "invalid argument" there.
void check_launch(cudaError_t err, const char* op, int device) {
    if (err == cudaSuccess) { return; }
    std::string hint;
    const int optin_bytes = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (optin_bytes > 0 && optin_bytes < kSmem163KiB) {
        hint = " (this GPU allows " + num(optin_bytes / 1024) +
               " KiB of shared memory per block; the mma.sync kernels' tiles are made for 163 KiB)";
    }
    FLASH_CHECK(false, op, " kernel launch failed: ", cudaGetErrorString(err), hint);
}

}  // namespace flash
