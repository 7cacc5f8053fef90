// Deterministic mode of the Hopper backward kernels that have one (the warp-specialized and the wide): the key blocks
// that see a query block add their dQ into its rows of dq_accum one at a time, in an order fixed by the blocks'
// positions, so that the fp32 sums, and with them dq, are the same in every run. One flag per (sequence, query head,
// query block), zeroed per call (BwdParams::dq_semaphore_ptr), holds the number of additions done: a key block waits
// until it equals its turn, adds, and once the addition has landed sets it to turn + 1.
//
// No key block may wait for one that cannot run until it finishes: each kernel's order says why its waits end.
//
// The warp-specialized kernel also writes dq_accum without a zeroing pass before it (BwdParams::dq_accum_stored):
// of the key blocks that see a query block, the first to add stores its dQ tile instead, and the others add
// theirs once that store has landed. In deterministic mode the first is the one of turn 0. Otherwise the flag,
// zeroed per call as well, counts the key blocks that have reached the query block in its low bits, and
// kDqStored marks the first one's store as landed. Either way a flag still 0 after the kernel means that no key
// block sees the query block, and the dQ conversion writes zeros there.
#pragma once

#include "kernels/global_ops.h"
#include "launch/flash_params.h"

namespace flash {

// Orders this thread's accesses of global memory through the generic proxy (the flags) with those through the async
// proxy (bulk reductions), both ways.
__forceinline__ __device__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// The flag of query block m_block of query head `head` of sequence batch_idx, for a kernel of kBlockM-row query
// blocks. The host sizes the flags for blocks of kBwdMinBlockM rows.
template <int kBlockM>
__forceinline__ __device__ int* dq_turn_flag(const BwdParams& params, int batch_idx, int head, int m_block) {
    static_assert(kBlockM % kBwdMinBlockM == 0, "the host sizes the flags by kBwdMinBlockM rows");
    const int m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
    return params.dq_semaphore_ptr + (index_t(batch_idx) * params.num_heads + head) * m_blocks + m_block;
}

// Spins until *flag == turn. The acquire orders what follows after the predecessor's addition, bulk reductions
// (async proxy) included.
__forceinline__ __device__ void wait_dq_turn(const int* flag, int turn) {
    while (load_acquire(flag) != turn) {}
    fence_proxy_async_global();
}

// Passes the turn on: the caller's additions are complete (a bulk reduction: waited for with bulk_wait; reductions
// by threads: each thread's __threadfence, then a barrier).
__forceinline__ __device__ void pass_dq_turn(int* flag, int turn) {
    fence_proxy_async_global();
    store_release(flag, turn + 1);
}

// Without deterministic mode: set in a query block's flag once its first key block's store has landed.
constexpr int kDqStored = 1 << 30;

// Counts this key block in; true for the first to reach the query block, which stores its tile.
__forceinline__ __device__ bool dq_arrive_first(int* flag) { return atomicAdd(flag, 1) == 0; }

// The first key block's store is complete (waited for with bulk_wait): the others may add.
__forceinline__ __device__ void mark_dq_stored(int* flag) {
    fence_proxy_async_global();
    or_release(flag, kDqStored);
}

// Spins until the first key block's store has landed. It never waits for a key block that is not running: the
// first took its place in the count just before storing.
__forceinline__ __device__ void wait_dq_stored(const int* flag) {
    while ((load_acquire(flag) & kDqStored) == 0) {}
    fence_proxy_async_global();
}

}  // namespace flash
