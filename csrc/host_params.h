// From tensors to the kernels' view of a call: its Problem for the plan, the plan itself, and the FwdParams
// fields both passes read. GQA packing views live here too, since the plan decides them.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "device_info.h"
#include "flash_params.h"
#include "kernel_registry.h"
#include "plan.h"

namespace flash {

// q, k: 4-D (varlen: (1, total, heads, head_dim) views), checked.
Problem problem_of(Pass pass, const at::Tensor& q, const at::Tensor& k, bool causal, bool deterministic,
                   const Varlen* varlen);

// Parses and checks plan_override (errors name it).
PlanOverride override_of(const std::string& plan_override);

// The plan of `problem` on q's device with this build. find: find_fwd_launcher or find_bwd_launcher.
template <typename Find>
Plan plan_call(const Problem& problem, const at::Tensor& q, int num_splits, const PlanOverride& override, Find find) {
    const bool is_bf16 = q.scalar_type() == at::kBFloat16;
    const bool noncausal_built = find(KernelKey{is_bf16, kernel_head_dim(problem.head_dim), false}) != nullptr;
    return make_plan(problem, target_of(q.get_device(), noncausal_built), num_splits, override);
}

// The launcher of the plan's kernel, or an error naming the kernel the build lacks.
FwdLauncher require_fwd_launcher(const at::Tensor& q, const Plan& plan);
BwdLauncher require_bwd_launcher(const at::Tensor& q, const Plan& plan);

// Everything both passes read: inputs, output, LSE, sizes, the scale, the plan's kernel family and, for
// varlen, the sequence bounds. q and out are the packed views (pack_gqa).
void set_fwd_params(FwdParams& params, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Varlen* varlen,
                    const Plan& plan);

// The LSE of (batch, seqlen_q, nheads, d) inputs is (batch, nheads, seqlen_q); of varlen ones (nheads, total_q).
std::vector<int64_t> lse_shape(const at::Tensor& q, const Varlen* varlen);

// (batch, 1, nheads, d) -> (batch, group, nheads / group, d): a pure stride change (row stride = the head
// stride, head stride = group * the head stride), so outputs written through the view land in place.
at::Tensor pack_gqa(const at::Tensor& t, int64_t group);
// (batch, nheads, 1) contiguous is the same memory as (batch, nheads / group, group).
at::Tensor pack_gqa_lse(const at::Tensor& lse, int64_t group);

}  // namespace flash
