// The forward ops: checks, plan, outputs, params, launches (the kernel, then the split-KV combine).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "flash_fwd_combine.h"
#include "host_params.h"
#include "ops.h"

namespace flash {
namespace {

// q, k, v are 4-D (varlen: (1, total, heads, head_dim) views); returns out in q's 4-D shape and the LSE.
std::tuple<at::Tensor, at::Tensor> fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double softmax_scale, bool causal, int64_t num_splits,
                                            const std::string& plan_override, const Varlen* varlen) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k); }
    check_scale(softmax_scale);
    check_num_splits(num_splits);
    const PlanOverride override = override_of(plan_override);
    check_device(q, k, v);
    const Problem problem = problem_of(Pass::kFwd, q, k, causal, false, varlen);
    const Plan plan = plan_call(problem, q, static_cast<int>(num_splits), override, find_fwd_launcher);
    const FwdLauncher launcher = require_fwd_launcher(q, plan);

    const c10::cuda::CUDAGuard device_guard(q.device());
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty(lse_shape(q, varlen), q.options().dtype(at::kFloat));
    if (out.numel() == 0) { return {out, lse}; }
    if (varlen != nullptr && (varlen->batch() == 0 || varlen->max_seqlen_q == 0)) {
        // No query row belongs to a sequence: nothing to compute, and no grid to launch.
        return {out.zero_(), lse.fill_(INFINITY)};
    }

    FwdParams params{};
    set_fwd_params(params, pack_gqa(q, plan.gqa_pack), k, v, pack_gqa(out, plan.gqa_pack),
                   pack_gqa_lse(lse, plan.gqa_pack), softmax_scale, varlen, plan);
    at::Tensor accum;
    if (params.num_splits > 1) {
        // One allocation for both partials (each allocation is host time in a host-bound call): o_accum
        // (splits, rows, head_dim), then lse_accum (splits, rows), 16-byte aligned as head_dim % 8 == 0.
        const int64_t splits = params.num_splits, rows = int64_t(params.batch) * params.num_heads * params.seqlen_q;
        accum = at::empty({splits * rows * (params.head_dim + 1)}, q.options().dtype(at::kFloat));
        params.o_accum_ptr = accum.data_ptr<float>();
        params.lse_accum_ptr = params.o_accum_ptr + splits * rows * params.head_dim;
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err = launcher(params, stream);
    if (err == cudaSuccess && params.num_splits > 1) {
        err = run_fwd_combine(params, q.scalar_type() == at::kBFloat16, stream);
    }
    check_launch(err, "flash_attn2::fwd", q.get_device());
    return {out, lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, bool /*deterministic: backward only*/,
                                       int64_t num_splits, const std::string& plan_override) {
    return fwd_impl(q, k, v, softmax_scale, causal, num_splits, plan_override, nullptr);
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              bool causal, bool /*deterministic: backward only*/,
                                              const std::string& plan_override) {
    check_varlen_rank(q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(v, "v", "(total_k, nheads_k, head_dim)");
    const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
    auto [out, lse] = fwd_impl(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal, 0,
                               plan_override, &varlen);
    return {out.squeeze(0), lse};
}

}  // namespace flash
