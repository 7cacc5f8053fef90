// The backward ops: checks, plan, gradient buffers, params, launches (D = rowsum(dO * O), the kernel, the dQ
// conversion), and the sum of per-query-head dK/dV slices when the plan has them.
#include <torch/csrc/stable/ops.h>

#include <optional>

#include "kernels/flash_bwd_aux.h"
#include "host/host_params.h"
#include "generated/ops.h"

namespace flash {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_impl(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                    const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                    double softmax_scale, bool causal, bool deterministic,
                                                    const std::string& plan_override, const Varlen* varlen,
                                                    const Variants& variants) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k.size(1), "total_k"); }
    check_bwd_inputs(dout, q, v, out, softmax_lse, lse_shape(q, varlen));
    check_scale(softmax_scale);
    check_variants(variants, q, varlen != nullptr ? varlen->batch() : q.size(0));
    const PlanOverride override = override_of(plan_override);
    check_device(q, k, v);
    check_same_device(dout, "dout", q);
    check_same_device(out, "out", q);
    FLASH_CHECK_ARG(same_device(softmax_lse, q), "softmax_lse must be on the device of q");
    const Problem problem = problem_of(Pass::kBwd, q, k, v, causal, deterministic, varlen, variants);
    const Plan plan = plan_call(problem, q, 0, override, find_bwd_launcher);
    const BwdLauncher launcher = require_bwd_launcher(q, plan);

    const int device = q.get_device_index();
    const DeviceGuard device_guard(device);
    const cudaStream_t stream = current_stream(device);
    // The kernels see q, dout, out, dq and the LSE through GQA-packed views (group 1: unchanged); sizes below
    // are the kernels'. Packed, there is no GQA left: dK and dV come out per key/value head.
    const int64_t group = plan.gqa_pack;
    const View4 q_k = pack_gqa(view4(q), group);
    const int64_t batch = problem.batch;
    const int64_t seqlen_q = problem.seqlen_q * group;
    const int64_t nheads = q_k.size[2], head_dim = q.size(3), nheads_k = k.size(2);
    const int64_t seqlen_k = k.size(1), batch_k = k.size(0);
    const int kernel_head_dim = plan.kernel_head_dim;
    const ScalarType dtype = q.scalar_type();
    // Gradients are always returned contiguous (the fake implementations promise as much), in the shape of their
    // input. Varlen rows outside every sequence are never written by the kernels; zeroing them gives a padded
    // (static-shape) buffer zero gradients there rather than uninitialized memory.
    auto gradient = [&](const Tensor& like, bool zeroed) {
        Tensor t = empty_operand_like(like, varlen != nullptr);
        if (zeroed) { zero_async(t, stream); }
        return t;
    };
    // The learnable sink's gradient: fp32 (nheads,), or an empty (0,) without a sink (a schema returns a tensor).
    // Where no query row sees a key, every output row is 0, so D and the sink's gradient are 0 too.
    auto sink_gradient = [&](bool zeroed) {
        Tensor t = empty_cuda({variants.sink() ? q.size(2) : 0}, ScalarType::Float, device);
        if (zeroed && variants.sink()) { zero_async(t, stream); }
        return t;
    };
    const bool nothing_to_do = q.numel() == 0 || k.numel() == 0 ||
                               (varlen != nullptr && (batch == 0 || seqlen_q == 0 || varlen->max_seqlen_k == 0));
    if (nothing_to_do) { return {gradient(q, true), gradient(k, true), gradient(v, true), sink_gradient(true)}; }
    // A V narrower than Q and K, where no narrow-V kernel runs it (Plan::narrow_v): the backward runs at Q's head
    // dim, with v, out and dout zero-padded to it (v's and out's added columns are zero, so dout's add nothing to
    // dP = dO V^T or D = rowsum(dO * O)), and dv is cut back to v's columns.
    const int64_t head_dim_v = v.size(3);
    const bool pad_v = head_dim_v < head_dim && !plan.narrow_v;
    auto widen = [&](const Tensor& t) {
        return pad_v ? torch::stable::pad(t, {int64_t(0), head_dim - head_dim_v}) : t;
    };
    auto v_columns = [&](Tensor dv) {
        return pad_v ? torch::stable::contiguous(torch::stable::narrow(dv, dv.dim() - 1, 0, head_dim_v)) : dv;
    };
    const Tensor v_in = widen(v), out_in = widen(out), dout_in = widen(dout);
    const Tensor lse = softmax_lse.is_contiguous() ? softmax_lse : torch::stable::contiguous(softmax_lse);
    // D = rowsum(dO * O), laid out like the LSE.
    const Tensor dsum = empty_like_contiguous(lse);
    // With a learnable sink: each row's share of its gradient, laid out like the LSE; varlen rows past the last
    // sequence belong to none and stay 0.
    std::optional<Tensor> sink_grad_rows;
    if (variants.sink()) {
        sink_grad_rows = empty_like_contiguous(lse);
        if (varlen != nullptr) { zero_async(*sink_grad_rows, stream); }
    }
    // Each sequence owns whole query blocks of dq_accum rows (see BwdParams::dq_accum_ptr).
    const int64_t dq_accum_seqlen = varlen != nullptr ? q.size(1) + batch * kBwdMaxBlockM
                                                      : (seqlen_q + kBwdMaxBlockM - 1) / kBwdMaxBlockM * kBwdMaxBlockM;
    FLASH_CHECK_ARG(dq_accum_seqlen <= INT32_MAX, "total_q + 128 * batch must fit in 32 bits, got ",
                    num(dq_accum_seqlen));
    const Tensor dq_accum = varlen != nullptr
                                ? empty_cuda({nheads, dq_accum_seqlen, kernel_head_dim}, ScalarType::Float, device)
                                : empty_cuda({batch, nheads, dq_accum_seqlen, kernel_head_dim}, ScalarType::Float,
                                             device);
    const Tensor dq = gradient(q, varlen != nullptr);
    // dK and dV: one slice per query head, or per key/value head when CTAs walk whole groups (or the heads are
    // packed); per-query-head slices of a GQA call are fp32, summed below so each gradient is rounded once.
    const ScalarType dkv_dtype = plan.dkv_fp32_slices ? ScalarType::Float : dtype;
    const int64_t dkv_heads = nheads / plan.heads_per_cta;
    const int64_t dv_cols = plan.narrow_v ? head_dim_v : head_dim;
    const Tensor dk_heads = empty_operand(batch_k, seqlen_k, dkv_heads, head_dim, dkv_dtype, device, varlen != nullptr);
    const Tensor dv_heads = empty_operand(batch_k, seqlen_k, dkv_heads, dv_cols, dkv_dtype, device, varlen != nullptr);
    if (varlen != nullptr) {
        zero_async(dk_heads, stream);
        zero_async(dv_heads, stream);
    }
    // The launcher zeroes dq_accum where its kernel needs it, and the flags of the kernel that stores instead
    // (BwdParams::dq_semaphore_ptr); deterministic mode's are zeroed here.
    const Tensor dq_semaphore = empty_cuda({batch, nheads, (seqlen_q + kBwdMinBlockM - 1) / kBwdMinBlockM},
                                           ScalarType::Int, device);
    if (deterministic) { zero_async(dq_semaphore, stream); }

    BwdParams params{};
    const LseView lse_k = pack_gqa_lse(lse_view(lse), group);
    set_fwd_params(params, q_k, view4(k), view4(v_in), pack_gqa(view4(out_in), group), lse_k, softmax_scale, varlen,
                   plan);
    set_variant_params(params, variants, causal);
    const View4 dout_k = pack_gqa(view4(dout_in), group);
    params.do_ptr = dout_k.ptr;
    params.do_batch_stride = varlen != nullptr ? 0 : dout_k.stride[0];
    params.do_row_stride = dout_k.stride[1];
    params.do_head_stride = dout_k.stride[2];
    params.dsum_ptr = static_cast<float*>(dsum.data_ptr());
    params.sink_grad_rows_ptr = variants.sink() ? static_cast<float*>(sink_grad_rows->data_ptr()) : nullptr;
    params.dq_accum_ptr = static_cast<float*>(dq_accum.data_ptr());
    params.dq_accum_bytes = dq_accum.numel() * int64_t(sizeof(float));
    const View4 dq_k = pack_gqa(view4(dq), group);
    params.dq_ptr = dq_k.ptr;
    params.dq_batch_stride = varlen != nullptr ? 0 : dq_k.stride[0];
    params.dq_row_stride = dq_k.stride[1];
    params.dq_head_stride = dq_k.stride[2];
    const View4 dk_view = view4(dk_heads);
    params.dk_ptr = dk_heads.data_ptr();
    params.dv_ptr = dv_heads.data_ptr();
    params.dk_batch_stride = varlen != nullptr ? 0 : dk_view.stride[0];
    params.dk_row_stride = dk_view.stride[1];
    params.dk_head_stride = dk_view.stride[2];
    const View4 dv_view = view4(dv_heads);
    params.dv_batch_stride = varlen != nullptr ? 0 : dv_view.stride[0];
    params.dv_row_stride = dv_view.stride[1];
    params.dv_head_stride = dv_view.stride[2];
    params.dkv_fp32 = plan.dkv_fp32_slices;
    params.heads_per_cta = plan.heads_per_cta;
    params.key_blocks_per_cta = plan.key_blocks_per_cta;
    params.short_query_tiles = plan.short_query_tile;
    params.stagger = plan.staggered;
    params.dq_semaphore_ptr = static_cast<int*>(dq_semaphore.data_ptr());
    params.dq_semaphore_bytes = dq_semaphore.numel() * int64_t(sizeof(int));
    params.dq_accum_seqlen = static_cast<int>(dq_accum_seqlen);
    params.dq_accum_head_dim = kernel_head_dim;
    params.deterministic = deterministic;
    const bool is_bf16 = dtype == ScalarType::BFloat16;
    cudaError_t err = run_bwd_dot_do_o(params, is_bf16, stream);
    // The launcher runs the main kernel and turns dq_accum into dq, whose order in dq_accum is its kernel's.
    if (err == cudaSuccess) { err = launcher(params, stream); }
    check_launch(err, "flash_attn2::bwd", device);

    // The sink's gradient sums its rows' shares over batch and rows: a torch reduction, whose order is the same in
    // every run, so the result is bitwise repeatable.
    const std::vector<int64_t> rows_dims = varlen != nullptr ? std::vector<int64_t>{1} : std::vector<int64_t>{0, 2};
    const Tensor dsink = variants.sink() ? torch::stable::sum(*sink_grad_rows, rows_dims, false, ScalarType::Float)
                                         : sink_gradient(false);
    if (!plan.dkv_fp32_slices) { return {dq, dk_heads, v_columns(dv_heads), dsink}; }
    const int64_t heads_per_kv = nheads / nheads_k;
    auto sum_group = [&](const Tensor& heads) {
        const int64_t cols = heads.size(heads.dim() - 1);
        const Tensor grouped = varlen != nullptr
                                   ? torch::stable::view(heads, {seqlen_k, nheads_k, heads_per_kv, cols})
                                   : torch::stable::view(heads, {batch_k, seqlen_k, nheads_k, heads_per_kv, cols});
        const Tensor summed = torch::stable::sum(grouped, std::vector<int64_t>{-2}, false, ScalarType::Float);
        return torch::stable::to(summed, dtype);
    };
    return {dq, sum_group(dk_heads), v_columns(sum_group(dv_heads)), dsink};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_op(const BwdArgs& a) {
    return bwd_impl(a.dout, a.q, a.k, a.v, a.out, a.softmax_lse, a.softmax_scale, a.causal, a.deterministic,
                    a.plan_override, nullptr, a.variants);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_bwd_op(const VarlenBwdArgs& a) {
    check_varlen_rank(a.q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(a.k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(a.v, "v", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(a.dout, "dout", "(total_q, nheads, head_dim)");
    check_varlen_rank(a.out, "out", "(total_q, nheads, head_dim)");
    const Varlen varlen{a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k};
    auto unsqueeze = [](const Tensor& t) { return torch::stable::unsqueeze(t, 0); };
    return bwd_impl(unsqueeze(a.dout), unsqueeze(a.q), unsqueeze(a.k), unsqueeze(a.v), unsqueeze(a.out), a.softmax_lse,
                    a.softmax_scale, a.causal, a.deterministic, a.plan_override, &varlen, a.variants);
}

}  // namespace flash
