// torch.ops.flash_attn2.plan: the plan a call of these sizes gets, for tests and benchmarks. It describes the call
// with the same problem_of as the ops (plan.h), so a forced path it reports is the one a call takes.
#include <cuda_runtime.h>

#include <climits>

#include "generated/ops.h"
#include "host/checks.h"
#include "host/device_info.h"
#include "host/plan.h"
#include "launch/kernel_registry.h"

namespace flash {
namespace {

// The Target of the current device and this build; a.max_smem > 0 replaces the device's shared memory per block
// (a test's smaller budget on a larger GPU).
Target current_target(const PlanArgs& a, Pass pass) {
    FLASH_CHECK_ARG(a.num_sms < 0, "num_sms needs arch");
    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess) {
        cudaGetLastError();  // clear it, so that no later CUDA call reports it
        device_count = 0;
    }
    FLASH_CHECK(device_count > 0, "plan: no CUDA device; pass arch and num_sms to plan for one");
    const KernelKey noncausal{a.is_bf16, kernel_head_dim(a.head_dim), false};
    const bool noncausal_built = pass == Pass::kFwd ? find_fwd_launcher(noncausal) != nullptr
                                                    : find_bwd_launcher(noncausal) != nullptr;
    Target target = target_of(torch::stable::accelerator::getCurrentDeviceIndex(), noncausal_built);
    if (a.max_smem > 0) {
        // The call's budget replaces the device's per block (above it too); an SM holds no more than that GPU's.
        target.max_smem = 0;
        limit_smem(target, static_cast<int>(a.max_smem));
    }
    return target;
}

// A named GPU (arch: 10 * major + minor), with a build that holds every kernel family; max_smem -1 takes the
// arch's documented shared memory per block.
Target named_target(const PlanArgs& a) {
    FLASH_CHECK_ARG(a.num_sms > 0 && a.num_sms <= INT_MAX, "num_sms must be positive when arch is given, got ",
                    num(a.num_sms));
    FLASH_CHECK_ARG(a.arch <= INT_MAX, "arch must be 10 * major + minor (e.g. 80, 90, 120), got ", num(a.arch));
    Target target{};
    target.cc_major = static_cast<int>(a.arch / 10);
    target.cc_minor = static_cast<int>(a.arch % 10);
    target.num_sms = static_cast<int>(a.num_sms);
    target.max_smem = a.max_smem > 0 ? static_cast<int>(a.max_smem)
                                     : documented_max_smem(target.cc_major, target.cc_minor);
    FLASH_CHECK_ARG(target.max_smem > 0, "max_smem: arch ", num(a.arch),
                    " has no documented shared memory per block here (80, 86, 87, 89, 90, 100, 103, 120, 121 do); "
                    "pass max_smem, in bytes");
    target.smem_per_sm = target.max_smem + kSmemReservedPerBlock;
    target.fwd_built = FamilySet::all();
    target.bwd_built = FamilySet::all();
    target.disabled = FamilySet{};
    target.noncausal_built = true;
    return target;
}

}  // namespace

std::string plan_op(const PlanArgs& a) {
    FLASH_CHECK_ARG(a.pass_name == "fwd" || a.pass_name == "bwd", "pass_name must be 'fwd' or 'bwd', got '",
                    a.pass_name, "'");
    FLASH_CHECK_ARG(a.batch >= 0 && a.seqlen_q >= 0 && a.seqlen_k >= 0, "batch, seqlen_q and seqlen_k must be >= 0");
    FLASH_CHECK_ARG(a.nheads_k > 0 && a.nheads > 0 && a.nheads % a.nheads_k == 0, "nheads (", num(a.nheads),
                    ") must be a positive multiple of nheads_k (", num(a.nheads_k), ")");
    FLASH_CHECK_ARG(a.head_dim > 0 && a.head_dim <= 256 && a.head_dim % 8 == 0,
                    "head_dim must be a multiple of 8 in [8, 256], got ", num(a.head_dim));
    FLASH_CHECK_ARG(a.head_dim_v == -1 || (a.head_dim_v > 0 && a.head_dim_v <= a.head_dim && a.head_dim_v % 8 == 0),
                    "head_dim_v must be -1 (head_dim) or a multiple of 8 in [8, head_dim = ", num(a.head_dim),
                    "], got ", num(a.head_dim_v));
    check_num_splits(a.num_splits);
    PlanOverride override;
    const std::string error = parse_plan_override(a.plan_override, override);
    FLASH_CHECK_ARG(error.empty(), error);
    FLASH_CHECK_ARG(a.window_left >= -1 && a.window_right >= -1, "window_left and window_right must be >= -1");
    FLASH_CHECK_ARG(!a.kvcache || a.pass_name == "fwd", "kvcache: a KV cache has a forward pass only");
    FLASH_CHECK_ARG(!a.paged || a.kvcache, "paged: a paged cache is a KV cache (kvcache=True)");
    FLASH_CHECK_ARG(a.max_smem == -1 || (a.max_smem > 0 && a.max_smem <= INT_MAX),
                    "max_smem must be the shared memory per block in bytes (> 0), or -1 for the GPU's own, got ",
                    num(a.max_smem));

    const Pass pass = a.pass_name == "fwd" ? Pass::kFwd : Pass::kBwd;
    const ProblemSizes sizes{a.batch,
                             a.seqlen_q,
                             a.seqlen_k,
                             a.nheads,
                             a.nheads_k,
                             a.head_dim,
                             a.head_dim_v > 0 ? a.head_dim_v : a.head_dim};
    VariantFlags flags;
    flags.window_left = a.window_left;
    flags.window_right = a.window_right;
    flags.softcap = a.softcap;
    flags.alibi = a.alibi;
    flags.dropout = a.dropout;
    flags.kvcache = a.kvcache;
    flags.paged = a.paged;
    const Problem problem = problem_of(pass, sizes, a.causal, a.deterministic, a.varlen, flags);
    const Target target = a.arch < 0 ? current_target(a, pass) : named_target(a);
    return to_string(make_plan(problem, target, static_cast<int>(a.num_splits), override));
}

}  // namespace flash
