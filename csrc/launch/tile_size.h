// The tile shape of every kernel, as one table keyed by (kernel family, pass, head dim, shared-memory budget),
// and the shared memory each tile's kernel takes. The launchers instantiate the table's tiles and
// static_assert that their kernels' shared memory is what the formulas here say; the plans (plan.cpp) read
// the block sizes for their heuristics and the shared memory to check that the GPU has it. Plain constexpr
// data and functions: this header is also compiled by the host compiler.
#pragma once

#include <initializer_list>

#include "generated/kernel_list.h"
#include "launch/kernel_key.h"

namespace flash {

// ---- Shared-memory budgets ----

// The opt-in dynamic shared memory per block that a tile set is tuned for, and that each of its kernels fits:
// sm_80's 163 KiB and the 99 KiB of sm_86, sm_89 and sm_120 for the mma.sync kernels (BwdKernelTraits sizes its
// Q stages by it), sm_90's 227 KiB for the wgmma kernels (FwdSm90KernelTraits sizes its K/V stages by it). The
// plans take the set of the largest budget the GPU offers (tile_set_for), and FwdParams::mma_sync_tile_set tells
// the mma.sync launchers which of their two sets that is.
constexpr int kSmem99KiB = 99 * 1024;
constexpr int kSmem163KiB = 163 * 1024;
constexpr int kSmem227KiB = 227 * 1024;

// Whether the launchers of `family` compile a tile set of `budget`.
constexpr bool compiles_smem_budget(KernelFamily family, int budget) {
    return family == KernelFamily::kWgmma ? budget == kSmem227KiB : budget == kSmem163KiB || budget == kSmem99KiB;
}
// The budget of the set every head dim of a family has, the largest, which runs on the GPUs the family is made
// for (sm_80 for mma.sync); a smaller budget has a set per head dim, or a wider head dim's runs there.
constexpr int base_smem_budget(KernelFamily family) {
    return family == KernelFamily::kWgmma ? kSmem227KiB : kSmem163KiB;
}

// The mma.sync launchers' set of a plan's tile_budget (FwdParams::mma_sync_tile_set).
constexpr MmaSyncTileSet mma_sync_tile_set(int budget) {
    return budget == kSmem99KiB ? MmaSyncTileSet::k99KiB : MmaSyncTileSet::k163KiB;
}

// ---- The tile table ----

// One kernel's tile.
struct TileShape {
    int block_m = 0;      // query rows per block (per step, backward); 0: no such tile
    int block_n = 0;      // keys per block
    int warps = 0;        // mma.sync forward: warps per CTA (the other kernels' warps follow from their kind)
    int ctas_per_sm = 1;  // wgmma forward: CTAs per SM the kernel is built for, in registers and shared memory;
                          // what the split-KV heuristic counts as resident
    bool v_in_regs = false;  // mma.sync backward: V is held in registers for the whole CTA, and its shared memory
                             // holds P and dS instead
    int stages = 0;  // the warp-specialized wgmma forward: K and V buffers each

    constexpr bool exists() const { return block_m > 0; }
};

// The tiles of one (family, pass, kernel head dim, budget).
struct TileSet {
    KernelFamily family = KernelFamily::kMmaSync;
    Pass pass = Pass::kFwd;
    int head_dim = 0;          // 0: no set (tile_set's answer for a key the table lacks)
    int smem_budget = 0;       // bytes per block the tiles are tuned for
    TileShape tile;            // the non-causal kernel's tile, and every kernel's where causal_tile repeats it
    TileShape causal_tile;     // the causal kernel's tile, and the variants kernel's unless variants_tile exists
    TileShape short_tile;  // wgmma only, where it pays: the forward's short-key tile (FwdParams::short_key_tiles),
                           // the backward's short-query tile (BwdParams::short_query_tiles)
    TileShape ws_tile = {};  // wgmma only: the warp-specialized TMA kernel's tile (FwdParams::warp_specialized),
                             // 64 query rows (forward) or keys (backward) per consumer warpgroup; none where that
                             // kernel is not built
    TileShape variants_tile = {};  // mma.sync forward only: the variants kernel's tile where it is not causal_tile
    TileShape ws_short_tile = {};  // wgmma forward only: the warp-specialized kernel's tile for causal calls over
                                   // short key sequences (FwdParams::short_key_tiles with warp_specialized)

    constexpr bool exists() const { return head_dim > 0; }
    constexpr TileShape tile_for(bool causal, bool variants = false) const {
        if (variants && variants_tile.exists()) { return variants_tile; }
        return causal || variants ? causal_tile : tile;
    }
};

// Whether a kernel whose key blocks have block_n keys can drop probabilities: dropout's draws (dropout.h) take each
// key block to start at a multiple of 32 keys. Head dim 256's warp-specialized forward on 80-key blocks cannot; its
// dropout calls take its 64-key short-key tile or another kernel (plan.cpp).
constexpr bool dropout_fits_key_blocks(int block_n) { return block_n % 32 == 0; }

// The warp-specialized wgmma forward's tile: block_m rows (64 per consumer warpgroup), block_n keys, two K and two V
// buffers; the backward's: block_m query rows a step, block_n keys (64 per consumer warpgroup), two Q/dO stages.
constexpr TileShape ws_tile(int block_m, int block_n) { return {block_m, block_n, 0, 1, false, 2}; }

// Query rows per step of the Hopper backward, and of its short-query tile.
constexpr int kBwdSm90BlockM = 64;
constexpr int kBwdSm90ShortBlockM = 16;

// mma.sync forward (block_m, block_n, warps), measured on an H200 with bench/tune_tiles.py for head dims 64,
// 128 and 256 (bench/results/h200/tune_fwd_nvidia-h200.md); 32 and 96 follow 64 and 128, and 160 to 224 follow
// 256. Up to head dim 128, 128-row tiles on four warps (32 query rows a warp) beat eight warps of 16 rows even
// with a few bytes of spills: each K/V fragment read from shared memory feeds twice the MMAs. That holds for
// causal head dim 128 too, 4-17% faster than 64 x 128 (docs/design-notes.md). Above 128 the accumulators leave no
// registers for 32 rows a warp, and 16 rows a warp win: 64 x 64 on four warps (two CTAs per SM on the H200, where
// it was measured), except at head dims 224 and 256, where those 84 and 96 KiB leave an A100's 164 KiB SM one CTA
// of four warps: the 163 KiB set (the A100's) takes FlashAttention-2's tile for them, 128 x 64 on eight warps (112
// and 128 KiB), one CTA of eight warps an SM: 1.12-1.28x (224) and 1.04-1.18x (256) faster than 64 x 64 under an
// A100's SM (design notes); the 99 KiB GPUs' SMs hold one CTA of either, and keep 64 x 64. Head dims 32 and 64 take
// 128-key blocks, as FlashAttention-2 does: half the softmax steps and barriers per key block, 5% (head dim 64)
// and 8.5% (32) faster than 64-key blocks over the anchor grid's lengths on an H200, although ptxas spills up to
// 100 bytes (design notes). Their variants kernel keeps 64-key blocks (variants_tile): with 128 its window,
// softcap, ALiBi and dropout code spilled 216 bytes.
//
// wgmma forward (block_m, block_n, -, CTAs per SM), warpgroups of 64 query rows. Head dims 32 and 64 fit two
// CTAs per SM in registers (at most 128 per thread), so one CTA's softmax and loads overlap the other's MMAs.
// 96 follows 128, and 160 and 224 follow 192 and 256. Head dim 128's short-key tile: over short key sequences
// a 128-row CTA alone on its SM sees only a few key blocks, so its Q load and output store are a large share
// of its time with nothing to overlap them; one-warpgroup CTAs of 64 rows and 64-key blocks fit two per SM,
// and one CTA's prologue and epilogue run under the other's MMAs. The plans pick it at the short seqlen_k where
// it pays, for the calls the warp-specialized kernel does not serve (which, persistent, overlaps a tile's prologue
// with the previous tile itself).
//
// The warp-specialized wgmma forward's tiles (ws_tile): 64 query rows per consumer warpgroup, two warpgroups of 240
// registers, or three of 160 at head dims 32 and 64 (192 rows), where the accumulators leave room; two stages of K
// and V in blocks of 64, 96 or 128 keys, wgmma N shapes of CuTe's default set. Head dim 256 takes 80-key blocks
// (kernels/wgmma_ops.h serves that N), FlashAttention-3's choice there: two stages of them and Q fill the 227 KiB
// (the output stages in Q's buffer). Head dim 128's 128-key blocks beat 192-key ones at 1k keys and trailed them
// by 1-4% from 2k (design notes). Head dim 64 on 128 x 128 (two warpgroups) was about as fast as 192 x 128 up to
// 1k keys, and 6-11% slower from 4k non-causal (design notes).
// Under a causal mask it has a short-key tile of its own (ws_short_tile): 128 x 128 on two consumer warpgroups,
// which computes fewer masked scores on the diagonal than the 192-row tile and splits a tile's few key blocks
// among fewer warpgroups of unequal work. Against the 192-row tile (H100, docs/design-notes.md): 47% faster at 512
// keys, 6-11% at 1k and 2k, 6-12% slower from 4k. Head dim 256's is its 64-key blocks, faster than 80 at 512 and
// 1k keys under a causal mask (the diagonal's masked scores, design notes). The other widths are untuned.
//
// mma.sync backward (block_m, block_n): dK and dV of block_n keys stay in registers, so wide heads take fewer
// keys per CTA. At head dim 64 the registers leave room for 128-row query blocks, which halve the steps (and
// barriers) per key block: 6% faster on an H200 (bench/results/h200/tune_bwd_nvidia-h200.md).
//
// The mma.sync sets for 99 KiB (sm_86, sm_89, sm_120), whose SMs hold about 100 KiB of shared memory for all
// their CTAs. Forward: the 163 KiB set's tiles (at most 96 KiB), except at head dim 128: there,
// FlashAttention-2's measured choice for these GPUs, 128 x 32 and causal 64 x 64 on four warps, 48 KiB each, so
// that two CTAs share an SM where the 163 KiB set's 64 KiB tile leaves one. Backward:
// the largest tile of 64 query rows whose K, V, P, dS and one Q/dO stage fit, two stages where they fit too
// (head dims 32, 64 and 96). Head dim 128 holds V in registers and puts P and dS in its shared memory, which
// makes room for two stages (99328 bytes), as FlashAttention-2 does on these GPUs. Head dim 192 takes 32-key
// blocks; head dim 256 too, with V in registers, which leaves 98816 bytes. Head dim 224 has no tile that fits:
// the dK and dV GEMMs of 32-key blocks (32 x 224) have no layout of 16 x 16 pieces that eight warps divide, and
// 64-key blocks take 112.5 KiB even with V in registers; it runs head dim 256's kernel, zero-padded
// (kernel_head_dim_for).
//
// wgmma backward (block_m, block_n): 64 query rows by 128 keys up to head dim 128 (the narrow kernel, each
// warpgroup owning 64 keys), 64 by 64 above (the wide kernel, P and dS through shared memory); head dim 128 has
// a 16-row short-query tile, where a 64-row tile would compute mostly padding. Head dim 64 takes 128 query rows,
// whose scores still fit the registers: a step's barriers, waits and loads serve twice the queries, 8% faster
// than 64 rows on an H200. Its variants kernel too, although ptxas spills 204 bytes there (none on 64 rows):
// 1-7% faster with a window, ALiBi or dropout, 2.5% slower with softcap (docs/design-notes.md). The
// warp-specialized backward (ws_tile, head dims 64 and 128) runs the narrow kernel's tile with that kernel's
// warpgroups as its consumers.
constexpr TileSet kTileSets[] = {
    // family, pass, head dim, budget, tile, causal tile, short tile, warp-specialized tile, variants tile
    {KernelFamily::kMmaSync, Pass::kFwd, 32, kSmem163KiB, {128, 128, 4}, {128, 128, 4}, {}, {}, {128, 64, 4}},
    {KernelFamily::kMmaSync, Pass::kFwd, 64, kSmem163KiB, {128, 128, 4}, {128, 128, 4}, {}, {}, {128, 64, 4}},
    {KernelFamily::kMmaSync, Pass::kFwd, 96, kSmem163KiB, {128, 64, 4}, {128, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 128, kSmem163KiB, {128, 64, 4}, {128, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 160, kSmem163KiB, {64, 64, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 192, kSmem163KiB, {64, 64, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 224, kSmem163KiB, {128, 64, 8}, {128, 64, 8}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 256, kSmem163KiB, {128, 64, 8}, {128, 64, 8}, {}},

    {KernelFamily::kMmaSync, Pass::kFwd, 32, kSmem99KiB, {128, 128, 4}, {128, 128, 4}, {}, {}, {128, 64, 4}},
    {KernelFamily::kMmaSync, Pass::kFwd, 64, kSmem99KiB, {128, 128, 4}, {128, 128, 4}, {}, {}, {128, 64, 4}},
    {KernelFamily::kMmaSync, Pass::kFwd, 96, kSmem99KiB, {128, 64, 4}, {128, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 128, kSmem99KiB, {128, 32, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 160, kSmem99KiB, {64, 64, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 192, kSmem99KiB, {64, 64, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 224, kSmem99KiB, {64, 64, 4}, {64, 64, 4}, {}},
    {KernelFamily::kMmaSync, Pass::kFwd, 256, kSmem99KiB, {64, 64, 4}, {64, 64, 4}, {}},

    {KernelFamily::kWgmma, Pass::kFwd, 32, kSmem227KiB, {128, 64, 0, 2}, {128, 64, 0, 2}, {}, ws_tile(192, 128)},
    {KernelFamily::kWgmma,
     Pass::kFwd,
     64,
     kSmem227KiB,
     {128, 64, 0, 2},
     {128, 64, 0, 2},
     {},
     ws_tile(192, 128),
     {},
     ws_tile(128, 128)},
    {KernelFamily::kWgmma, Pass::kFwd, 96, kSmem227KiB, {128, 128, 0, 1}, {128, 128, 0, 1}, {}, ws_tile(128, 128)},
    {KernelFamily::kWgmma,
     Pass::kFwd,
     128,
     kSmem227KiB,
     {128, 128, 0, 1},
     {128, 128, 0, 1},
     {64, 64, 0, 2},
     ws_tile(128, 128)},
    {KernelFamily::kWgmma, Pass::kFwd, 160, kSmem227KiB, {128, 64, 0, 1}, {128, 64, 0, 1}, {}, ws_tile(128, 96)},
    {KernelFamily::kWgmma, Pass::kFwd, 192, kSmem227KiB, {128, 64, 0, 1}, {128, 64, 0, 1}, {}, ws_tile(128, 96)},
    {KernelFamily::kWgmma, Pass::kFwd, 224, kSmem227KiB, {128, 64, 0, 1}, {128, 64, 0, 1}, {}, ws_tile(128, 64)},
    {KernelFamily::kWgmma,
     Pass::kFwd,
     256,
     kSmem227KiB,
     {128, 64, 0, 1},
     {128, 64, 0, 1},
     {},
     ws_tile(128, 80),
     {},
     ws_tile(128, 64)},

    {KernelFamily::kMmaSync, Pass::kBwd, 32, kSmem163KiB, {64, 128}, {64, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 64, kSmem163KiB, {128, 128}, {128, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 96, kSmem163KiB, {64, 128}, {64, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 128, kSmem163KiB, {64, 128}, {64, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 160, kSmem163KiB, {64, 64}, {64, 64}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 192, kSmem163KiB, {64, 64}, {64, 64}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 224, kSmem163KiB, {64, 64}, {64, 64}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 256, kSmem163KiB, {64, 64}, {64, 64}, {}},

    {KernelFamily::kMmaSync, Pass::kBwd, 32, kSmem99KiB, {64, 128}, {64, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 64, kSmem99KiB, {64, 128}, {64, 128}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 96, kSmem99KiB, {64, 64}, {64, 64}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 128, kSmem99KiB, {64, 64, 0, 1, true}, {64, 64, 0, 1, true}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 160, kSmem99KiB, {64, 64}, {64, 64}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 192, kSmem99KiB, {64, 32}, {64, 32}, {}},
    {KernelFamily::kMmaSync, Pass::kBwd, 256, kSmem99KiB, {64, 32, 0, 1, true}, {64, 32, 0, 1, true}, {}},

    {KernelFamily::kWgmma, Pass::kBwd, 32, kSmem227KiB, {kBwdSm90BlockM, 128}, {kBwdSm90BlockM, 128}, {}},
    {KernelFamily::kWgmma, Pass::kBwd, 64, kSmem227KiB, {128, 128}, {128, 128}, {}, ws_tile(128, 128)},
    {KernelFamily::kWgmma, Pass::kBwd, 96, kSmem227KiB, {kBwdSm90BlockM, 128}, {kBwdSm90BlockM, 128}, {}},
    {KernelFamily::kWgmma,
     Pass::kBwd,
     128,
     kSmem227KiB,
     {kBwdSm90BlockM, 128},
     {kBwdSm90BlockM, 128},
     {kBwdSm90ShortBlockM, 128},
     ws_tile(kBwdSm90BlockM, 128)},
    {KernelFamily::kWgmma, Pass::kBwd, 160, kSmem227KiB, {kBwdSm90BlockM, 64}, {kBwdSm90BlockM, 64}, {}},
    {KernelFamily::kWgmma, Pass::kBwd, 192, kSmem227KiB, {kBwdSm90BlockM, 64}, {kBwdSm90BlockM, 64}, {}},
    {KernelFamily::kWgmma, Pass::kBwd, 224, kSmem227KiB, {kBwdSm90BlockM, 64}, {kBwdSm90BlockM, 64}, {}},
    {KernelFamily::kWgmma, Pass::kBwd, 256, kSmem227KiB, {kBwdSm90BlockM, 64}, {kBwdSm90BlockM, 64}, {}},
};

// The set of exactly this key; !exists() when the table has none.
constexpr TileSet tile_set(KernelFamily family, Pass pass, int head_dim, int smem_budget) {
    for (const TileSet& set : kTileSets) {
        if (set.family == family && set.pass == pass && set.head_dim == head_dim && set.smem_budget == smem_budget) {
            return set;
        }
    }
    return {};
}

// The set the plans take on a GPU whose blocks may opt in to max_smem bytes: of (family, pass, head dim), the
// one of the largest budget at or below max_smem; on a GPU below every budget, the one of the smallest, whose
// kernels the plans then compare with the GPU's shared memory one by one (kernel_smem_bytes): small head dims
// may still fit; where max_smem is unknown (<= 0), the base set. !exists() when the table has no set of (family,
// pass, head dim).
constexpr TileSet tile_set_for(KernelFamily family, Pass pass, int head_dim, int max_smem) {
    if (max_smem <= 0) { return tile_set(family, pass, head_dim, base_smem_budget(family)); }
    TileSet best{};
    for (const TileSet& set : kTileSets) {
        if (set.family != family || set.pass != pass || set.head_dim != head_dim) { continue; }
        const bool fits = set.smem_budget <= max_smem;
        const bool best_fits = best.exists() && best.smem_budget <= max_smem;
        const bool better = !best.exists() || (fits && (!best_fits || set.smem_budget > best.smem_budget)) ||
                            (!fits && !best_fits && set.smem_budget < best.smem_budget);
        if (better) { best = set; }
    }
    return best;
}

// ---- Shared memory per block ----

// What each kernel's traits compute (kernels/kernel_traits_*.h), in bytes. The launchers static_assert that
// the two agree, so the plans' check of a GPU's shared memory (plan_call) and the kernels cannot drift.
// Shared-memory tiles are dense (their swizzles permute within them): a (rows, cols) tile is rows * cols
// elements of kElementBytes (fp16 and bf16 alike).
constexpr int kElementBytes = 2;

// mma.sync forward: Q, and one K and one V block (FwdKernelTraits), V of head_dim_v columns.
constexpr int fwd_mma_sync_smem_bytes(int head_dim, int head_dim_v, int block_m, int block_n) {
    return (block_m * head_dim + block_n * (head_dim + head_dim_v)) * kElementBytes;
}
constexpr int fwd_mma_sync_smem_bytes(int head_dim, int block_m, int block_n) {
    return fwd_mma_sync_smem_bytes(head_dim, head_dim, block_m, block_n);
}

// mma.sync backward (BwdKernelTraits): K, V, P and dS (P and dS inside V's buffer when V is held in
// registers), plus per query stage Q and dO and the fp32 LSE and D of their rows. Two stages (the next query
// block loads while this one computes) where they fit the budget, else one. V and dO are head_dim_v wide (a
// narrow-V kernel's; head_dim elsewhere).
constexpr int bwd_mma_sync_stage_bytes(int head_dim, int head_dim_v, int block_m) {
    return block_m * (head_dim + head_dim_v) * kElementBytes + 2 * block_m * 4;
}
constexpr int bwd_mma_sync_fixed_bytes(int head_dim, int head_dim_v, int block_m, int block_n, bool v_in_regs) {
    return (block_n * (head_dim + head_dim_v) + (v_in_regs ? 0 : 2 * block_m * block_n)) * kElementBytes;
}
constexpr int bwd_mma_sync_q_stages(int head_dim, int head_dim_v, int block_m, int block_n, bool v_in_regs,
                                    int smem_budget) {
    return bwd_mma_sync_fixed_bytes(head_dim, head_dim_v, block_m, block_n, v_in_regs) +
                       2 * bwd_mma_sync_stage_bytes(head_dim, head_dim_v, block_m) <=
                   smem_budget
               ? 2
               : 1;
}
constexpr int bwd_mma_sync_smem_bytes(int head_dim, int head_dim_v, int block_m, int block_n, bool v_in_regs,
                                      int smem_budget) {
    return bwd_mma_sync_fixed_bytes(head_dim, head_dim_v, block_m, block_n, v_in_regs) +
           bwd_mma_sync_q_stages(head_dim, head_dim_v, block_m, block_n, v_in_regs, smem_budget) *
               bwd_mma_sync_stage_bytes(head_dim, head_dim_v, block_m);
}
constexpr int bwd_mma_sync_smem_bytes(int head_dim, int block_m, int block_n, bool v_in_regs, int smem_budget) {
    return bwd_mma_sync_smem_bytes(head_dim, head_dim, block_m, block_n, v_in_regs, smem_budget);
}

// wgmma forward (FwdSm90KernelTraits): Q, and stages of (K, V) blocks. Three stages keep two key blocks in
// flight while one computes, which memory-bound calls (decoding) need; two where ctas_per_sm CTAs of three do
// not fit the budget of one SM.
constexpr int fwd_wgmma_kv_stages(int head_dim, int block_m, int block_n, int ctas_per_sm, int smem_budget) {
    return (block_m * head_dim + 6 * block_n * head_dim) * kElementBytes * ctas_per_sm <= smem_budget ? 3 : 2;
}
constexpr int fwd_wgmma_smem_bytes(int head_dim, int block_m, int block_n, int ctas_per_sm, int smem_budget) {
    return (block_m * head_dim +
            2 * fwd_wgmma_kv_stages(head_dim, block_m, block_n, ctas_per_sm, smem_budget) * block_n * head_dim) *
           kElementBytes;
}

// The warp-specialized wgmma forward (FwdSm90WsKernelTraits::SharedStorage): Q, stages of K and of V, and a
// buffer of its own for the output tile where that fits the 227 KiB (the next tile's Q can then load while this
// tile's output is stored), each a multiple of 1 KiB, then the mbarriers, which round the whole up by one more KiB.
// V and the output have head_dim_v columns, Q and K head_dim.
constexpr bool fwd_ws_separate_o(int head_dim, int head_dim_v, int block_m, int block_n, int stages) {
    return (block_m * (head_dim + head_dim_v) + stages * block_n * (head_dim + head_dim_v)) * kElementBytes + 1024 <=
           kSmem227KiB;
}
constexpr int fwd_ws_smem_bytes(int head_dim, int head_dim_v, int block_m, int block_n, int stages) {
    const int o_elems = fwd_ws_separate_o(head_dim, head_dim_v, block_m, block_n, stages) ? block_m * head_dim_v : 0;
    return (block_m * head_dim + stages * block_n * (head_dim + head_dim_v) + o_elems) * kElementBytes + 1024;
}
constexpr int fwd_ws_smem_bytes(int head_dim, int block_m, int block_n, int stages) {
    return fwd_ws_smem_bytes(head_dim, head_dim, block_m, block_n, stages);
}

// ---- Kernels whose V is narrower than Q and K ----

// A call whose V has fewer columns than Q and K (DeepSeek's MLA: 192 and 128) runs, where a kernel of its own
// exists, with V at that kernel's V head dim; every other such call runs at Q's head dim with V zero-padded to it
// (the host pads). The Q/K head dim's launchers hold such kernels for plain calls (no variant; plan.cpp): forward,
// the warp-specialized Hopper kernel on ws_tile and the mma.sync kernel on the head dim's own tiles, for calls whose
// keys the plan does not split; backward, Hopper's wide kernel and the mma.sync kernel on their own tiles. Against V
// padded to 192: a third less P V work, V traffic and V shared memory; on Hopper the output accumulator of head dim 128
// leaves the registers for 128-key blocks on two consumer warpgroups (two stages: 209 KiB with the output staged in Q's
// buffer).
struct NarrowVShape {
    int head_dim = 0;  // the kernel head dim of Q and K; 0: no such kernel
    int head_dim_v = 0;  // V's, which holds every V of at most that many columns
    TileShape ws_tile;  // the warp-specialized forward's tile

    constexpr bool exists() const { return head_dim > 0; }
};
constexpr NarrowVShape kNarrowVShapes[] = {{192, 128, ws_tile(128, 128)}};

// The narrow-V kernel of Q/K kernel head dim head_dim; !exists() where there is none.
constexpr NarrowVShape narrow_v_shape(int head_dim) {
    for (const NarrowVShape& shape : kNarrowVShapes) {
        if (shape.head_dim == head_dim) { return shape; }
    }
    return {};
}

// The Hopper backward's kernels (flash_bwd_sm90_kernel.h): head dims up to 128 run the narrow one, whose
// warpgroups own 64 keys each and which has a second K/V buffer to walk several key blocks per CTA; wider ones
// run the wide one, P and dS through shared memory and one K/V buffer.
constexpr bool bwd_sm90_narrow(int head_dim) { return head_dim <= 128; }
// Whether that kernel can walk several key blocks per CTA (BwdParams::key_blocks_per_cta).
constexpr bool bwd_sm90_walks_key_blocks(int head_dim) { return bwd_sm90_narrow(head_dim); }
// Whether it adds dQ through shared memory (BwdSm90KernelTraits::kDqThroughSmem): its tiles whose dQ GEMM has query
// rows (64 or 128), not the 16-row one, which computes dQ^T.
constexpr bool bwd_sm90_dq_through_smem(int head_dim, int block_m) {
    return bwd_sm90_narrow(head_dim) && block_m % 64 == 0;
}

// wgmma backward (BwdSm90BaseTraits::smem_bytes and its two kernels' traits): two stages of Q and dO with the
// fp32 LSE and D of their rows, one K and V buffer, and scratch: dS^T (narrow) or P and dS (wide). dO and V are
// head_dim_v wide (the wide kernel's narrow-V form). The narrow kernel rounds that to 1 KiB (where swizzle atoms
// repeat) and puts a tail past it that holds its second K/V buffer (a CTA that walks several key blocks) or its two
// fp32 dQ tiles (one that adds dQ through shared memory), so that a launch that needs neither (second_kv_buffer
// false) takes the smaller size.
constexpr int bwd_wgmma_smem_bytes(int head_dim, int head_dim_v, int block_m, int block_n, bool second_kv_buffer) {
    const bool narrow = bwd_sm90_narrow(head_dim);
    const int scratch_elems = narrow ? block_n * block_m : 2 * block_m * block_n;
    const int one_kv = (2 * block_m * (head_dim + head_dim_v) + block_n * (head_dim + head_dim_v) + scratch_elems) *
                           kElementBytes +
                       2 * 2 * block_m * 4;
    if (!narrow) { return one_kv; }
    const int one_kv_rounded = (one_kv + 1023) / 1024 * 1024;
    const int dq_tiles = bwd_sm90_dq_through_smem(head_dim, block_m) ? 2 * block_m * head_dim * 4 : 0;
    const int kv = 2 * block_n * head_dim * kElementBytes;
    const int tail = kv > dq_tiles ? kv : dq_tiles;
    return second_kv_buffer ? one_kv_rounded + tail : one_kv_rounded;
}
constexpr int bwd_wgmma_smem_bytes(int head_dim, int block_m, int block_n, bool second_kv_buffer) {
    return bwd_wgmma_smem_bytes(head_dim, head_dim, block_m, block_n, second_kv_buffer);
}

// The warp-specialized wgmma backward (BwdSm90WsKernelTraits::SharedStorage): two stages of Q and dO, K and V, two
// dS^T tiles and two fp32 dQ tiles, each a multiple of 1 KiB, then the LSE and D of both stages and ten mbarriers,
// the whole rounded up to 1 KiB (the storage's alignment).
constexpr int bwd_ws_smem_bytes(int head_dim, int block_m, int block_n) {
    const int tiles = (2 * 2 * block_m * head_dim + 2 * block_n * head_dim + 2 * block_n * block_m) * kElementBytes +
                      2 * block_m * head_dim * 4;
    return (tiles + 2 * 2 * block_m * 4 + 10 * 8 + 1023) / 1024 * 1024;
}

// The dynamic shared memory of a launch of `tile` from `set`. second_kv_buffer: a Hopper backward that walks
// several key blocks per CTA (key_blocks_per_cta > 1).
constexpr int kernel_smem_bytes(const TileSet& set, const TileShape& tile, bool second_kv_buffer) {
    const int d = set.head_dim;
    if (set.family == KernelFamily::kWgmma) {
        return set.pass == Pass::kFwd
                   ? fwd_wgmma_smem_bytes(d, tile.block_m, tile.block_n, tile.ctas_per_sm, set.smem_budget)
                   : bwd_wgmma_smem_bytes(d, tile.block_m, tile.block_n, second_kv_buffer);
    }
    return set.pass == Pass::kFwd
               ? fwd_mma_sync_smem_bytes(d, tile.block_m, tile.block_n)
               : bwd_mma_sync_smem_bytes(d, tile.block_m, tile.block_n, tile.v_in_regs, set.smem_budget);
}

// ---- What the table promises ----

// Every compiled head dim has a set of every (family, pass) at the family's base budget, and at each of its
// other budgets a set, or a wider head dim has one there (kernel_head_dim_for); the table holds no set of a
// budget the launchers do not compile. Short tiles exist in wgmma sets only (the mma.sync launchers have none).
constexpr bool tile_table_is_complete() {
    for (KernelFamily family : {KernelFamily::kMmaSync, KernelFamily::kWgmma}) {
        for (Pass pass : {Pass::kFwd, Pass::kBwd}) {
            for (int budget : {kSmem99KiB, kSmem163KiB, kSmem227KiB}) {
                if (!compiles_smem_budget(family, budget)) { continue; }
                bool wider_has_one = false;
                for (int i = kNumKernelHeadDims - 1; i >= 0; --i) {
                    const bool has_one = tile_set(family, pass, kKernelHeadDims[i], budget).exists();
                    if (!has_one && (budget == base_smem_budget(family) || !wider_has_one)) { return false; }
                    wider_has_one = wider_has_one || has_one;
                }
            }
        }
    }
    for (const TileSet& set : kTileSets) {
        if (!compiles_smem_budget(set.family, set.smem_budget)) { return false; }
        if (set.short_tile.exists() && set.family != KernelFamily::kWgmma) { return false; }
        // The forward's warp-specialized tile: 64 query rows per consumer warpgroup; the backward's: the narrow
        // kernel's tile (the consumers are its warpgroups).
        const TileShape& ws = set.ws_tile;
        const TileShape& wc = set.ws_short_tile;
        const bool ws_fwd_ok = set.pass == Pass::kFwd && ws.block_m % 64 == 0 && ws.stages >= 2;
        if (wc.exists() && !(set.family == KernelFamily::kWgmma && set.pass == Pass::kFwd && ws.exists() &&
                             wc.block_m % 64 == 0 && wc.stages >= 2)) {
            return false;
        }
        const bool ws_bwd_ok = set.pass == Pass::kBwd && bwd_sm90_dq_through_smem(set.head_dim, ws.block_m) &&
                               ws.block_m == set.tile.block_m && ws.block_n == set.tile.block_n &&
                               ws.block_n == set.causal_tile.block_n && ws.block_m == set.causal_tile.block_m;
        if (ws.exists() && !(set.family == KernelFamily::kWgmma && (ws_fwd_ok || ws_bwd_ok))) { return false; }
        if (set.variants_tile.exists() && !(set.family == KernelFamily::kMmaSync && set.pass == Pass::kFwd)) {
            return false;
        }
        if ((set.tile.v_in_regs || set.causal_tile.v_in_regs) &&
            !(set.family == KernelFamily::kMmaSync && set.pass == Pass::kBwd)) {
            return false;
        }
    }
    return true;
}
static_assert(tile_table_is_complete(), "each head dim of kernel_list.h needs its compiled tiles here, and only those");

// Whether a set's kernels fit a GPU that offers max_smem bytes per block (<= 0: unknown, taken to fit).
constexpr bool set_fits(const TileSet& set, int max_smem) { return max_smem <= 0 || set.smem_budget <= max_smem; }

// The compiled head dim whose kernel runs a call of kernel head dim `head_dim` (kernel_head_dim) on a GPU of
// max_smem: its own, unless tile_set_for finds it no set within max_smem and a wider head dim has one; that
// kernel then runs with the head dim zero-padded (head dim 224's backward on 99 KiB GPUs runs head dim 256's).
constexpr int kernel_head_dim_for(KernelFamily family, Pass pass, int head_dim, int max_smem) {
    if (set_fits(tile_set_for(family, pass, head_dim, max_smem), max_smem)) { return head_dim; }
    for (int d : kKernelHeadDims) {
        if (d > head_dim && set_fits(tile_set_for(family, pass, d, max_smem), max_smem)) { return d; }
    }
    return head_dim;
}

// Every tile of every set fits the set's budget: ctas_per_sm CTAs of it for the wgmma forward, whose budget is
// what an SM gives its blocks together; the Hopper backward with its second K/V buffer.
constexpr bool tile_sets_fit_their_budgets() {
    for (const TileSet& set : kTileSets) {
        for (const TileShape& tile : {set.tile, set.causal_tile, set.short_tile, set.variants_tile}) {
            if (tile.exists() && kernel_smem_bytes(set, tile, true) * tile.ctas_per_sm > set.smem_budget) {
                return false;
            }
        }
        const TileShape& ws = set.ws_tile;
        const int ws_bytes = set.pass == Pass::kFwd ? fwd_ws_smem_bytes(set.head_dim, ws.block_m, ws.block_n, ws.stages)
                                                    : bwd_ws_smem_bytes(set.head_dim, ws.block_m, ws.block_n);
        if (ws.exists() && ws_bytes > set.smem_budget) { return false; }
        const TileShape& wc = set.ws_short_tile;
        if (wc.exists() && fwd_ws_smem_bytes(set.head_dim, wc.block_m, wc.block_n, wc.stages) > set.smem_budget) {
            return false;
        }
    }
    return true;
}
static_assert(tile_sets_fit_their_budgets(), "a tile set's kernels fit its shared-memory budget");

constexpr bool narrow_v_shapes_are_sound() {
    for (const NarrowVShape& shape : kNarrowVShapes) {
        const TileShape& ws = shape.ws_tile;
        if (!(shape.head_dim_v < shape.head_dim &&
              tile_set(KernelFamily::kWgmma, Pass::kFwd, shape.head_dim, kSmem227KiB).ws_tile.exists() &&
              ws.block_m % 64 == 0 && ws.stages >= 2 && !bwd_sm90_narrow(shape.head_dim) &&
              fwd_ws_smem_bytes(shape.head_dim, shape.head_dim_v, ws.block_m, ws.block_n, ws.stages) <= kSmem227KiB)) {
            return false;
        }
    }
    return true;
}
static_assert(narrow_v_shapes_are_sound(),
              "a narrow-V kernel is a warp-specialized forward of a head dim that has one, within 227 KiB, and a "
              "head dim of the wide Hopper backward");

}  // namespace flash
