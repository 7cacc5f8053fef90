"""Whether a built shared library carries a C++ runtime of its own, that is, libstdc++ linked into it statically.

The extensions must share libtorch's C++ runtime: every error an op raises is a C++ exception thrown in the
extension and caught in libtorch. A library with a runtime of its own was seen to crash the process (SIGSEGV) on
such a path, the out-of-memory error of tests/test_out_of_memory_gpu.py, where the same sources linked against the
shared libstdc++ raise RuntimeError (docs/design-notes.md, 'One C++ runtime'). Some toolchains link libstdc++
statically by default; setup.py links it as a shared library explicitly, and checks the result with this module.

Reads the ELF dynamic symbol table directly, so that the check needs no binutils.
"""

import struct

# Entry points of libstdc++'s exception runtime: a library that defines any of them holds that runtime.
RUNTIME_SYMBOLS = frozenset({"__cxa_throw", "__cxa_begin_catch", "__cxa_rethrow", "__gxx_personality_v0"})

_SHT_DYNSYM = 11
_SHN_UNDEF = 0


def defined_dynamic_symbols(path) -> set[str] | None:
    """The names that a 64-bit little-endian ELF file's dynamic symbol table defines; None for any other file."""
    with open(path, "rb") as f:
        data = f.read()
    # e_ident: magic, class 2 (64-bit), data 1 (little-endian).
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != _SHT_DYNSYM:
            continue
        strtab_offset = sections[link][4]
        # Symbol: name, info, other, section index, value, size.
        for start in range(offset, offset + size, entsize):
            st_name, _, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", data, start)
            if st_shndx == _SHN_UNDEF:
                continue
            end = data.index(b"\0", strtab_offset + st_name)
            names.add(data[strtab_offset + st_name : end].decode("ascii", "replace"))
    return names


def carries_cxx_runtime(path) -> bool | None:
    """True if the shared library at `path` defines libstdc++'s exception runtime itself; None if it is no 64-bit
    little-endian ELF file (no check made)."""
    names = defined_dynamic_symbols(path)
    return None if names is None else bool(names & RUNTIME_SYMBOLS)
