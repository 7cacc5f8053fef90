// Global-memory accesses that CuTe's copy atoms do not cover: a one-value zero-filling cp.async, fp32
// reductions that do not wait for a reply (plain or predicated), bulk copies and reductions, acquire/release
// flags, and a predicated store of an accumulator fragment.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>

namespace flash {

using namespace cute;

// Copies one fp32 value global -> shared with cp.async, or writes 0 when !valid.
__forceinline__ __device__ void cp_async_f32_zfill(float* smem_dst, const float* gmem_src, bool valid) {
    const uint32_t dst = cute::cast_smem_ptr_to_uint(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(gmem_src), "r"(valid ? 4 : 0));
}

// Adds four adjacent fp32 values (16 B aligned) into global memory without waiting for a reply: one vector
// reduction on sm_90, four scalar ones before it.
__forceinline__ __device__ void red_add_quad(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
    atomicAdd(dst + 2, c);
    atomicAdd(dst + 3, d);
#endif
}

// red_add_quad when `add`, sm_90 only. The predicate is inside the asm: with an `if` around a reduction instead,
// ptxas spilled 4 bytes in the hdim 128 causal Hopper backward.
__forceinline__ __device__ void red_add_quad_if(bool add, float* dst, float a, float b, float c, float d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %5, 0;\n"
        "@p red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
        "}\n" ::"l"(dst),
        "f"(a), "f"(b), "f"(c), "f"(d), "r"(int(add))
        : "memory");
}

// Adds one fp32 value into global memory when `add` (predicated inside the asm, as red_add_quad_if).
__forceinline__ __device__ void red_add_if(bool add, float* dst, float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %2, 0;\n"
        "@p red.global.add.f32 [%0], %1;\n"
        "}\n" ::"l"(dst),
        "f"(a), "r"(int(add))
        : "memory");
#else
    if (add) { atomicAdd(dst, a); }
#endif
}

// sm_90 bulk reductions: the TMA unit adds `bytes` (a multiple of 16) of fp32 values from shared memory into
// global memory (both 16 B aligned), value by value, as the calling thread's bulk operation. The issuing thread
// groups its operations with bulk_commit; bulk_wait_read<N> returns once at most N of its groups still read
// shared memory, and bulk_wait<N> once at most N are still incomplete. Shared-memory writes by other threads
// reach the operation only through fence.proxy.async and a barrier before it is issued.
__forceinline__ __device__ void bulk_reduce_add_f32(float* dst, const float* smem_src, int bytes) {
    const uint32_t src = cute::cast_smem_ptr_to_uint(smem_src);
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}

// A bulk copy of `bytes` (a multiple of 16) from shared to global memory (both 16 B aligned), grouped and waited
// for as bulk_reduce_add_f32 is.
__forceinline__ __device__ void bulk_store(void* dst, const void* smem_src, int bytes) {
    const uint32_t src = cute::cast_smem_ptr_to_uint(smem_src);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

__forceinline__ __device__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int N>
__forceinline__ __device__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

template <int N>
__forceinline__ __device__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// A flag read and write that order the accesses around them across the GPU (deterministic dQ turns).
__forceinline__ __device__ int load_acquire(const int* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__forceinline__ __device__ void store_release(int* ptr, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Sets bits of a flag with release order, without a reply.
__forceinline__ __device__ void or_release(int* ptr, int bits) {
    asm volatile("red.release.gpu.global.or.b32 [%0], %1;" ::"l"(ptr), "r"(bits) : "memory");
}

// Writes an accumulator fragment (converted to Element, times scale) to global memory, skipping
// positions at or past (max_row, max_col). coords are the fragment's (row, col) positions in the tile;
// the two values of each MMA column pair are adjacent and go out as one store.
template <typename Element, class AccTensor, class CoordTensor, class GmemTensor>
__forceinline__ __device__ void store_acc(const AccTensor& acc, const CoordTensor& coords, GmemTensor& gmem,
                                          int max_row, int max_col, float scale) {
    static_assert(decltype(size(acc))::value % 2 == 0);
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
        const int row = get<0>(coords(i));
        const int col = get<1>(coords(i));
        if (row < max_row && col < max_col) {
            cutlass::Array<Element, 2> pair;
            pair[0] = static_cast<Element>(acc(i) * scale);
            pair[1] = static_cast<Element>(acc(i + 1) * scale);
            *reinterpret_cast<cutlass::Array<Element, 2>*>(&gmem(row, col)) = pair;
        }
    }
}

}  // namespace flash
