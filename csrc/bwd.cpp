// The backward ops: checks, plan, gradient buffers, params, launches (D = rowsum(dO * O), the kernel, the dQ
// conversion), and the sum of per-query-head dK/dV slices when the plan has them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "flash_bwd_aux.h"
#include "host_params.h"
#include "ops.h"

namespace flash {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_impl(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& softmax_lse, double softmax_scale,
                                                        bool causal, bool deterministic,
                                                        const std::string& plan_override, const Varlen* varlen) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k); }
    check_bwd_inputs(dout, q, out, softmax_lse, lse_shape(q, varlen));
    check_scale(softmax_scale);
    const PlanOverride override = override_of(plan_override);
    check_device(q, k, v);
    check_same_device(dout, "dout", q);
    check_same_device(out, "out", q);
    TORCH_CHECK_VALUE(softmax_lse.device() == q.device(), "softmax_lse must be on the device of q");
    const Problem problem = problem_of(Pass::kBwd, q, k, causal, deterministic, varlen);
    const Plan plan = plan_call(problem, q, 0, override, find_bwd_launcher);
    const BwdLauncher launcher = require_bwd_launcher(q, plan);

    const c10::cuda::CUDAGuard device_guard(q.device());
    // The kernels see q, dout, out, dq and the LSE through GQA-packed views (group 1: unchanged); sizes below
    // are the kernels'. Packed, there is no GQA left: dK and dV come out per key/value head.
    const int64_t group = plan.gqa_pack;
    const at::Tensor q_k = pack_gqa(q, group);
    const int64_t batch = problem.batch;
    const int64_t seqlen_q = problem.seqlen_q * group;
    const int64_t nheads = q_k.size(2), head_dim = q.size(3), nheads_k = k.size(2);
    const int kernel_head_dim = plan.kernel_head_dim;
    const bool nothing_to_do = q.numel() == 0 || k.numel() == 0 ||
                               (varlen != nullptr && (batch == 0 || seqlen_q == 0 || varlen->max_seqlen_k == 0));
    // Gradients are always returned contiguous (the fake implementations promise as much).
    auto zeros = [](const at::Tensor& t) { return at::zeros(t.sizes(), t.options()); };
    if (nothing_to_do) { return {zeros(q), zeros(k), zeros(v)}; }
    const at::Tensor lse = pack_gqa_lse(softmax_lse.contiguous(), group);
    const auto fp32 = q.options().dtype(at::kFloat);
    at::Tensor dsum = at::empty(lse.sizes(), fp32);
    // Each sequence owns whole query blocks of dq_accum rows (see BwdParams::dq_accum_ptr).
    const int64_t dq_accum_seqlen = varlen != nullptr ? q.size(1) + batch * kBwdMaxBlockM
                                                      : (seqlen_q + kBwdMaxBlockM - 1) / kBwdMaxBlockM * kBwdMaxBlockM;
    TORCH_CHECK_VALUE(dq_accum_seqlen <= INT32_MAX, "total_q + 128 * batch must fit in 32 bits, got ",
                      num(dq_accum_seqlen));
    at::Tensor dq_accum = varlen != nullptr ? at::zeros({nheads, dq_accum_seqlen, kernel_head_dim}, fp32)
                                            : at::zeros({batch, nheads, dq_accum_seqlen, kernel_head_dim}, fp32);
    // Varlen rows outside every sequence are never written by the kernels; zero them so that a padded
    // (static-shape) buffer gets zero gradients there rather than uninitialized memory.
    auto allocate = [&](at::IntArrayRef sizes, const at::TensorOptions& options) {
        return varlen != nullptr ? at::zeros(sizes, options) : at::empty(sizes, options);
    };
    at::Tensor dq = allocate(q.sizes(), q.options());
    const at::Tensor dq_k = pack_gqa(dq, group);
    // dK and dV: one slice per query head, or per key/value head when CTAs walk whole groups (or the heads are
    // packed); per-query-head slices of a GQA call are fp32, summed below so each gradient is rounded once.
    const auto dkv_options = plan.dkv_fp32_slices ? fp32 : q.options();
    at::Tensor dk_heads = allocate({k.size(0), k.size(1), nheads / plan.heads_per_cta, head_dim}, dkv_options);
    at::Tensor dv_heads = allocate({k.size(0), k.size(1), nheads / plan.heads_per_cta, head_dim}, dkv_options);
    at::Tensor dq_semaphore;
    if (deterministic) {
        dq_semaphore = at::zeros({batch, nheads, (seqlen_q + kBwdMinBlockM - 1) / kBwdMinBlockM}, q.options().dtype(at::kInt));
    }

    BwdParams params{};
    set_fwd_params(params, q_k, k, v, pack_gqa(out, group), lse, softmax_scale, varlen, plan);
    const at::Tensor dout_k = pack_gqa(dout, group);
    params.do_ptr = dout_k.data_ptr();
    params.do_batch_stride = varlen != nullptr ? 0 : dout_k.stride(0);
    params.do_row_stride = dout_k.stride(1);
    params.do_head_stride = dout_k.stride(2);
    params.dsum_ptr = dsum.data_ptr<float>();
    params.dq_accum_ptr = dq_accum.data_ptr<float>();
    params.dq_ptr = dq_k.data_ptr();
    params.dq_batch_stride = varlen != nullptr ? 0 : dq_k.stride(0);
    params.dq_row_stride = dq_k.stride(1);
    params.dq_head_stride = dq_k.stride(2);
    params.dk_ptr = dk_heads.data_ptr();
    params.dv_ptr = dv_heads.data_ptr();
    params.dk_batch_stride = varlen != nullptr ? 0 : dk_heads.stride(0);
    params.dk_row_stride = dk_heads.stride(1);
    params.dk_head_stride = dk_heads.stride(2);
    params.dkv_fp32 = plan.dkv_fp32_slices;
    params.heads_per_cta = plan.heads_per_cta;
    params.key_blocks_per_cta = plan.key_blocks_per_cta;
    params.short_query_tiles = plan.short_query_tile;
    params.dq_semaphore_ptr = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
    params.dq_accum_seqlen = static_cast<int>(dq_accum_seqlen);
    params.dq_accum_head_dim = kernel_head_dim;
    params.deterministic = deterministic;
    const bool is_bf16 = q.scalar_type() == at::kBFloat16;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err = run_bwd_dot_do_o(params, is_bf16, stream);
    if (err == cudaSuccess) { err = launcher(params, stream); }
    if (err == cudaSuccess) { err = run_bwd_convert_dq(params, is_bf16, stream); }
    check_launch(err, "flash_attn2::bwd", q.get_device());

    if (!plan.dkv_fp32_slices) { return {dq, dk_heads, dv_heads}; }
    const int64_t heads_per_kv = nheads / nheads_k;
    auto sum_group = [&](const at::Tensor& heads) {
        return heads.view({k.size(0), k.size(1), nheads_k, heads_per_kv, head_dim}).sum(3, false, at::kFloat).to(q.scalar_type());
    };
    return {dq, sum_group(dk_heads), sum_group(dv_heads)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out,
                                                   const at::Tensor& softmax_lse, double softmax_scale, bool causal,
                                                   bool deterministic, const std::string& plan_override) {
    return bwd_impl(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, plan_override, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
    const std::string& plan_override) {
    check_varlen_rank(q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(v, "v", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(dout, "dout", "(total_q, nheads, head_dim)");
    check_varlen_rank(out, "out", "(total_q, nheads, head_dim)");
    const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
    auto [dq, dk, dv] = bwd_impl(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                                 softmax_lse, softmax_scale, causal, deterministic, plan_override, &varlen);
    return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)};
}

}  // namespace flash
