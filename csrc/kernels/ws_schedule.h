// What the warp-specialized Hopper kernels (the forward's flash_fwd_sm90_ws_kernel.h and the backward's
// flash_bwd_sm90_ws_kernel.h) share: their persistent schedule, the stage and phase of a buffer ring, and named
// barriers among a subset of a CTA's warps.
#pragma once

#include <cstdint>

namespace flash {

__forceinline__ __device__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__forceinline__ __device__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Stage and mbarrier phase of the i-th use of a ring of kStages buffers.
template <int kStages>
struct RingSlot {
    int stage;
    uint32_t phase;
    __forceinline__ __device__ explicit RingSlot(int i) : stage(i % kStages), phase(uint32_t(i / kStages) & 1u) {}
};

// The persistent kernels' schedule: CTA c runs the units c, c + gridDim.x, ... in order. A tile is one block along
// the dimension the kernel walks per (sequence, head): a query block in the forward, a key block in the backward.
// A unit is one tile, or with kPaired (a causal mask) the pair of blocks j and blocks - 1 - j, whose work under the
// mask sums to about the same for every j: with equal units a fixed walk keeps the CTAs equally busy, and needs no
// counter shared between CTAs. The units of one (sequence, head) are adjacent, so the CTAs working at any one time
// share most of what they read through L2.
template <int kBlock, bool kPaired>
struct WsSchedule {
    struct Coord {  // of one tile
        int block;
        int batch;
        int head;
    };
    int blocks;  // tiles per (sequence, head)
    int units_per_head;
    int units;

    __host__ __device__ WsSchedule(int seqlen, int batch, int num_heads)
        : blocks((seqlen + kBlock - 1) / kBlock),
          units_per_head(kPaired ? (blocks + 1) / 2 : blocks),
          units(units_per_head * batch * num_heads) {}

    // 1 or 2: the middle block of an odd count is a unit of its own.
    __device__ int tiles_in(int unit) const {
        const int j = unit % units_per_head;
        return kPaired && 2 * j + 1 != blocks ? 2 : 1;
    }
    // The part-th tile of unit, part < tiles_in(unit): of a pair, block blocks - 1 - j first.
    __device__ Coord tile(int unit, int part, int batch) const {
        const int j = unit % units_per_head;
        const int sequence_head = unit / units_per_head;
        return {kPaired && part == 0 ? blocks - 1 - j : j, sequence_head % batch, sequence_head / batch};
    }
};

}  // namespace flash
