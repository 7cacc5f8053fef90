// torch.ops.flash_attn2.plan: the plan a call of these sizes gets, for tests and benchmarks.
#include <cuda_runtime.h>

#include "host/checks.h"
#include "host/device_info.h"
#include "launch/kernel_registry.h"
#include "host/ops.h"

namespace flash {

std::string plan_op(const std::string& pass_name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
                    int64_t nheads_k, int64_t head_dim, bool causal, bool deterministic, bool varlen,
                    int64_t num_splits, const std::string& plan_override, int64_t arch, int64_t num_sms, bool is_bf16,
                    int64_t window_left, int64_t window_right, bool alibi, bool dropout, double softcap,
                    bool kvcache, bool paged) {
    FLASH_CHECK_ARG(pass_name == "fwd" || pass_name == "bwd", "pass_name must be 'fwd' or 'bwd', got '", pass_name, "'");
    FLASH_CHECK_ARG(batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0, "batch, seqlen_q and seqlen_k must be >= 0");
    FLASH_CHECK_ARG(nheads_k > 0 && nheads > 0 && nheads % nheads_k == 0, "nheads (", num(nheads),
                      ") must be a positive multiple of nheads_k (", num(nheads_k), ")");
    FLASH_CHECK_ARG(head_dim > 0 && head_dim <= 256 && head_dim % 8 == 0,
                      "head_dim must be a multiple of 8 in [8, 256], got ", num(head_dim));
    check_num_splits(num_splits);
    PlanOverride override;
    const std::string error = parse_plan_override(plan_override, override);
    FLASH_CHECK_ARG(error.empty(), error);
    FLASH_CHECK_ARG(window_left >= -1 && window_right >= -1, "window_left and window_right must be >= -1");
    const bool masked = causal || window_left >= 0 || window_right >= 0;
    const bool positional = window_left >= 0 || (!causal && window_right > 0) || alibi || dropout;
    FLASH_CHECK_ARG(!kvcache || pass_name == "fwd", "kvcache: a KV cache has a forward pass only");
    FLASH_CHECK_ARG(!paged || kvcache, "paged: a paged cache is a KV cache (kvcache=True)");
    Problem problem{pass_name == "fwd" ? Pass::kFwd : Pass::kBwd, batch, seqlen_q, seqlen_k, nheads, nheads_k,
                    head_dim, masked, deterministic, varlen, window_left >= 0, positional, alibi || dropout,
                    dropout, positional || softcap > 0.0 || kvcache};
    problem.paged = paged;
    Target target{};
    if (arch < 0) {
        FLASH_CHECK_ARG(num_sms < 0, "num_sms needs arch");
        int device_count = 0;
        if (cudaGetDeviceCount(&device_count) != cudaSuccess) {
            cudaGetLastError();  // clear it, so that no later CUDA call reports it
            device_count = 0;
        }
        FLASH_CHECK(device_count > 0, "plan: no CUDA device; pass arch and num_sms to plan for one");
        const KernelKey noncausal{is_bf16, kernel_head_dim(head_dim), false};
        const bool noncausal_built = problem.pass == Pass::kFwd ? find_fwd_launcher(noncausal) != nullptr
                                                                : find_bwd_launcher(noncausal) != nullptr;
        target = target_of(torch::stable::accelerator::getCurrentDeviceIndex(), noncausal_built);
    } else {
        // A named GPU, with a build that holds every kernel family.
        FLASH_CHECK_ARG(num_sms > 0, "num_sms must be positive when arch is given, got ", num(num_sms));
        target = Target{static_cast<int>(arch / 10), static_cast<int>(arch % 10), static_cast<int>(num_sms),
                        true, true, false, true};
    }
    return to_string(make_plan(problem, target, static_cast<int>(num_splits), override));
}

}  // namespace flash
