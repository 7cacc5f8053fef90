// Force-included (-include) into every host C++ compile by setup.py, so that _C.so needs no glibc newer than
// 2.28 (the manylinux_2_28 wheel tag) when it is built on a newer system.
//
// torch's stable headers (torch/csrc/stable/macros.h) call dlsym(RTLD_DEFAULT, ...) to reach shims newer than
// TORCH_TARGET_VERSION. glibc 2.34 moved dlsym from libdl into libc under a new symbol version, GLIBC_2.34, and
// links new references to that one. The .symver below binds our references to the original version instead,
// dlsym@GLIBC_2.2.5 (x86_64) or @GLIBC_2.17 (aarch64): the same function, which glibc >= 2.34 still exports
// for old binaries and glibc < 2.34 exports from libdl. setup.py also links libdl explicitly (a stub
// on glibc >= 2.34), so that on older systems the library that defines it is loaded with us.
#ifndef FLASH_ATTN2_COMPAT_GLIBC_SYMVER_H
#define FLASH_ATTN2_COMPAT_GLIBC_SYMVER_H

#include <features.h>

#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 34)
#if defined(__x86_64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.17");
#endif
#endif

#endif  // FLASH_ATTN2_COMPAT_GLIBC_SYMVER_H
