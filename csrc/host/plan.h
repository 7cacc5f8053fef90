// Launch plans: the host's every choice for one pass of one call (kernel family, tile, key splits, GQA
// packing and walks, key blocks per CTA, short-query and short-key tiles), made by pure functions of the
// problem's sizes, the GPU and the build. No torch and no CUDA calls here: torch.ops.flash_attn2.plan
// returns the same plan for given sizes, so tests check the heuristics on the CPU and can assert that a
// forced path is the one a call takes. The launchers obey the plan; they choose nothing themselves.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "launch/kernel_key.h"

namespace flash {

// One pass of one call, in the units of the public API (before GQA packing). Varlen: batch is the number of
// sequences and the lengths are the maxima.
struct Problem {
    Pass pass;
    int64_t batch;
    int64_t seqlen_q;
    int64_t seqlen_k;
    int64_t nheads;
    int64_t nheads_k;
    int64_t head_dim;  // a multiple of 8, at most 256
    bool causal;         // a masked kernel: causal, or a sliding window bounded on either side
    bool deterministic;  // backward only
    bool varlen;
    bool left_window = false;  // the window has a left edge: a key block may be seen by no query
    bool positional = false;   // ALiBi, dropout or a window (not plain causal): query heads keep their own positions (no GQA packing)
    bool head_positions = false;  // ALiBi or dropout, which follow each query head's own position: never GQA packing
    bool dropout = false;      // the forward cannot split keys (the mask follows absolute key positions)
    bool variants = false;     // a bounded window (other than causal's), softcap, ALiBi, dropout or a KV cache: the
                               // variants kernel
    bool paged = false;        // the keys are in a paged KV cache (block_table)
};

// The GPU and what the build holds for it.
struct Target {
    int cc_major;  // compute capability
    int cc_minor;
    int num_sms;
    bool wgmma_fwd_built;  // the build has the Hopper forward kernels (sm_90a, not a tile-tuning build)
    bool wgmma_bwd_built;  // likewise the Hopper backward kernels
    bool wgmma_disabled;   // FLASH_ATTN2_DISABLE_WGMMA=1 at the first call of the process
    bool noncausal_built;  // the build has this dtype and head dim's non-causal kernel (for the one-row rule)
};

// Test and benchmark choices that replace the heuristics' (the op argument plan_override). -1: no override.
struct PlanOverride {
    int wgmma = -1;          // kernel=wgmma (1) or kernel=mma_sync (0)
    int gqa_walk = -1;       // gqa_walk=0|1
    int key_blocks = -1;     // key_blocks=n, n >= 1
    int short_keys = -1;     // short_keys=0|1
    int short_queries = -1;  // short_queries=0|1
};

struct Plan {
    Pass pass;
    bool wgmma;           // the Hopper (warpgroup-MMA) kernels, else mma.sync
    int kernel_head_dim;  // the compiled head dim that runs
    bool causal;          // the mask that runs: causal with one dense query row sees every key, and runs unmasked;
                          // the variants kernel is masked
    bool variants;        // the variants kernel (window, softcap, ALiBi, dropout), else a plain one
    int64_t gqa_pack;     // > 1: the query heads of a key/value head run as that many query rows of one head
    int block_m;          // query rows per block (per step, backward)
    int block_n;          // keys per block
    int num_splits;       // forward: key splits (1: none)
    bool short_key_tile;    // forward: FwdSm90ShortKeysTileConfig
    bool short_query_tile;  // backward: the Hopper 16-row query tile
    int heads_per_cta;      // backward: query heads one CTA walks (> 1: a whole GQA group, dK/dV summed in registers)
    int key_blocks_per_cta;  // backward: consecutive key blocks one CTA walks
    bool dkv_fp32_slices;    // backward: GQA without a walk, one fp32 dK/dV slice per query head, summed afterwards
};

// Largest num_splits a call may force (run_fwd_combine merges at most 128 partials).
constexpr int kMaxForcedSplits = 128;
// Largest key_blocks a plan_override may force.
constexpr int kMaxForcedKeyBlocks = 128;

// Parses plan_override ("key=value" pairs separated by ';', keys kernel, gqa_walk, key_blocks, short_keys,
// short_queries). Returns an error message naming plan_override, or "" when `text` is well formed.
std::string parse_plan_override(std::string_view text, PlanOverride& out);

// The plan of `problem` on `target`. num_splits: the forward's op argument (0: the heuristic decides;
// checked by the caller to lie in [0, kMaxForcedSplits]).
Plan make_plan(const Problem& problem, const Target& target, int num_splits, const PlanOverride& override);

// "pass=fwd;kernel=wgmma;block_m=128;...": every field, as the plan op returns it.
std::string to_string(const Plan& plan);

}  // namespace flash
