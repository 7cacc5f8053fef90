// What selects a compiled kernel: pass, dtype, kernel head dim and mask (the axes of kernel_list.h). Plain
// C++, shared by the registry and the plans.
#pragma once

#include "generated/kernel_list.h"

namespace flash {

enum class Pass { kFwd = 0, kBwd = 1 };

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
