#include "host/plan.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "launch/tile_size.h"

namespace flash {
namespace {

// ---- Forward: split-KV ----

constexpr int kMaxAutoSplits = 64;  // the heuristic's cap
// The heuristic splits only seqlen_k >= kMinKeysToSplit, into splits of at least kMinKeysPerSplit keys. Below
// 1024 keys the kernel time a split saves is under the host time its partials and combine launch cost; at 1024
// causal keys and 1-4 heads, 4 splits take 23 us of GPU time to 12 (H200).
constexpr int kMinKeysToSplit = 1024;
constexpr int kMinKeysPerSplit = 256;

// Split-KV heuristic. The forward grid has one CTA per (query block, sequence, head), each streaming all of
// its keys; when that grid is smaller than the GPU, SMs idle (decode and short-query shapes). Splitting the
// keys num_splits ways multiplies the CTAs and divides each one's key blocks, at the price of an fp32 partial
// per split and a combine kernel. Model: `slots` CTAs (SMs x CTAs resident per SM) run at once and a CTA costs
// its number of key blocks, so num_splits = s takes ceil(ctas * s / slots) waves of ceil(n_blocks / s) blocks.
// No split once the grid fills 80% of the slots; otherwise the smallest s whose time is within 5% of the best,
// with at least kMinKeysPerSplit keys per split, s <= kMaxAutoSplits, and no split below kMinKeysToSplit keys.
// Causal query blocks differ in cost, which the model ignores; their splits share only the keys each block
// sees (FwdTile).
int choose_num_splits(int64_t ctas, int64_t seqlen_k, const TileShape& tile, int64_t slots) {
    if (ctas <= 0 || ctas * 5 >= slots * 4 || seqlen_k < kMinKeysToSplit) { return 1; }
    const int64_t n_blocks = (seqlen_k + tile.block_n - 1) / tile.block_n;
    const int64_t max_splits = std::min<int64_t>({kMaxAutoSplits, seqlen_k / kMinKeysPerSplit, n_blocks});
    auto time = [&](int64_t splits) {
        return (ctas * splits + slots - 1) / slots * ((n_blocks + splits - 1) / splits);
    };
    int64_t best_time = time(1);
    for (int64_t splits = 2; splits <= max_splits; ++splits) { best_time = std::min(best_time, time(splits)); }
    for (int64_t splits = 1; splits <= max_splits; ++splits) {
        if (time(splits) * 20 <= best_time * 21) { return static_cast<int>(splits); }
    }
    return 1;
}

// ---- Forward: the Hopper warp-specialized kernel ----

// seqlen_k at or below which a causal call whose warp-specialized tile has 192 rows and three consumer warpgroups
// (head dim 32; head dim 64 where its short-key tile is forced off) keeps the other Hopper kernel, since a 192-row
// block on the diagonal computes the most scores it drops. At head dim 64, causal (H100, bf16), the warp-specialized
// kernel was 26% slower at 512 keys, even at 1024 and 15% faster at 2048, 34% faster at 4096; non-causal it was faster
// at every length (H200), so non-causal calls take it at every length. The other head dims' tiles have 128 rows, and at
// head dims 128 and 256 it was faster at every length measured. (docs/design-notes.md, 'P's conversion and the output's
// staging'.)
constexpr int kFwdWsMinKeys192RowsCausal = 1024;

// seqlen_k at or below which a causal call on the warp-specialized kernel takes its short-key tile where the set has
// one. Head dim 64: 128 rows on two consumer warpgroups instead of 192 on three; on an H100 (bf16, causal, 16k
// tokens) it was 47% faster than the 192-row tile at 512 keys, 11% at 1k and 6% at 2k, and 6% slower at 4k, 12% at
// 8k and 16k (docs/design-notes.md, 'A short-key tile for the warp-specialized forward'). Head dim 256: 64-key blocks
// instead of 80, which on the same GPU were 6% and 2.5% faster at 512 and 1k keys, 2.6% slower at 2k and 3-7% from
// 4k (design notes, 'Head dim 256's warp-specialized forward on 80-key blocks').
constexpr int fwd_ws_short_keys_max_causal(int head_dim) { return head_dim <= 64 ? 2048 : 1024; }

// ---- Backward: the Hopper warp-specialized kernel ----

// Where the warp-specialized backward (head dims 64 and 128) beats the narrow kernel, which it replaces there. On the
// anchor grid (H100, bf16, 512-16k keys) it was 1.13x the narrow kernel's speed (geomean), faster everywhere except
// under a causal mask at 512 keys (0.96x at head dim 64, 0.90x at 128), where a tile's few steps do not cover its K/V
// load and dK/dV store, which the narrow kernel overlaps across the key blocks a CTA walks. So: causal calls from
// 1024 keys, and at least kBwdWsMinQueryBlocks query blocks per tile (short query sequences keep the key-block walk).
// A forced key-block walk (plan_override key_blocks) is the narrow kernel's, unless ws=1 is forced too.
constexpr int kBwdWsMinKeysCausal = 1024;
constexpr int kBwdWsMinQueryBlocks = 4;

// ---- Forward: the Hopper short-key tile ----

// seqlen_k at or below which the forward runs the wgmma set's short-key tile where one exists and the
// warp-specialized kernel does not run (varlen, short queries, packed GQA, the variants). Causal up to 1024, where
// a 128-row block on the diagonal computes up to twice the scores it keeps; non-causal only up to 512, where the
// overlap pays for reading each K/V block twice and rescaling twice as often. Against the persistent
// warp-specialized kernel (H200, head dim 128, bf16) it was 24% slower at 512 keys non-causal and 16-25% slower
// at 512 and 1024 keys causal.
constexpr int kFwdShortKeysMaxCausal = 1024;
constexpr int kFwdShortKeysMax = 512;

// ---- Backward ----

// seqlen_q at or below which the Hopper backward runs its 16-row query tile where the head dim has one: a
// 64-row tile would compute mostly padding.
constexpr int kBwdShortQueriesMax = 16;
constexpr int kMaxAutoKeyBlocks = 16;  // choose_key_blocks_per_cta's cap

// Key blocks per CTA of the Hopper backward of head dims <= 128. With at most two query-block steps per key
// block (short queries against long keys) a CTA's time goes mostly to loading K and V and storing dK and dV,
// one after the other, and the grid runs many waves of such CTAs. A CTA that walks j consecutive key blocks
// loads the next one's K and V while it computes and stores the current one. Model: `slots` CTAs run at once
// and a CTA costs j + 1 key-block times (its first load is not hidden); the smallest j of least time, up to
// kMaxAutoKeyBlocks, that still leaves two waves of CTAs. That cap came after one wave at j = 8 measured
// slower on bench_skinny's GQA decode row; a later A/B put most of that loss on the loop code instead, so the
// cap is unproven. Longer queries keep one key block per CTA: their steps hide the loads.
int choose_key_blocks_per_cta(int64_t n_blocks, int64_t ctas_per_key_block, int64_t steps_per_key_block,
                              int64_t slots) {
    if (steps_per_key_block > 2 || n_blocks <= 1) { return 1; }
    auto time = [&](int64_t j) { return ((n_blocks + j - 1) / j * ctas_per_key_block + slots - 1) / slots * (j + 1); };
    const int64_t max_j = std::min<int64_t>({kMaxAutoKeyBlocks, n_blocks, n_blocks * ctas_per_key_block / (2 * slots)});
    int64_t best = 1;
    for (int64_t j = 2; j <= max_j; ++j) {
        if (time(j) < time(best)) { best = j; }
    }
    return static_cast<int>(best);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether the forced value (-1: none) or else the default picks the choice.
bool choose(int forced, bool by_default) { return forced == -1 ? by_default : forced == 1; }

// The kernel families in the order the plans prefer them where several can run: the newest first.
constexpr KernelFamily kFamilyPreference[] = {KernelFamily::kWgmma, KernelFamily::kMmaSync};
static_assert(sizeof(kFamilyPreference) / sizeof(kFamilyPreference[0]) == kNumKernelFamilies);

// Whether `family` can run this pass of `p` on `t`: the GPU runs it, the build holds it, the process has not
// turned it off, one of its tile sets fits the GPU's shared memory (on a GPU, or under a max_smem override, below
// the wgmma set's 227 KiB, the mma.sync kernels run), and in deterministic mode it has a backward kernel whose key
// blocks add into dQ in a fixed order: the mma.sync one, or on Hopper the wide kernel (head dims 160 to 256) and
// the warp-specialized one (head dims 64 and 128, plain calls; not packing GQA heads, plan_kernels). Under a causal
// mask the latter's order has a key block wait for others of its (sequence, head), all of whose key-block pairs
// must then fit one round of its persistent grid, one per SM (BwdWsTile::dq_turn).
bool can_run(KernelFamily family, const Problem& p, const Target& t) {
    const int head_dim = kernel_head_dim_for(family, p.pass, kernel_head_dim(p.head_dim), t.max_smem);
    const TileSet set = tile_set_for(family, p.pass, head_dim, t.max_smem);
    const bool fits = set_fits(set, t.max_smem);
    bool orders_dq = true;
    if (family == KernelFamily::kWgmma && p.pass == Pass::kBwd && p.deterministic && fits) {
        const TileShape& ws = set.ws_tile;
        const bool ws_orders = ws.exists() && !p.variants &&
                               (!p.causal || ceil_div(ceil_div(p.seqlen_k, ws.block_n), 2) <= std::max(t.num_sms, 1));
        orders_dq = !bwd_sm90_narrow(head_dim) || ws_orders;
    }
    return family_runs_on(family, t.cc_major, t.cc_minor) && t.built(p.pass).has(family) && !t.disabled.has(family) &&
           fits && orders_dq;
}

// The forced family where it can run, else the first of kFamilyPreference that can; mma.sync when none can
// (no GPU before sm_80 gets this far: check_device).
KernelFamily choose_family(const Problem& p, const Target& t, const PlanOverride& o) {
    if (o.family >= 0 && can_run(static_cast<KernelFamily>(o.family), p, t)) {
        return static_cast<KernelFamily>(o.family);
    }
    for (KernelFamily family : kFamilyPreference) {
        if (can_run(family, p, t)) { return family; }
    }
    return KernelFamily::kMmaSync;
}

// CTAs of the mma.sync forward's `tile` (of `set`) that one of the target's SMs holds, by shared memory and by
// registers; 0 where the SM's shared memory is unknown. The kernels' launch bounds let ptxas take up to 255 registers
// a thread (the wide head dims' tiles do), so a CTA is counted at 256 a thread of its 64K: eight warps hold an SM's
// registers alone.
int mma_sync_fwd_ctas_per_sm(const Target& t, const TileSet& set, const TileShape& tile) {
    if (t.smem_per_sm <= 0) { return 0; }
    constexpr int kRegistersPerSm = 65536;
    constexpr int kRegistersPerThread = 256;
    const int by_smem = t.smem_per_sm / (kernel_smem_bytes(set, tile, false) + kSmemReservedPerBlock);
    return tile.warps > 0 ? std::min(by_smem, kRegistersPerSm / (tile.warps * 32 * kRegistersPerThread)) : by_smem;
}

// The forward's tile set: the one of the GPU's budget per block (tile_set_for), except that an SM holding two CTAs
// of the mma.sync 99 KiB set's tile for the call and only one of the 163 KiB set's runs the former. That is head
// dims 224 and 256 on Hopper's 228 KiB SMs: two CTAs of 64 x 64 on four warps (84 and 96 KiB each), against one of
// 128 x 64 on eight (by registers), the tile that an A100's 164 KiB SM, which holds one of either, runs best
// (tile_size.h). Measured at 256 on an H100 with the mma.sync kernels forced: the 64 x 64 tile 1.04x the other's
// speed (geomean over the anchor grid's head-dim-256 cells), 1.14x at 512 keys causal; under the A100's 164 KiB
// (FLASH_ATTN2_MAX_SMEM) the other way round, 0.89x (docs/design-notes.md, 'Head dim 256 on an A100's SM').
TileSet fwd_tile_set(const Plan& plan, const Target& t) {
    const TileSet set = tile_set_for(plan.family, Pass::kFwd, plan.kernel_head_dim, t.max_smem);
    if (plan.family != KernelFamily::kMmaSync || set.smem_budget != kSmem163KiB) { return set; }
    const TileSet small = tile_set(KernelFamily::kMmaSync, Pass::kFwd, plan.kernel_head_dim, kSmem99KiB);
    if (!small.exists()) { return set; }
    const int ctas = mma_sync_fwd_ctas_per_sm(t, set, set.tile_for(plan.causal, plan.variants));
    const int small_ctas = mma_sync_fwd_ctas_per_sm(t, small, small.tile_for(plan.causal, plan.variants));
    return ctas == 1 && small_ctas >= 2 ? small : set;
}

void plan_fwd(const Problem& p, const Target& t, int forced_splits, const PlanOverride& o, Plan& plan) {
    const int64_t seqlen_q = p.seqlen_q * plan.gqa_pack;  // the kernel's sizes, after packing
    const int64_t nheads = p.nheads / plan.gqa_pack;
    const TileSet set = fwd_tile_set(plan, t);
    plan.tile_budget = set.smem_budget;
    // Decoding from a paged cache also takes the short-key tile. Each key row finds its page (FwdTile::copy_paged),
    // which costs far more instructions per key than a dense load; with the queries in one 64-row warpgroup, the
    // 128-row tile's second warpgroup only loads, and its CTA's load and compute phases take turns. Two 64-row
    // CTAs per SM overlap one's loads with the other's compute: paged decoding 1.24-1.41x the dense cache's time
    // on the 128-row tile, 1.02-1.09x on this one (H200). Dense caches keep the 128-row tile, within a few
    // percent either way.
    const bool paged_decode = p.paged && seqlen_q <= 64;
    // The warp-specialized kernel (TMA loads by a producer warp, consumer warpgroups taking turns on the tensor
    // cores) serves the plain kernels' dense calls without GQA packing; its descriptors address (seqlen, head_dim,
    // heads, batch) tensors, not varlen's packed rows. Its consumer warpgroups all run every key block, so it also
    // needs queries for the last of them: shorter query sequences (decoding) keep the other kernel, whose
    // warpgroups without rows skip their MMAs. It is persistent, so a tile's loads run under the previous tile's
    // work, which is what the other kernel's short-key tile (two CTAs per SM) is for: where it runs, that tile does
    // not. Under a causal mask over short key sequences it runs its own short-key tile where the set has one, which
    // short_keys=1 forces and short_keys=0 keeps off; elsewhere short_keys=1 means the other kernel's short-key tile.
    // Its dropout form needs key blocks at multiples of 32 keys (dropout_fits_key_blocks): where the kernel's tile
    // has other blocks (head dim 256's 80 keys), dropout calls run its short-key tile (64 keys) at every length and
    // mask, unless short_keys=0 keeps that off, which leaves them to the other kernel.
    const bool dropout_short = p.dropout && !dropout_fits_key_blocks(set.ws_tile.block_n);
    const bool has_ws_short = set.ws_short_tile.exists() && (plan.causal || dropout_short);
    const bool ws_short = has_ws_short &&
                          choose(o.short_keys,
                                 dropout_short || p.seqlen_k <= fwd_ws_short_keys_max_causal(plan.kernel_head_dim));
    const TileShape ws = ws_short ? set.ws_short_tile : set.ws_tile;
    const bool ws_serves = !plan.variants && !p.varlen && plan.gqa_pack == 1 && ws.exists() &&
                           seqlen_q > ws.block_m - 64 && (o.short_keys != 1 || has_ws_short) &&
                           (!p.dropout || dropout_fits_key_blocks(ws.block_n));
    const bool ws_pays = ws.block_m < 192 || !plan.causal || p.seqlen_k > kFwdWsMinKeys192RowsCausal;
    // Key splits for a tile: split-KV runs on dense batches only, and without dropout. The launch grid's x is
    // query blocks (at least 64 rows each) times splits.
    auto splits_for = [&](const TileShape& tile) {
        if (p.varlen || p.dropout) { return 1; }
        const int64_t splits = forced_splits > 0
                                   ? forced_splits
                                   : choose_num_splits(ceil_div(seqlen_q, tile.block_m) * p.batch * nheads, p.seqlen_k,
                                                       tile, int64_t(std::max(t.num_sms, 1)) * tile.ctas_per_sm);
        const int64_t max_for_grid = std::max<int64_t>(1, INT32_MAX / ceil_div(std::max<int64_t>(seqlen_q, 1), 64));
        return static_cast<int>(std::min<int64_t>(splits, max_for_grid));
    };
    // It computes whole key ranges: a call that its tile would split keeps the other kernel.
    plan.warp_specialized = ws_serves && choose(o.warp_specialized, ws_pays) && splits_for(ws) == 1;
    // A V narrower than Q and K: the head dim's narrow-V kernel where one holds it (narrow_v_shape), for calls with
    // no variant (it has no softcap or dropout form) whose keys its tile does not split; Hopper's only on the
    // warp-specialized kernel's regular tile, the mma.sync one on the set's tile.
    const NarrowVShape narrow = narrow_v_shape(plan.kernel_head_dim);
    const bool narrow_v_call = p.head_dim_v < p.head_dim && narrow.exists() && p.head_dim_v <= narrow.head_dim_v &&
                               !plan.variants && p.plain_mod == PlainMod::kNone;
    plan.short_key_tile = set.short_tile.exists() &&
                          choose(o.short_keys, paged_decode || (!plan.warp_specialized &&
                                                                p.seqlen_k <= (plan.causal ? kFwdShortKeysMaxCausal
                                                                                           : kFwdShortKeysMax)));
    if (plan.warp_specialized) {
        plan.narrow_v = narrow_v_call && !ws_short && splits_for(narrow.ws_tile) == 1;
        const TileShape run = plan.narrow_v ? narrow.ws_tile : ws;
        plan.short_key_tile = ws_short;
        plan.block_m = run.block_m;
        plan.block_n = run.block_n;
        plan.smem_bytes = fwd_ws_smem_bytes(plan.kernel_head_dim,
                                            plan.narrow_v ? narrow.head_dim_v : plan.kernel_head_dim, run.block_m,
                                            run.block_n, run.stages);
        plan.num_splits = 1;
        return;
    }
    const TileShape tile = plan.short_key_tile ? set.short_tile : set.tile_for(plan.causal, plan.variants);
    plan.block_m = tile.block_m;
    plan.block_n = tile.block_n;
    plan.num_splits = splits_for(tile);
    plan.narrow_v = narrow_v_call && plan.family == KernelFamily::kMmaSync && plan.num_splits == 1;
    plan.smem_bytes = plan.narrow_v
                          ? fwd_mma_sync_smem_bytes(plan.kernel_head_dim, narrow.head_dim_v, tile.block_m, tile.block_n)
                          : kernel_smem_bytes(set, tile, false);
}

void plan_bwd(const Problem& p, const Target& t, const PlanOverride& o, Plan& plan) {
    const int64_t seqlen_q = p.seqlen_q * plan.gqa_pack;  // the kernel's sizes, after packing
    const int64_t nheads = p.nheads / plan.gqa_pack;
    const int hd = plan.kernel_head_dim;
    const bool wgmma = plan.family == KernelFamily::kWgmma;
    const TileSet set = tile_set_for(plan.family, Pass::kBwd, hd, t.max_smem);
    plan.tile_budget = set.smem_budget;
    // Not in deterministic mode, which at this head dim on Hopper runs the warp-specialized kernel (can_run).
    plan.short_query_tile = set.short_tile.exists() && !(wgmma && p.deterministic) &&
                            choose(o.short_queries, seqlen_q <= kBwdShortQueriesMax);
    const TileShape tile = plan.short_query_tile ? set.short_tile : set.tile_for(plan.causal);
    plan.block_m = tile.block_m;
    plan.block_n = tile.block_n;
    // GQA/MQA: on Hopper one CTA walks every query head of its key/value head, summing dK and dV in registers,
    // as long as that grid (group times smaller) still gives every SM a CTA. Otherwise one dK/dV slice per query
    // head, summed afterwards from fp32 slices so that each gradient is rounded once.
    const bool grouped = nheads != p.nheads_k;
    const bool walk = grouped && wgmma &&
                      choose(o.gqa_walk, ceil_div(p.seqlen_k, plan.block_n) * p.batch * p.nheads_k >= t.num_sms);
    plan.heads_per_cta = walk ? static_cast<int>(nheads / p.nheads_k) : 1;
    plan.dkv_fp32_slices = grouped && !walk;
    plan.key_blocks_per_cta = 1;
    // Under a window's left edge a key block may have no steps, and then starts none of its successor's loads
    // (BwdSm90Block): one key block per CTA.
    if (wgmma && bwd_sm90_walks_key_blocks(hd) && !p.left_window) {
        plan.key_blocks_per_cta = o.key_blocks > 0
                                      ? o.key_blocks
                                      : choose_key_blocks_per_cta(ceil_div(p.seqlen_k, plan.block_n),
                                                                  p.batch * (nheads / plan.heads_per_cta),
                                                                  plan.heads_per_cta * ceil_div(seqlen_q, plan.block_m),
                                                                  std::max(t.num_sms, 1));
    }
    // The warp-specialized kernel (a producer warpgroup loading by TMA and adding dQ, the narrow kernel's
    // warpgroups as consumers, persistent) serves the plain kernels' calls on the regular tile, one key block per
    // tile. Variable-length batches only where forced (ws=1): not yet measured against the narrow kernel.
    const bool ws_serves = wgmma && set.ws_tile.exists() && !plan.variants && plan.gqa_pack == 1 &&
                           !plan.short_query_tile;
    const bool ws_pays = !p.varlen && seqlen_q >= int64_t(kBwdWsMinQueryBlocks) * set.ws_tile.block_m &&
                         (!plan.causal || p.seqlen_k >= kBwdWsMinKeysCausal);
    // Deterministic mode runs it wherever the plan is Hopper's and the narrow kernel's would run (can_run).
    const bool ws_orders_dq = wgmma && p.deterministic && bwd_sm90_narrow(hd);
    plan.warp_specialized = ws_orders_dq || (ws_serves && choose(o.warp_specialized, ws_pays && o.key_blocks < 1));
    if (plan.warp_specialized) {
        plan.key_blocks_per_cta = 1;
        plan.smem_bytes = bwd_ws_smem_bytes(hd, set.ws_tile.block_m, set.ws_tile.block_n);
        return;
    }
    // The wide kernel without a mask: every key block walks every query block, and with a stagger key block n
    // starts at query block n mod (query blocks), so that at any moment a head's key blocks add into different
    // query blocks' dQ rows. In deterministic mode those additions take turns in the order the staggered blocks
    // reach a query block (BwdSm90Block::dq_turn), in which a key block waits for the next one: a head's key
    // blocks must all be resident at once, one CTA per SM at least.
    const bool wide_unmasked = wgmma && !bwd_sm90_narrow(hd) && !plan.causal && !plan.variants;
    const bool stagger_fits = !p.deterministic || ceil_div(p.seqlen_k, plan.block_n) <= std::max(t.num_sms, 1);
    plan.staggered = wide_unmasked && stagger_fits && choose(o.stagger, p.deterministic);
    // A V narrower than Q and K: the narrow-V form of the kernel that runs (Hopper's wide one, or the mma.sync one on
    // the set's tile) where the head dim has one (narrow_v_shape), for calls with no variant.
    const NarrowVShape narrow = narrow_v_shape(hd);
    plan.narrow_v = p.head_dim_v < p.head_dim && narrow.exists() && p.head_dim_v <= narrow.head_dim_v && !plan.variants;
    if (plan.narrow_v) {
        plan.smem_bytes = wgmma ? bwd_wgmma_smem_bytes(hd, narrow.head_dim_v, tile.block_m, tile.block_n, false)
                                : bwd_mma_sync_smem_bytes(hd, narrow.head_dim_v, tile.block_m, tile.block_n,
                                                          tile.v_in_regs, set.smem_budget);
        return;
    }
    // A CTA that walks several key blocks launches with its second K/V buffer, and so does one that adds dQ through
    // shared memory in its place.
    plan.smem_bytes = kernel_smem_bytes(
        set, tile, plan.key_blocks_per_cta > 1 || (wgmma && bwd_sm90_dq_through_smem(hd, tile.block_m)));
}

// The plan's mask, GQA packing and tiles, once its family and whether it runs the variants kernel are chosen.
void plan_kernels(const Problem& p, const Target& t, int num_splits, const PlanOverride& o, Plan& plan) {
    // With a single query row the bottom-right aligned causal mask lets it see every key: run the non-causal
    // kernel instead when the build has it (which also allows packing GQA heads).
    plan.causal = plan.variants || (p.causal && !(!p.varlen && p.seqlen_q == 1 && t.noncausal_built));
    // A dense seqlen_q == 1 problem with GQA/MQA (and no causal mask) runs with the `group` query heads that
    // share a key/value head as `group` query rows of one head, so each CTA reads its key/value head once for
    // the whole group, and the backward gets dK/dV per key/value head directly.
    // Not with ALiBi or dropout, which read each query head's own position. The forward's variants kernel packs
    // too (decoding from a KV cache, windows, softcap): it reads the one query's window as a range of keys
    // (FwdTile::fold_window_into_keys). Not in a deterministic backward on Hopper, where the warp-specialized kernel
    // (can_run) does not pack.
    const bool packable = !plan.causal && !p.positional;
    const bool variants_packable = p.pass == Pass::kFwd && plan.variants && !p.head_positions;
    const bool pack = o.gqa_pack != 0 && !p.varlen && (packable || variants_packable) && p.seqlen_q == 1 &&
                      p.nheads_k > 0 && p.nheads > p.nheads_k &&
                      !(p.pass == Pass::kBwd && p.deterministic && plan.family == KernelFamily::kWgmma);
    plan.gqa_pack = pack ? p.nheads / p.nheads_k : 1;
    plan.kernel_head_dim = kernel_head_dim_for(plan.family, p.pass, kernel_head_dim(p.head_dim), t.max_smem);
    plan.num_splits = 1;
    plan.heads_per_cta = 1;
    plan.key_blocks_per_cta = 1;
    plan.staggered = false;
    plan.narrow_v = false;
    if (p.pass == Pass::kFwd) {
        plan_fwd(p, t, num_splits, o, plan);
    } else {
        plan_bwd(p, t, o, plan);
    }
}

// Bytes as KiB, to a tenth: "99", "144.5".
std::string kib(int64_t bytes) {
    std::string text = std::to_string(bytes / 1024);
    const int64_t tenths = bytes % 1024 * 10 / 1024;
    return tenths > 0 ? text + "." + std::to_string(tenths) : text;
}

// "name=value" with value an integer in [lo, hi]; false when malformed.
bool parse_int(std::string_view text, int lo, int hi, int& out) {
    if (text.empty() || text.size() > 9) { return false; }
    int value = 0;
    for (char c : text) {
        if (c < '0' || c > '9') { return false; }
        value = value * 10 + (c - '0');
    }
    if (value < lo || value > hi) { return false; }
    out = value;
    return true;
}

}  // namespace

Problem problem_of(Pass pass, const ProblemSizes& sizes, bool causal, bool deterministic, bool varlen,
                   const VariantFlags& v) {
    Problem problem{};
    problem.pass = pass;
    problem.batch = sizes.batch;
    problem.seqlen_q = sizes.seqlen_q;
    problem.seqlen_k = sizes.seqlen_k;
    problem.nheads = sizes.nheads;
    problem.nheads_k = sizes.nheads_k;
    problem.head_dim = sizes.head_dim;
    problem.head_dim_v = sizes.head_dim_v > 0 ? sizes.head_dim_v : sizes.head_dim;
    // A masked kernel: causal, or a window bounded on either side.
    problem.causal = causal || v.window_left >= 0 || v.window_right >= 0;
    problem.deterministic = deterministic;
    problem.varlen = varlen;
    problem.left_window = v.window_left >= 0;
    // More than causal: a left edge, or a right edge past the diagonal (causal fixes the right side at 0, so
    // (-1, 0) and causal with any right side are plain causal).
    const bool window = v.window_left >= 0 || (!causal && v.window_right > 0);
    problem.positional = window || v.alibi || v.dropout;
    problem.head_positions = v.alibi || v.dropout;
    problem.dropout = v.dropout;
    // A KV cache's lengths live on the device, which only the variants kernels read (BlockInfo::of_cache).
    problem.variants = problem.positional || v.softcap > 0.0 || v.kvcache;
    const bool softcap_only = v.softcap > 0.0 && !problem.positional && !v.kvcache;
    const bool dropout_only = v.dropout && !window && !v.alibi && v.softcap == 0.0 && !v.kvcache;
    problem.plain_mod = softcap_only ? PlainMod::kSoftcap : dropout_only ? PlainMod::kDropout : PlainMod::kNone;
    problem.paged = v.paged;
    return problem;
}

std::string parse_plan_override(std::string_view text, PlanOverride& out) {
    out = PlanOverride{};
    size_t start = 0;
    while (start < text.size()) {
        size_t end = text.find(';', start);
        if (end == std::string_view::npos) { end = text.size(); }
        const std::string_view item = text.substr(start, end - start);
        start = end + 1;
        if (item.empty()) { continue; }
        const size_t eq = item.find('=');
        const std::string where = "plan_override: '" + std::string(item) + "'";
        if (eq == std::string_view::npos) { return where + " is not key=value"; }
        const std::string_view key = item.substr(0, eq);
        const std::string_view value = item.substr(eq + 1);
        if (key == "kernel") {
            out.family = -1;
            for (int f = 0; f < kNumKernelFamilies; ++f) {
                if (value == family_name(static_cast<KernelFamily>(f))) { out.family = f; }
            }
            if (out.family < 0) { return where + ": kernel must be wgmma or mma_sync"; }
        } else if (key == "gqa_walk" || key == "short_keys" || key == "short_queries") {
            int& field = key == "gqa_walk" ? out.gqa_walk : key == "short_keys" ? out.short_keys : out.short_queries;
            if (!parse_int(value, 0, 1, field)) { return where + ": " + std::string(key) + " must be 0 or 1"; }
        } else if (key == "ws") {
            if (!parse_int(value, 0, 1, out.warp_specialized)) { return where + ": ws must be 0 or 1"; }
        } else if (key == "gqa_pack") {
            if (!parse_int(value, 0, 1, out.gqa_pack)) { return where + ": gqa_pack must be 0 or 1"; }
        } else if (key == "stagger") {
            if (!parse_int(value, 0, 1, out.stagger)) { return where + ": stagger must be 0 or 1"; }
        } else if (key == "max_smem") {
            if (!parse_int(value, 1, kMaxForcedSmem, out.max_smem)) {
                return where + ": max_smem must be bytes of shared memory per block, an integer in [1, " +
                       std::to_string(kMaxForcedSmem) + "]";
            }
        } else if (key == "key_blocks") {
            if (!parse_int(value, 1, kMaxForcedKeyBlocks, out.key_blocks)) {
                return where + ": key_blocks must be an integer in [1, " + std::to_string(kMaxForcedKeyBlocks) + "]";
            }
        } else {
            return where +
                   ": unknown key (kernel, gqa_walk, key_blocks, short_keys, short_queries, max_smem, ws, "
                   "gqa_pack, stagger)";
        }
    }
    return "";
}

Plan make_plan(const Problem& p, const Target& target, int num_splits, const PlanOverride& o) {
    // max_smem=bytes plans for a GPU with at most that much shared memory per block, so that a larger GPU runs
    // the tile sets of a smaller one (the 99 KiB set on an sm_80 or sm_90 GPU, in tests).
    Target t = target;
    if (o.max_smem > 0) { limit_smem(t, o.max_smem); }
    Plan plan{};
    plan.pass = p.pass;
    plan.family = choose_family(p, t, o);
    // Calls with variants run the variants kernel, which is masked (an unbounded window for non-causal ones),
    // except the forward of a call whose one variant is softcap or dropout: the plain kernels have a form for each
    // (PlainMod), which keeps their step structure. On Hopper only the warp-specialized kernel has them, so a call
    // that it does not serve plans again with the variants kernel.
    plan.variants = p.variants && !(p.pass == Pass::kFwd && p.plain_mod != PlainMod::kNone);
    plan_kernels(p, t, num_splits, o, plan);
    if (plan.family == KernelFamily::kWgmma && p.variants && !plan.variants && !plan.warp_specialized) {
        plan.variants = true;
        plan_kernels(p, t, num_splits, o, plan);
    }
    return plan;
}

std::string smem_shortfall(const Problem& problem, const Plan& plan, const Target& target) {
    if (smem_fits(plan, target)) { return ""; }
    const TileSet set = tile_set_for(plan.family, plan.pass, plan.kernel_head_dim, target.max_smem);
    std::string head_dim = "head dim " + std::to_string(problem.head_dim);
    if (problem.head_dim != plan.kernel_head_dim) {
        head_dim += " (kernel head dim " + std::to_string(plan.kernel_head_dim) + ")";
    }
    return head_dim + (plan.pass == Pass::kFwd ? " forward" : " backward") + " (kernel=" + family_name(plan.family) +
           ") needs " + kib(plan.smem_bytes) + " KiB of shared memory per block; this GPU offers " +
           kib(target.max_smem) + " KiB. Its smallest tiles are made for GPUs with " + kib(set.smem_budget) +
           " KiB, and flash_attn_cuda has none for less";
}

std::string to_string(const Plan& plan) {
    auto field = [](const char* name, int64_t value) { return std::string(name) + "=" + std::to_string(value) + ";"; };
    std::string text = std::string("pass=") + (plan.pass == Pass::kFwd ? "fwd" : "bwd") + ";";
    text += std::string("kernel=") + family_name(plan.family) + ";";
    text += field("kernel_head_dim", plan.kernel_head_dim) + field("block_m", plan.block_m) +
            field("block_n", plan.block_n) + field("causal", plan.causal) + field("variants", plan.variants) +
            field("gqa_pack", plan.gqa_pack) + field("num_splits", plan.num_splits) +
            field("short_key_tile", plan.short_key_tile) + field("warp_specialized", plan.warp_specialized) +
            field("short_query_tile", plan.short_query_tile) + field("heads_per_cta", plan.heads_per_cta) +
            field("key_blocks_per_cta", plan.key_blocks_per_cta) + field("dkv_fp32_slices", plan.dkv_fp32_slices) +
            field("staggered", plan.staggered) + field("smem", plan.smem_bytes) +
            field("tile_budget", plan.tile_budget) + field("narrow_v", plan.narrow_v);
    text.pop_back();
    return text;
}

}  // namespace flash
