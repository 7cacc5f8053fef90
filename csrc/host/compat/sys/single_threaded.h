// Stand-in for glibc's <sys/single_threaded.h>, found before the system one: setup.py puts csrc/compat first
// on the include path of every host and nvcc compile.
//
// Why: libstdc++'s <ext/atomicity.h> (gcc >= 11) includes <sys/single_threaded.h> whenever it exists (glibc >= 2.32)
// and then reads the glibc variable `__libc_single_threaded` to skip atomic reference counting (shared_ptr,
// std::string's COW remnants, locale) in single-threaded processes. Reading it adds a GLIBC_2.32 symbol version
// to _C.so, which keeps the wheel from the manylinux_2_28 tag (glibc 2.28) when it is built on a newer system.
//
// What: this header maps the name to a constant "not single threaded", local to this library. libstdc++ then
// always takes its atomic path, which is always correct; the only cost is the skipped fast path for processes
// that never start a thread (a PyTorch process does start them). Nothing else changes: no glibc symbol is
// referenced, and the header is not included anywhere else in glibc or libstdc++.
#ifndef FLASH_ATTN2_COMPAT_SYS_SINGLE_THREADED_H
#define FLASH_ATTN2_COMPAT_SYS_SINGLE_THREADED_H

// A constant expression, so the compiler folds it away: the library references no symbol for it.
#if defined(__cplusplus) && __cplusplus >= 201703L
inline constexpr char flash_attn2_libc_single_threaded = 0;
#else
static const char flash_attn2_libc_single_threaded = 0;
#endif

#define __libc_single_threaded flash_attn2_libc_single_threaded

#endif  // FLASH_ATTN2_COMPAT_SYS_SINGLE_THREADED_H
