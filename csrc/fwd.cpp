// The forward ops: checks, plan, outputs, params, launches (the kernel, then the split-KV combine).
#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <optional>

#include "flash_fwd_combine.h"
#include "host_params.h"
#include "ops.h"

namespace flash {
namespace {

// q, k, v are 4-D (varlen: (1, total, heads, head_dim) views); returns out in q's shape (varlen: 3-D) and the LSE.
std::tuple<Tensor, Tensor> fwd_impl(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale,
                                    bool causal, int64_t num_splits, const std::string& plan_override,
                                    const Varlen* varlen, const Variants& variants) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k); }
    check_scale(softmax_scale);
    check_variants(variants, q, varlen != nullptr ? varlen->batch() : q.size(0));
    check_num_splits(num_splits);
    const PlanOverride override = override_of(plan_override);
    check_device(q, k, v);
    const Problem problem = problem_of(Pass::kFwd, q, k, causal, false, varlen, variants);
    const Plan plan = plan_call(problem, q, static_cast<int>(num_splits), override, find_fwd_launcher);
    const FwdLauncher launcher = require_fwd_launcher(q, plan);

    const int device = q.get_device_index();
    const DeviceGuard device_guard(device);
    Tensor out = empty_operand_like(q, varlen != nullptr);
    const std::vector<int64_t> lse_sizes = lse_shape(q, varlen);
    Tensor lse = empty_cuda(lse_sizes.data(), static_cast<int>(lse_sizes.size()), ScalarType::Float, device);
    if (out.numel() == 0) { return {out, lse}; }
    const cudaStream_t stream = current_stream(device);
    if (varlen != nullptr && (varlen->batch() == 0 || varlen->max_seqlen_q == 0)) {
        // No query row belongs to a sequence: nothing to compute, and no grid to launch.
        zero_async(out, stream);
        return {out, torch::stable::fill_(lse, INFINITY)};
    }

    FwdParams params{};
    set_fwd_params(params, pack_gqa(view4(q), plan.gqa_pack), view4(k), view4(v), pack_gqa(view4(out), plan.gqa_pack),
                   pack_gqa_lse(lse_view(lse), plan.gqa_pack), softmax_scale, varlen, plan);
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
    return {out, lse};
}

}  // namespace

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool causal,
                               bool /*deterministic: backward only*/, int64_t num_splits,
                               const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<Tensor>& alibi_slopes, double dropout_p,
                               const std::optional<Tensor>& rng_state) {
    const Variants variants{window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state};
    return fwd_impl(q, k, v, softmax_scale, causal, num_splits, plan_override, nullptr, variants);
}

std::tuple<Tensor, Tensor> varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                                      const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                      double softmax_scale, bool causal, bool /*deterministic: backward only*/,
                                      const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<Tensor>& alibi_slopes, double dropout_p,
                               const std::optional<Tensor>& rng_state) {
    const Variants variants{window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state};
    check_varlen_rank(q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(v, "v", "(total_k, nheads_k, head_dim)");
    const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
    return fwd_impl(torch::stable::unsqueeze(q, 0), torch::stable::unsqueeze(k, 0), torch::stable::unsqueeze(v, 0),
                    softmax_scale, causal, 0, plan_override, &varlen, variants);
}

}  // namespace flash
