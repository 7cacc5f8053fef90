// Deterministic mode of the Hopper backward kernels that have one (the warp-specialized and the wide): the key blocks
// that see a query block add their dQ into its rows of dq_accum one at a time, in an order fixed by the blocks'
// positions, so that the fp32 sums, and with them dq, are the same in every run. One flag per (sequence, query head,
// query block), zeroed per call (BwdParams::dq_semaphore_ptr), holds the number of additions done: a key block waits
// until it equals its turn, adds, and once the addition has landed sets it to turn + 1.
//
// No key block may wait for one that cannot run until it finishes: each kernel's order says why its waits end.
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

}  // namespace flash
