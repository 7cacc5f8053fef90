// Throughput ceiling of the Ampere-style tensor-core instruction mma.sync.m16n8k16 (bf16 inputs, fp32 accumulate).
// Register-only loop: each warp runs CHAINS independent accumulator chains; the grid is one full wave of
// resident blocks on every SM. Prints the median and best TFLOP/s over timed launches (cudaEvent).
//
//   nvcc -O3 -arch=sm_90 mma_peak.cu -o mma_peak && ./mma_peak [iters] [reps]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(call)                                                                                              \
    do {                                                                                                         \
        cudaError_t err_ = (call);                                                                               \
        if (err_ != cudaSuccess) {                                                                               \
            std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            std::exit(1);                                                                                        \
        }                                                                                                        \
    } while (0)

constexpr int CHAINS = 8;                       // independent accumulators per thread
constexpr int THREADS = 256;                    // 8 warps per block
constexpr double FLOPS_PER_MMA = 2.0 * 16 * 8 * 16;  // one warp-wide m16n8k16

__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__global__ void __launch_bounds__(THREADS)
    mma_loop(const unsigned* __restrict__ seed, float* __restrict__ out, int iters) {
    const int lane = threadIdx.x & 31;
    unsigned a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = seed[(lane + i) & 31];  // runtime operands: nothing can be folded
    for (int i = 0; i < 2; ++i) b[i] = seed[(lane + 7 * i + 3) & 31];
    float acc[CHAINS][4];
    for (int c = 0; c < CHAINS; ++c)
        for (int j = 0; j < 4; ++j) acc[c][j] = 0.f;
#pragma unroll 2
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) mma_16816(acc[c], a, b);
    }
    float s = 0.f;
    for (int c = 0; c < CHAINS; ++c)
        for (int j = 0; j < 4; ++j) s += acc[c][j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the work observable
}

int main(int argc, char** argv) {
    const int iters = argc > 1 ? std::atoi(argv[1]) : 8192;
    const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
    if (iters <= 0 || reps <= 0) {
        std::fprintf(stderr, "usage: %s [iters > 0] [reps > 0]\n", argv[0]);
        return 2;
    }
    int dev = 0;
    CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mma_loop, THREADS, 0));
    if (per_sm <= 0) {
        std::fprintf(stderr, "mma_loop cannot be resident (occupancy 0)\n");
        return 1;
    }
    const int blocks = prop.multiProcessorCount * per_sm;
    const double warps = double(blocks) * THREADS / 32;
    const double flops = warps * iters * CHAINS * FLOPS_PER_MMA;

    // Random bf16 pairs with random signs and magnitudes in [2^-8, 2^-7): non-zero data, no overflow.
    std::vector<unsigned> h_seed(32);
    unsigned x = 12345u;
    for (auto& w : h_seed) {
        unsigned half[2];
        for (auto& h : half) {
            x = x * 1664525u + 1013904223u;
            h = ((x >> 31) << 15) | (119u << 7) | ((x >> 8) & 0x7fu);
        }
        w = half[0] | (half[1] << 16);
    }
    unsigned* d_seed = nullptr;
    float* d_out = nullptr;
    CHECK(cudaMalloc(&d_seed, 32 * sizeof(unsigned)));
    CHECK(cudaMalloc(&d_out, size_t(blocks) * THREADS * sizeof(float)));
    CHECK(cudaMemcpy(d_seed, h_seed.data(), 32 * sizeof(unsigned), cudaMemcpyHostToDevice));

    for (int i = 0; i < 3; ++i) mma_loop<<<blocks, THREADS>>>(d_seed, d_out, iters);  // warm-up, clocks up
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());

    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    std::vector<float> ms(reps);
    for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(start));
        mma_loop<<<blocks, THREADS>>>(d_seed, d_out, iters);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaEventElapsedTime(&ms[r], start, stop));
    }
    std::vector<float> h_out(size_t(blocks) * THREADS);
    CHECK(cudaMemcpy(h_out.data(), d_out, h_out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double checksum = 0;
    for (float v : h_out) checksum += v;

    std::sort(ms.begin(), ms.end());
    const double med = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    std::printf("device=%s sms=%d cc=%d.%d blocks=%d threads=%d blocks_per_sm=%d chains=%d iters=%d reps=%d\n",
                prop.name, prop.multiProcessorCount, prop.major, prop.minor, blocks, THREADS, per_sm, CHAINS, iters,
                reps);
    std::printf("median_ms=%.4f min_ms=%.4f checksum=%.6e\n", med, ms[0], checksum);
    std::printf("tflops_median=%.2f tflops_max=%.2f\n", flops / (med * 1e-3) / 1e12, flops / (ms[0] * 1e-3) / 1e12);

    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaFree(d_seed));
    CHECK(cudaFree(d_out));
    return checksum == checksum ? 0 : 1;  // NaN would mean garbage operands
}
