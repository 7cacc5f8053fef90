// The ops' C++ implementations (fwd.cpp, bwd.cpp, plan_op.cpp), registered in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace flash {

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, bool deterministic, int64_t num_splits,
                                       const std::string& plan_override);

std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              bool causal, bool deterministic, const std::string& plan_override);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out,
                                                   const at::Tensor& softmax_lse, double softmax_scale, bool causal,
                                                   bool deterministic, const std::string& plan_override);

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
    const std::string& plan_override);

// torch.ops.flash_attn2.plan: the plan of one pass for these sizes, as to_string(Plan) writes it.
std::string plan_op(const std::string& pass_name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
                    int64_t nheads_k, int64_t head_dim, bool causal, bool deterministic, bool varlen,
                    int64_t num_splits, const std::string& plan_override, int64_t arch, int64_t num_sms, bool is_bf16);

}  // namespace flash
