#include "host/host_params.h"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "launch/tile_size.h"

namespace flash {

View4 view4(const Tensor& t) {
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    // A 3-D varlen tensor gets a leading batch of one, whose stride the kernels never use.
    const size_t lead = 4 - sizes.size();
    View4 view{t.data_ptr(), {1, 1, 1, 1}, {0, 0, 0, 0}};
    for (size_t d = 0; d < sizes.size(); ++d) {
        view.size[lead + d] = sizes[d];
        view.stride[lead + d] = strides[d];
    }
    return view;
}

LseView lse_view(const Tensor& lse) {
    return {static_cast<float*>(lse.data_ptr()), lse.dim() == 3 ? lse.stride(0) : 0, lse.stride(lse.dim() - 2)};
}

Problem problem_of(Pass pass, const Tensor& q, const Tensor& k, const Tensor& v, bool causal, bool deterministic,
                   const Varlen* varlen, const Variants& variants, const KVCache* cache) {
    // A cache's keys per sequence are known on the device only: plan for a full cache.
    const int64_t dense_seqlen_k = cache != nullptr ? cache->capacity(k) : k.size(1);
    const ProblemSizes sizes{varlen != nullptr ? varlen->batch() : q.size(0),
                             varlen != nullptr ? varlen->max_seqlen_q : q.size(1),
                             varlen != nullptr ? varlen->max_seqlen_k : dense_seqlen_k,
                             q.size(2),
                             k.size(2),
                             q.size(3),
                             v.size(3)};
    VariantFlags flags;
    flags.window_left = variants.window_left;
    flags.window_right = variants.window_right;
    flags.softcap = variants.softcap;
    flags.alibi = variants.alibi();
    flags.dropout = variants.dropout();
    flags.kvcache = cache != nullptr;
    flags.paged = cache != nullptr && cache->paged();
    return problem_of(pass, sizes, causal, deterministic, varlen != nullptr, flags);
}

PlanOverride override_of(const std::string& plan_override) {
    PlanOverride override;
    const std::string error = parse_plan_override(plan_override, override);
    FLASH_CHECK_ARG(error.empty(), error);
    return override;
}

namespace {

template <typename Launcher>
Launcher require_launcher(Launcher launcher, Pass pass, const KernelKey& key) {
    FLASH_CHECK(launcher != nullptr, "flash_attn_cuda was built without the kernel ", kernel_name(pass, key),
                "; rebuild with FLASH_ATTN2_HDIMS and FLASH_ATTN2_DTYPES covering it");
    return launcher;
}

KernelKey key_of(const Tensor& q, const Plan& plan) {
    return {q.scalar_type() == ScalarType::BFloat16, plan.kernel_head_dim, plan.causal, plan.variants};
}

}  // namespace

FwdLauncher require_fwd_launcher(const Tensor& q, const Plan& plan) {
    const KernelKey key = key_of(q, plan);
    return require_launcher(find_fwd_launcher(key), Pass::kFwd, key);
}

BwdLauncher require_bwd_launcher(const Tensor& q, const Plan& plan) {
    const KernelKey key = key_of(q, plan);
    return require_launcher(find_bwd_launcher(key), Pass::kBwd, key);
}

void set_fwd_params(FwdParams& params, const View4& q, const View4& k, const View4& v, const View4& out,
                    const LseView& lse, double softmax_scale, const Varlen* varlen, const Plan& plan) {
    params.q_ptr = q.ptr;
    params.k_ptr = k.ptr;
    params.v_ptr = v.ptr;
    params.o_ptr = out.ptr;
    params.lse_ptr = lse.ptr;
    params.q_batch_stride = q.stride[0];
    params.q_row_stride = q.stride[1];
    params.q_head_stride = q.stride[2];
    params.k_batch_stride = k.stride[0];
    params.k_row_stride = k.stride[1];
    params.k_head_stride = k.stride[2];
    params.v_batch_stride = v.stride[0];
    params.v_row_stride = v.stride[1];
    params.v_head_stride = v.stride[2];
    params.o_batch_stride = out.stride[0];
    params.o_row_stride = out.stride[1];
    params.o_head_stride = out.stride[2];
    params.batch = static_cast<int>(q.size[0]);
    params.seqlen_q = static_cast<int>(q.size[1]);
    params.seqlen_k = static_cast<int>(k.size[1]);
    params.total_q = static_cast<int>(q.size[1]);
    params.total_k = static_cast<int>(k.size[1]);
    params.num_heads = static_cast<int>(q.size[2]);
    params.num_heads_k = static_cast<int>(k.size[2]);
    params.head_dim = static_cast<int>(q.size[3]);
    params.head_dim_v = static_cast<int>(v.size[3]);
    params.lse_batch_stride = lse.batch_stride;
    params.lse_head_stride = lse.head_stride;
    if (varlen != nullptr) {
        params.cu_seqlens_q = static_cast<int*>(varlen->cu_seqlens_q.data_ptr());
        params.cu_seqlens_k = static_cast<int*>(varlen->cu_seqlens_k.data_ptr());
        params.batch = static_cast<int>(varlen->batch());
        params.seqlen_q = static_cast<int>(varlen->max_seqlen_q);
        params.seqlen_k = static_cast<int>(varlen->max_seqlen_k);
        params.q_batch_stride = params.k_batch_stride = params.v_batch_stride = params.o_batch_stride = 0;
    }
    // No cache (set_cache_params in fwd.cpp sets these for one): no limit on keys beyond the ones above.
    params.k_capacity = INT32_MAX;
    params.kv_batches = params.batch;
    params.gqa_pack = static_cast<int>(plan.gqa_pack);
    params.family = plan.family;
    params.short_key_tiles = plan.short_key_tile;
    params.warp_specialized = plan.warp_specialized;
    params.mma_sync_tile_set = plan.family == KernelFamily::kMmaSync ? mma_sync_tile_set(plan.tile_budget)
                                                                     : MmaSyncTileSet::k163KiB;
    params.num_splits = plan.num_splits;
    params.softmax_scale = static_cast<float>(softmax_scale);
    params.score_scale = params.softmax_scale;
    // A zero or denormal scale would turn masked scores into NaN (-inf * 0); the smallest normal float
    // keeps them at -inf, and every other exp2 argument still rounds to the same value (0).
    params.softmax_scale_log2 = std::max(static_cast<float>(softmax_scale * M_LOG2E), FLT_MIN);
    params.dropout_keep_scale = 1.f;
}

void set_variant_params(FwdParams& params, const Variants& variants, bool causal) {
    // An unbounded side gets a bound past every key of every sequence, for every row of a block past the last
    // query too (rows up to seqlen_q + 255): left = seqlen_k + 256 puts p - left below key 0, and
    // right = seqlen_q + 256 puts p + right at or past seqlen_k, for every position p = row + seqlen_k - seqlen_q. So
    // the tile tests never see an edge there (BlockBounds). Larger sizes are clamped to these, which changes
    // nothing; the kernels' positions then stay below seqlen_q + seqlen_k + 512.
    FLASH_CHECK_ARG(int64_t(params.seqlen_q) + params.seqlen_k < INT32_MAX - 1024,
                    "seqlen_q + seqlen_k must be below 2^31 - 1024, got ",
                    num(int64_t(params.seqlen_q) + params.seqlen_k));
    const int64_t left_unbounded = int64_t(params.seqlen_k) + 256;
    const int64_t right_unbounded = int64_t(params.seqlen_q) + 256;
    const int64_t right = variants.right(causal);
    params.window_left = static_cast<int>(variants.window_left >= 0 ? std::min(variants.window_left, left_unbounded)
                                                                    : left_unbounded);
    params.window_right = static_cast<int>(right >= 0 ? std::min(right, right_unbounded) : right_unbounded);
    // Softcap c: the kernels take tanh(q.k * scale / c) as the score and c as the exp factor (score_mod.h).
    const double score_scale = variants.softcap > 0.0 ? variants.softcap : double(params.softmax_scale);
    // (At least FLT_MIN: a zero prescale would read as no softcap; tanh of a tiny argument is as good as 0.)
    params.softcap_prescale = variants.softcap > 0.0
                                  ? std::max(static_cast<float>(params.softmax_scale / variants.softcap), FLT_MIN)
                                  : 0.f;
    params.score_scale = static_cast<float>(score_scale);
    // A zero or denormal factor would turn masked scores into NaN (-inf * 0); the smallest normal float keeps
    // them at -inf, and every other exp2 argument still rounds to the same value (0).
    params.softmax_scale_log2 = std::max(static_cast<float>(score_scale * M_LOG2E), FLT_MIN);
    params.alibi_slopes_ptr = nullptr;
    params.alibi_batch_stride = 0;
    if (variants.alibi()) {
        const Tensor& slopes = *variants.alibi_slopes;
        params.alibi_slopes_ptr = static_cast<const float*>(slopes.data_ptr());
        params.alibi_batch_stride = slopes.dim() == 2 ? slopes.stride(0) : 0;
    }
    params.learnable_sink_ptr = variants.sink() ? static_cast<const float*>(variants.learnable_sink->data_ptr())
                                                : nullptr;
    params.rng_state_ptr = nullptr;
    params.dropout_threshold = 0;
    params.dropout_keep_scale = 1.f;
    if (variants.dropout()) {
        params.rng_state_ptr = static_cast<const int64_t*>(variants.rng_state->data_ptr());
        // Dropped when the element's 8 random bits fall below round(256 p), at least 1 (a tiny p still reads as
        // dropout) and at most 255 (dropout.h, reference.effective_dropout_p). The kept elements scale by
        // 1 / (1 - p), the p the caller asked for, as flash-attn 2.x and PyTorch's kernels scale them: callers
        // (and flash-attn's own tests) compare against references that scale so.
        const double threshold = std::clamp(std::floor(variants.dropout_p * 256.0 + 0.5), 1.0, 255.0);
        params.dropout_threshold = static_cast<uint32_t>(threshold);
        params.dropout_keep_scale = static_cast<float>(1.0 / (1.0 - variants.dropout_p));
    }
}

std::vector<int64_t> lse_shape(const Tensor& q, const Varlen* varlen) {
    if (varlen != nullptr) { return {q.size(2), q.size(1)}; }
    return {q.size(0), q.size(2), q.size(1)};
}

Tensor empty_operand(int64_t batch, int64_t seqlen, int64_t heads, int64_t head_dim, ScalarType dtype, int device,
                     bool varlen) {
    return varlen ? empty_cuda({seqlen, heads, head_dim}, dtype, device)
                  : empty_cuda({batch, seqlen, heads, head_dim}, dtype, device);
}

View4 pack_gqa(const View4& t, int64_t group) {
    if (group == 1) { return t; }
    return {t.ptr,
            {t.size[0], group, t.size[2] / group, t.size[3]},
            {t.stride[0], t.stride[2], group * t.stride[2], t.stride[3]}};
}

LseView pack_gqa_lse(const LseView& lse, int64_t group) { return {lse.ptr, lse.batch_stride, lse.head_stride * group}; }

}  // namespace flash
