// What selects a compiled kernel: pass, dtype, kernel head dim and mask (the axes of kernel_list.h), and the
// kernel family a launcher runs. Plain C++, shared by the registry, the launchers and the plans.
#pragma once

#include <cstdint>

#include "generated/kernel_list.h"

namespace flash {

enum class Pass { kFwd = 0, kBwd = 1 };

// How a kernel computes its GEMMs, which decides the GPUs that run it. One launcher holds every family of its
// (pass, dtype, head dim, mask) and runs the plan's (FwdParams::family). The values index per-family bits
// (FamilySet, plan.h) and fill one byte of FwdParams, so new families take the next values.
enum class KernelFamily : uint8_t {
    kMmaSync = 0,  // warp-level mma.sync (sm_80 and later)
    kWgmma = 1,    // Hopper warpgroup MMAs (sm_90a code)
};
constexpr int kNumKernelFamilies = 2;

// Which of the mma.sync launchers' tile sets runs (tile_size.h: mma_sync_tile_set of the plan's budget), one byte
// of FwdParams: the set of sm_80's 163 KiB, or that of the 99 KiB of sm_86, sm_89 and sm_120.
enum class MmaSyncTileSet : uint8_t { k163KiB = 0, k99KiB = 1 };

// The variants that the plain forward kernels (the mma.sync ones and the warp-specialized Hopper one) also compile,
// each in a form of its own, for a call whose one variant it is. The variants kernel holds every variant's code
// behind run-time branches in one step body, and that alone cost 9-20% of a head-dim-128 forward on the mma.sync
// side and 40-70% on Hopper, before any variant's own arithmetic (docs/design-notes.md).
enum class PlainMod : uint8_t { kNone = 0, kSoftcap = 1, kDropout = 2 };

// "mma_sync" or "wgmma": the plan op's and plan_override's spelling.
constexpr const char* family_name(KernelFamily family) {
    switch (family) {
        case KernelFamily::kMmaSync: return "mma_sync";
        case KernelFamily::kWgmma: return "wgmma";
    }
    return "unknown";
}

// Whether a GPU of compute capability cc_major.cc_minor runs the family's kernels. mma.sync's bf16 m16n8k16 is
// an sm_80 instruction that every later GPU keeps. The wgmma kernels are sm_90a code: wgmma is an
// arch-specific feature, which runs on sm_90 exactly and on no later GPU.
constexpr bool family_runs_on(KernelFamily family, int cc_major, int cc_minor) {
    switch (family) {
        case KernelFamily::kMmaSync: return cc_major >= 8;
        case KernelFamily::kWgmma: return cc_major == 9 && cc_minor == 0;
    }
    return false;
}

struct KernelKey {
    bool is_bf16;
    int head_dim;  // the kernel's compile-time head dim, one of kKernelHeadDims
    bool causal;
    bool variants = false;  // the variants kernel (window, softcap, ALiBi, dropout), which is masked (causal) too

    // The mask axis of kernel_list.h: 0 non-causal, 1 causal, 2 variants.
    constexpr int mask() const { return variants ? 2 : int(causal); }
};

// The smallest kernel head dim that holds head_dim, or -1 when none does.
constexpr int kernel_head_dim(long long head_dim) {
    for (int d : kKernelHeadDims) {
        if (head_dim <= d) { return d; }
    }
    return -1;
}

}  // namespace flash
