// Launch plans: the host's every choice for one pass of one call (kernel family, tile, key splits, GQA
// packing and walks, key blocks per CTA, short-query and short-key tiles), made by pure functions of the
// problem's sizes, the GPU and the build. No torch and no CUDA calls here: torch.ops.flash_attn2.plan
// returns the same plan for given sizes, so tests check the heuristics on the CPU and can assert that a
// forced path is the one a call takes. The launchers obey the plan; they choose nothing themselves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "launch/kernel_key.h"

namespace flash {

// One pass of one call, in the units of the public API (before GQA packing). Varlen: batch is the number of
// sequences and the lengths are the maxima. Made by problem_of, for the ops and the plan op alike.
struct Problem {
    Pass pass;
    int64_t batch;
    int64_t seqlen_q;
    int64_t seqlen_k;
    int64_t nheads;
    int64_t nheads_k;
    int64_t head_dim;  // a multiple of 8, at most 256
    int64_t head_dim_v;  // V's: head_dim, or a narrower multiple of 8 (a call that the host pads unless the plan
                         // runs it on a narrow-V kernel, Plan::narrow_v)
    bool causal;         // a masked kernel: causal, or a sliding window bounded on either side
    bool deterministic;  // backward only
    bool varlen;
    bool left_window = false;  // the window has a left edge: a key block may be seen by no query
    bool positional =
        false;  // ALiBi, dropout or a window (not plain causal): query heads keep their own positions (no GQA packing)
    bool head_positions = false;  // ALiBi or dropout, which follow each query head's own position: never GQA packing
    bool dropout = false;  // the forward cannot split keys (the mask follows absolute key positions)
    bool variants = false;  // a bounded window (other than causal's), softcap, ALiBi, dropout or a KV cache: the
                            // variants kernel
    PlainMod plain_mod = PlainMod::kNone;  // softcap or dropout when it is the call's one variant, which the plain
                                           // forward kernels take in a form of their own
    bool paged = false;  // the keys are in a paged KV cache (block_table)
};

// A call's sizes, as problem_of takes them (Problem's first fields).
struct ProblemSizes {
    int64_t batch;
    int64_t seqlen_q;
    int64_t seqlen_k;  // with a KV cache: the keys a sequence's cache holds (its capacity)
    int64_t nheads;
    int64_t nheads_k;
    int64_t head_dim;
    int64_t head_dim_v = 0;  // V's where narrower than head_dim; 0: head_dim
};

// The attention variants of a call as the plans see them: flags and the window, no tensors (flash-attn 2.x
// semantics; -1: an unbounded window side).
struct VariantFlags {
    int64_t window_left = -1;
    int64_t window_right = -1;
    double softcap = 0.0;
    bool alibi = false;  // ALiBi slopes given
    bool dropout = false;  // dropout_p > 0
    bool kvcache = false;  // the keys are a KV cache (fwd_kvcache, varlen_fwd_paged): forward only
    bool paged = false;  // that cache is paged (block_table)
};

// The Problem of one pass: the one place that turns a call's flags into the plans' (masked kernel, variants
// kernel, positions that rule out GQA packing). The ops reach it through host_params.h's tensor overload, the
// plan op directly.
Problem problem_of(Pass pass, const ProblemSizes& sizes, bool causal, bool deterministic, bool varlen,
                   const VariantFlags& variants);

// A set of kernel families: bit f for family f.
struct FamilySet {
    uint8_t bits = 0;

    constexpr bool has(KernelFamily family) const { return (bits >> unsigned(family)) & 1u; }
    constexpr FamilySet with(KernelFamily family) const {
        return {static_cast<uint8_t>(bits | (1u << unsigned(family)))};
    }
    static constexpr FamilySet all() { return {static_cast<uint8_t>((1u << kNumKernelFamilies) - 1)}; }
};

// The GPU and what the build holds for it.
struct Target {
    int cc_major;  // compute capability
    int cc_minor;
    int num_sms;
    int max_smem;  // bytes of dynamic shared memory one block may opt in to
                   // (cudaDevAttrMaxSharedMemoryPerBlockOptin); <= 0: unknown
    int smem_per_sm;  // bytes of shared memory an SM holds for all its blocks
                      // (cudaDevAttrMaxSharedMemoryPerMultiprocessor); <= 0: unknown
    FamilySet fwd_built;  // the families whose forward kernels the build holds (wgmma: sm_90a code, and not a
                          // tile-tuning build)
    FamilySet bwd_built;  // likewise the backward kernels
    FamilySet disabled;  // families the process turned off: wgmma under FLASH_ATTN2_DISABLE_WGMMA=1
    bool noncausal_built;  // the build has this dtype and head dim's non-causal kernel (for the one-row rule)

    FamilySet built(Pass pass) const { return pass == Pass::kFwd ? fwd_built : bwd_built; }
};

// Test and benchmark choices that replace the heuristics' (the op argument plan_override). -1: no override.
struct PlanOverride {
    int family = -1;  // kernel=wgmma|mma_sync: a KernelFamily's value, taken where that family can run
    int gqa_walk = -1;  // gqa_walk=0|1
    int key_blocks = -1;  // key_blocks=n, n >= 1
    int short_keys = -1;  // short_keys=0|1
    int short_queries = -1;  // short_queries=0|1
    int max_smem = -1;  // max_smem=bytes: plan as if the GPU offered at most this much shared memory per block
    int warp_specialized = -1;  // ws=0|1
    int gqa_pack = -1;  // gqa_pack=0|1: 0 never packs GQA heads as query rows; 1 packs where the kernels can
    int stagger = -1;  // stagger=0|1: Plan::staggered, where it can run
};

struct Plan {
    Pass pass;
    KernelFamily family;  // the kernels that run (FwdParams::family)
    int kernel_head_dim;  // the compiled head dim that runs
    bool causal;  // the mask that runs: causal with one dense query row sees every key, and runs unmasked;
                  // the variants kernel is masked
    bool variants;  // the variants kernel (window, softcap, ALiBi, dropout), else a plain one
    int64_t gqa_pack;  // > 1: the query heads of a key/value head run as that many query rows of one head
    int block_m;  // query rows per block (per step, backward)
    int block_n;  // keys per block
    int num_splits;  // forward: key splits (1: none)
    bool short_key_tile;  // forward: the wgmma tile set's short-key tile, or the warp-specialized kernel's
    bool warp_specialized;  // forward: the wgmma tile set's warp-specialized TMA kernel (its ws_tile)
    bool short_query_tile;  // backward: the wgmma tile set's 16-row query tile
    int heads_per_cta;  // backward: query heads one CTA walks (> 1: a whole GQA group, dK/dV summed in registers)
    int key_blocks_per_cta;  // backward: consecutive key blocks one CTA walks
    bool dkv_fp32_slices;  // backward: GQA without a walk, one fp32 dK/dV slice per query head, summed afterwards
    bool staggered;  // backward: the wide Hopper kernel's key blocks start their walk over the query blocks each
                     // at its own offset (BwdParams::stagger)
    int smem_bytes;  // dynamic shared memory per block of the kernel that runs, as launched (tile_size.h)
    int tile_budget;  // the shared-memory budget of the tile set that runs (tile_size.h): mma.sync 163 KiB or
                      // 99 KiB, wgmma 227 KiB
    bool narrow_v;  // a V narrower than Q and K runs unpadded on the head dim's narrow-V kernel (narrow_v_shape,
                    // FwdParams::head_dim_v); otherwise the host pads such a V to Q's head dim
};

// Largest num_splits a call may force (run_fwd_combine merges at most 128 partials).
constexpr int kMaxForcedSplits = 128;
// Largest key_blocks a plan_override may force.
constexpr int kMaxForcedKeyBlocks = 128;
// Largest max_smem a plan_override may give (bytes), above any GPU's.
constexpr int kMaxForcedSmem = 1 << 20;

// The shared memory the driver keeps per resident block: an SM whose blocks may opt in to N bytes holds N + 1 KiB
// for all of them (A100: 163 and 164 KiB; sm_86, sm_89, sm_120: 99 and 100; Hopper: 227 and 228).
constexpr int kSmemReservedPerBlock = 1024;

// Limits `target` to a GPU whose blocks opt in to at most max_smem bytes (> 0), and whose SMs then hold at most
// max_smem + kSmemReservedPerBlock: the plans of a smaller GPU, on a larger one.
inline void limit_smem(Target& target, int max_smem) {
    target.max_smem = target.max_smem > 0 ? std::min(target.max_smem, max_smem) : max_smem;
    const int per_sm = max_smem + kSmemReservedPerBlock;
    target.smem_per_sm = target.smem_per_sm > 0 ? std::min(target.smem_per_sm, per_sm) : per_sm;
}

// Parses plan_override ("key=value" pairs separated by ';', keys kernel, gqa_walk, key_blocks, short_keys,
// short_queries, max_smem, ws, gqa_pack, stagger). Returns an error message naming plan_override, or "" when `text` is
// well formed.
std::string parse_plan_override(std::string_view text, PlanOverride& out);

// The plan of `problem` on `target`. num_splits: the forward's op argument (0: the heuristic decides;
// checked by the caller to lie in [0, kMaxForcedSplits]). The plan may need more shared memory than the target
// has (smem_shortfall says so); the plan op returns it all the same.
Plan make_plan(const Problem& problem, const Target& target, int num_splits, const PlanOverride& override);

// Whether the plan's kernel fits in the target's shared memory per block (or that is unknown).
inline bool smem_fits(const Plan& plan, const Target& target) {
    return target.max_smem <= 0 || plan.smem_bytes <= target.max_smem;
}
// "" when smem_fits, else why not: the case, what its kernel needs and what the GPU offers.
std::string smem_shortfall(const Problem& problem, const Plan& plan, const Target& target);

// "pass=fwd;kernel=wgmma;block_m=128;...;smem=...": every field, as the plan op returns it.
std::string to_string(const Plan& plan);

}  // namespace flash
