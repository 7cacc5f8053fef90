// From tensors to the kernels' view of a call: its Problem for the plan, the plan itself, and the FwdParams
// fields both passes read. GQA packing lives here too, since the plan decides it: it changes only the sizes and
// strides the kernels are given, so it works on plain views rather than tensors.
#pragma once

#include <string>
#include <vector>

#include "host/checks.h"
#include "host/device_info.h"
#include "launch/flash_params.h"
#include "launch/kernel_registry.h"
#include "host/plan.h"
#include "host/torch_glue.h"

namespace flash {

// A (batch, seqlen, heads, head_dim) operand as the kernels address it: a pointer and element sizes and strides.
struct View4 {
    void* ptr;
    int64_t size[4];
    int64_t stride[4];
};
// t: 4-D, or varlen's 3-D (total, heads, head_dim), which reads as (1, total, heads, head_dim).
View4 view4(const Tensor& t);

// The LSE as the kernels address it: row r of head h in batch b is ptr[b * batch_stride + h * head_stride + r].
struct LseView {
    float* ptr;
    int64_t batch_stride;  // 0 for varlen's (nheads, total_q)
    int64_t head_stride;
};
// lse: (batch, nheads, seqlen_q) or varlen's (nheads, total_q), contiguous.
LseView lse_view(const Tensor& lse);

// The Problem of a call (plan.h's problem_of, which holds the rules) from its tensors. q, k, v: 4-D (varlen:
// (1, total, heads, head_dim) views), checked; variants checked. cache: a KV-cache call, whose k is the cache:
// the plan is made for a full cache (a sequence's keys are known on the device only, and the kernels split what
// is there), with the variants kernel, which reads the cache's lengths.
Problem problem_of(Pass pass, const Tensor& q, const Tensor& k, const Tensor& v, bool causal, bool deterministic,
                   const Varlen* varlen, const Variants& variants, const KVCache* cache = nullptr);

// Parses and checks plan_override (errors name it).
PlanOverride override_of(const std::string& plan_override);

// The plan of `problem` on q's device with this build. find: find_fwd_launcher or find_bwd_launcher. Raises
// before any launch when the plan's kernel needs more shared memory per block than the GPU offers (the plan op,
// which makes plans without this check, reports the need as the plan's smem).
template <typename Find>
Plan plan_call(const Problem& problem, const Tensor& q, int num_splits, const PlanOverride& override, Find find) {
    const bool is_bf16 = q.scalar_type() == ScalarType::BFloat16;
    const bool noncausal_built = find(KernelKey{is_bf16, kernel_head_dim(problem.head_dim), false}) != nullptr;
    const Target target = target_of(q.get_device_index(), noncausal_built);
    const Plan plan = make_plan(problem, target, num_splits, override);
    FLASH_CHECK(smem_fits(plan, target), smem_shortfall(problem, plan, target));
    return plan;
}

// The launcher of the plan's kernel, or an error naming the kernel the build lacks.
FwdLauncher require_fwd_launcher(const Tensor& q, const Plan& plan);
BwdLauncher require_bwd_launcher(const Tensor& q, const Plan& plan);

// Everything both passes read: inputs, output, LSE, sizes, the scale, the plan's kernel family and, for
// varlen, the sequence bounds. q, out and lse are the packed views (pack_gqa).
void set_fwd_params(FwdParams& params, const View4& q, const View4& k, const View4& v, const View4& out,
                    const LseView& lse, double softmax_scale, const Varlen* varlen, const Plan& plan);

// The variants' fields of params (set after set_fwd_params, whose sizes and scale they read): the window with its
// unbounded sides made finite, softcap's scales, ALiBi's slopes and dropout's threshold and state.
void set_variant_params(FwdParams& params, const Variants& variants, bool causal);

// The LSE of (batch, seqlen_q, nheads, d) inputs is (batch, nheads, seqlen_q); of varlen ones (nheads, total_q).
std::vector<int64_t> lse_shape(const Tensor& q, const Varlen* varlen);

// A new contiguous (batch, seqlen, heads, head_dim) operand; varlen's is (seqlen, heads, head_dim), allocated so
// rather than squeezed from 4-D, which would make it a view under autograd.
Tensor empty_operand(int64_t batch, int64_t seqlen, int64_t heads, int64_t head_dim, ScalarType dtype, int device,
                     bool varlen);
// Shaped as the 4-D `t` (varlen: the (1, total, heads, head_dim) view), with its dtype and device.
inline Tensor empty_operand_like(const Tensor& t, bool varlen) {
    return empty_operand(t.size(0), t.size(1), t.size(2), t.size(3), t.scalar_type(), t.get_device_index(), varlen);
}

// (batch, 1, nheads, d) -> (batch, group, nheads / group, d): row stride = the head stride, head stride = group *
// the head stride, so rows are the query heads that share a key/value head and outputs land in place.
View4 pack_gqa(const View4& t, int64_t group);
// (batch, nheads, 1) contiguous is the same memory as (batch, nheads / group, group).
LseView pack_gqa_lse(const LseView& lse, int64_t group);

}  // namespace flash
