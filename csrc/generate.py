"""The generated sources: the kernel list (below) and the op table (csrc/op_table.py), each one source of truth.

Each kernel is one (pass, head dim, dtype, mask). This file writes, from the lists below:
- csrc/generated/instantiations/<name>_<part>.cu, each kernel's translation units (kernel_parts);
- csrc/generated/kernel_list.h, the head dims and the kernel names for the C++ side (registry, plans, errors);
- flash_attn_cuda/_kernel_list.py, the same for Python (kernel_available, tests);
- csrc/generated/wgmma_shapes.h, the wgmma instructions of WGMMA_SS_SHAPES_N (kernels/wgmma_ops.h).
and from the op table (see there): csrc/generated/op_args.h, csrc/generated/ops.h,
csrc/generated/ops_registration.cpp and flash_attn_cuda/_op_table.py.
setup.py imports this module to pick the files to compile (FLASH_ATTN2_HDIMS, FLASH_ATTN2_DTYPES).
Adding a head dim, a dtype or a mask is one line below, an op argument one line in op_table.py; then
`python csrc/generate.py` (make generate). The generated files are committed; a CPU test checks they are current.
"""

import collections
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import op_table  # noqa: E402

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
# Mask name -> the kernels' (kCausal, kVariants) template arguments. "variants" is the masked kernel with a runtime
# sliding window, softcap, ALiBi and dropout; the other two compile none of that code, which would cost the plain
# path up to 14% on an H200 (docs/design-notes.md, 'Variants in a kernel of their own').
MASKS = {"noncausal": ("false", "false"), "causal": ("true", "false"), "variants": ("true", "true")}
PASSES = ("fwd", "bwd")
NAME_FORMAT = "{pass_}_hdim{head_dim}_{dtype}_{mask}"

# wgmma N shapes (M = 64, K = 16, fp32 accumulators, both operands in shared memory) that CuTe's selector offers
# only with its extended-shapes header, which adds about 16-23 s of front end to every file that includes it. These
# GEMMs need them: a warpgroup's slice of dQ in the backward is 48 columns at head dim 96, of dQ, dK and dV 80 and
# 112 at 160 and 224; the warp-specialized forward's S GEMM at head dim 256 is 80 keys wide. At N = 16 instead,
# each wgmma would re-read its A tile from shared memory (docs/design-notes.md, 'Extended wgmma N shapes'). Written
# to csrc/generated/wgmma_shapes.h; kernels/wgmma_ops.h picks them.
WGMMA_SS_SHAPES_N = (48, 80, 112)
# wgmma's type names of the operand dtypes.
WGMMA_TYPES = {"fp16": "f16", "bf16": "bf16"}

# Head dims whose backward Hopper may run on the mma.sync kernel without being told to: those of the narrow wgmma
# backward (bwd_sm90_narrow in launch/tile_size.h), whose deterministic mode leaves the variants, the head dims
# without a warp-specialized tile and the longest causal calls to it (can_run in host/plan.cpp). The wide kernel
# of the others orders dQ itself, so there the mma.sync backward runs only under an override. A CPU test checks
# this against the plans. The release build runs both from the PTX on Hopper (setup.py, mma_sync_sm90_from_ptx).
HOPPER_BWD_MMA_SYNC_HEAD_DIMS = (32, 64, 96, 128)

CSRC = Path(__file__).resolve().parent
OUT_DIR = CSRC / "generated" / "instantiations"
CPP_LIST = CSRC / "generated" / "kernel_list.h"
PY_LIST = CSRC.parent / "flash_attn_cuda" / "_kernel_list.py"
OP_ARGS_H = CSRC / "generated" / "op_args.h"
OPS_H = CSRC / "generated" / "ops.h"
OPS_REGISTRATION = CSRC / "generated" / "ops_registration.cpp"
PY_OP_TABLE = CSRC.parent / "flash_attn_cuda" / "_op_table.py"
AUTOGRAD_PAIRS_H = CSRC / "generated" / "autograd_pairs.h"
WGMMA_SHAPES_H = CSRC / "generated" / "wgmma_shapes.h"

# Each kernel's translation units, by pass: Part(name, family, what the unit instantiates, how the registering unit
# names it where its header also defines it). A unit holds one family's kernels, so
# that the build compiles it for that family's archs only (setup.py: wgmma for sm_90a alone; see
# docs/design-notes.md, 'Build time and memory'). The first part also registers the kernel's launcher, which picks
# the plan's family and tile set at run time (launch/flash_<pass>_launch.h).
Part = collections.namedtuple("Part", "name family instantiation extern", defaults=(None,))
PARTS = {
    "fwd": (
        Part("mma_sync", "mma_sync", "FLASH_INSTANTIATE_FWD(run_fwd_on_mma_sync, {args})"),
        Part("wgmma", "wgmma", "FLASH_INSTANTIATE_FWD(run_fwd_on_wgmma, {args})"),
    ),
    "bwd": (
        Part(
            "mma_sync",
            "mma_sync",
            "FLASH_INSTANTIATE_BWD_MMA_SYNC({args}, flash::kSmem163KiB)\n"
            "FLASH_INSTANTIATE_BWD_MMA_SYNC({args}, flash::kSmem99KiB)",
        ),
        Part("wgmma", "wgmma", "FLASH_INSTANTIATE_BWD_WGMMA({args})"),
    ),
}
# The mma.sync backward kernels, (head dim, mask), whose two tile sets compile in units of their own: together each
# of these takes a compile past 4 GB (3,906,250 KiB), apart each stays within it (docs/design-notes.md, 'Shared-memory
# partitions built without CuTe's partition algebra').
BWD_MMA_SYNC_SETS_APART = frozenset(
    [(64, "variants"), (128, "variants")] + [(head_dim, mask) for head_dim in (96, 192, 256) for mask in MASKS]
)
BWD_MMA_SYNC_163 = Part(
    "mma_sync",
    "mma_sync",
    "FLASH_INSTANTIATE_BWD_MMA_SYNC({args}, flash::kSmem163KiB)",
    "FLASH_EXTERN_BWD_MMA_SYNC({args}, flash::kSmem163KiB)",
)
BWD_MMA_SYNC_99 = Part(
    "mma_sync_99kib",
    "mma_sync",
    "FLASH_INSTANTIATE_BWD_MMA_SYNC({args}, flash::kSmem99KiB)",
    "FLASH_EXTERN_BWD_MMA_SYNC({args}, flash::kSmem99KiB)",
)
HEADERS = {"mma_sync": "flash_{pass_}_launch_mma_sync.h", "wgmma": "flash_{pass_}_launch_sm90.h"}

INSTANTIATION = """// Generated by csrc/generate.py; do not edit.
{includes}
{instantiation}
{registration}"""
REGISTRATION = "FLASH_REGISTER_KERNEL(run_{pass_}, {element}, {is_bf16}, {head_dim}, {causal}, {variants}, {tag})\n"

CPP_TEMPLATE = """// Generated by csrc/generate.py from its lists; do not edit.
#pragma once

namespace flash {{

// The head dims that kernels are compiled for; other sizes run on the next larger one.
inline constexpr int kKernelHeadDims[] = {{{head_dims}}};
inline constexpr int kNumKernelHeadDims = {num_head_dims};
inline constexpr int kNumDtypes = {num_dtypes};  // index 0 fp16, 1 bf16
inline constexpr int kNumMasks = {num_masks};    // index 0 non-causal, 1 causal, 2 variants
inline constexpr int kNumPasses = {num_passes};   // index 0 forward, 1 backward

// kKernelNames[pass][head dim index][dtype][mask], the names of the generated files.
inline constexpr const char* kKernelNames[kNumPasses][kNumKernelHeadDims][kNumDtypes][kNumMasks] = {{
{names}
}};

}}  // namespace flash
"""

PY_TEMPLATE = '''"""Generated by csrc/generate.py from its lists; do not edit."""

HEAD_DIMS = {head_dims!r}
DTYPES = {dtypes!r}
MASKS = {masks!r}
PASSES = {passes!r}


def kernel_name(pass_: str, head_dim: int, dtype: str, causal: bool, variants: bool = False) -> str:
    """The name of the kernel of one pass ("fwd" or "bwd"), kernel head dim, dtype ("fp16" or "bf16") and mask
    (variants: the kernel of window, softcap, ALiBi and dropout calls, whatever causal says)."""
    mask = MASKS[2] if variants else MASKS[int(causal)]
    return {name_format!r}.format(pass_=pass_, head_dim=head_dim, dtype=dtype, mask=mask)
'''


def kernel_name(pass_: str, head_dim: int, dtype: str, mask: str) -> str:
    return NAME_FORMAT.format(pass_=pass_, head_dim=head_dim, dtype=dtype, mask=mask)


def kernels():
    """(pass, head dim, dtype, mask) of every kernel, in the order of kernel_list.h."""
    return itertools.product(PASSES, HEAD_DIMS, DTYPES, MASKS)


def kernel_parts(pass_: str, head_dim: int, mask: str) -> tuple:
    """The translation units (Part) of one kernel."""
    if pass_ == "bwd" and (head_dim, mask) in BWD_MMA_SYNC_SETS_APART:
        return (BWD_MMA_SYNC_163, BWD_MMA_SYNC_99, PARTS["bwd"][1])
    return PARTS[pass_]


def kernel_files() -> dict:
    """{path: (pass, head dim, dtype, mask, Part)} of every kernel's translation units (kernel_parts)."""
    return {
        OUT_DIR / f"{kernel_name(pass_, head_dim, dtype, mask)}_{part.name}.cu": (pass_, head_dim, dtype, mask, part)
        for pass_, head_dim, dtype, mask in kernels()
        for part in kernel_parts(pass_, head_dim, mask)
    }


def cpp_list() -> str:
    rows = []
    for pass_ in PASSES:
        dims = []
        for head_dim in HEAD_DIMS:
            dtypes = ", ".join(
                "{" + ", ".join(f'"{kernel_name(pass_, head_dim, dtype, mask)}"' for mask in MASKS) + "}"
                for dtype in DTYPES
            )
            dims.append(f"        {{{dtypes}}}")
        rows.append("    {\n" + ",\n".join(dims) + "\n    }")
    return CPP_TEMPLATE.format(
        head_dims=", ".join(map(str, HEAD_DIMS)),
        num_head_dims=len(HEAD_DIMS),
        num_dtypes=len(DTYPES),
        num_masks=len(MASKS),
        num_passes=len(PASSES),
        names=",\n".join(rows),
    )


def py_list() -> str:
    return PY_TEMPLATE.format(
        head_dims=HEAD_DIMS, dtypes=tuple(DTYPES), masks=tuple(MASKS), passes=PASSES, name_format=NAME_FORMAT
    )


# ---- The op table's outputs ----

GENERATED = "Generated by csrc/generate.py from csrc/op_table.py; do not edit."


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def schema(op) -> str:
    def arg(a):
        return f"{a.type} {a.name}" + (f"={a.default}" if a.default is not None else "")

    if len(op.returns) == 1 and not op.returns[0].name:
        returns = op.returns[0].type
    else:
        returns = "(" + ", ".join(f"{r.type} {r.name}" for r in op.returns) + ")"
    return f"{op.name}(" + ", ".join(arg(a) for a in op.flat_args()) + f") -> {returns}"


def cpp_return(op) -> str:
    if len(op.returns) == 1 and not op.returns[0].name:
        return op_table.CPP_RETURNS[op.returns[0].type]
    return "std::tuple<" + ", ".join(op_table.CPP_RETURNS[r.type] for r in op.returns) + ">"


def cpp_default(a) -> str:
    """A group member's C++ value when an op does not take it."""
    if a.base_type == "Tensor?":
        return "kNoTensor"
    if a.base_type == "bool":
        return {"True": "true", "False": "false"}[a.default]
    if a.base_type in ("int", "float"):
        return a.default
    raise ValueError(f"{a.name}: no C++ default for a group member of type {a.type}")


def groups_of(op):
    seen = []
    for a in op.args:
        if not isinstance(a, op_table.Arg) and a[0] not in seen:
            seen.append(a[0])
    return seen


def plain_args(op):
    return [a for a in op.args if isinstance(a, op_table.Arg)]


def op_args_h() -> str:
    out = [
        f"// {GENERATED}",
        "// The argument groups of the ops: arguments several ops take, which the host reads as one struct.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <optional>",
        "",
        '#include "host/torch_glue.h"',
        "",
        "namespace flash {",
        "",
    ]
    for group in op_table.GROUPS:
        out.append(f"struct {group.struct} {{")
        for a in group.args:
            out.append(f"    {op_table.CPP_TYPES[a.base_type]} {a.name};  // {a.doc}")
        out += ["};", ""]
    out += ["}  // namespace flash", ""]
    return "\n".join(out)


def ops_h() -> str:
    out = [
        f"// {GENERATED}",
        "// One struct per op holding its arguments (references into the call's own: gathering copies nothing), and",
        "// the op's implementation, written by hand in csrc/host/. Group members are one struct each (op_args.h).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <optional>",
        "#include <string>",
        "#include <tuple>",
        "#include <vector>",
        "",
        '#include "host/call.h"',
        "",
        "namespace flash {",
        "",
    ]
    for op in op_table.OPS:
        out.append(f"// {op.name}: {op.doc}")
        members = [f"    {op_table.CPP_TYPES[a.base_type]} {a.name};" for a in plain_args(op)]
        members += [f"    {g.cpp_type} {g.name};" for g in groups_of(op)]
        out += (
            [f"struct {camel(op.name)}Args {{", *members, "};"] if members else [f"struct {camel(op.name)}Args {{}};"]
        )
        out += [f"{cpp_return(op)} {op.name}_op(const {camel(op.name)}Args& args);", ""]
    out += ["}  // namespace flash", ""]
    return "\n".join(out)


def ops_registration_cpp() -> str:
    out = [
        f"// {GENERATED}",
        "// The op schemas and their registration through the stable ABI (STABLE_TORCH_LIBRARY), so the library loads",
        "// into any torch from 2.11 on. Each entry point gathers its arguments into the op's Args struct. The CPU",
        "// registrations exist to reject CPU tensors with a message that names the argument; ops that take no tensor",
        "// register as CompositeExplicitAutograd, which serves every device and none. Autograd and the fake",
        "// implementations are registered elsewhere (csrc/host/autograd/, flash_attn_cuda/_ops.py).",
        "#include <torch/csrc/stable/library.h>",
        "",
        '#include "generated/ops.h"',
        "",
        "namespace flash {",
        "namespace {",
        "",
        "// A group member that an op does not take.",
        "const std::optional<Tensor> kNoTensor;",
        "",
    ]
    for op in op_table.OPS:
        params = ", ".join(f"{op_table.CPP_TYPES[a.base_type]} {a.name}" for a in op.flat_args())
        taken = {a.name for a in op.flat_args()}
        fields = [a.name for a in plain_args(op)]
        for g in groups_of(op):
            members = ", ".join(m.name if m.name in taken else cpp_default(m) for m in g.args)
            fields.append(f"{g.cpp_type}{{{{{members}}}}}")
        out += [
            f"{cpp_return(op)} {op.name}_entry({params}) {{",
            f"    return {op.name}_op({camel(op.name)}Args{{{', '.join(fields)}}});",
            "}",
            "",
        ]
    out += ["}  // namespace", "}  // namespace flash", "", "STABLE_TORCH_LIBRARY(flash_attn2, m) {"]
    for op in op_table.OPS:
        text = schema(op).replace('"', '\\"')
        out.append(f'    m.def("{text}");')
    out += ["}", ""]
    for key, dispatch in (("CUDA", "tensor"), ("CPU", "tensor"), ("CompositeExplicitAutograd", "composite")):
        out.append(f"STABLE_TORCH_LIBRARY_IMPL(flash_attn2, {key}, m) {{")
        out += [
            f'    m.impl("{op.name}", TORCH_BOX(&flash::{op.name}_entry));'
            for op in op_table.OPS
            if op.dispatch == dispatch
        ]
        out += ["}", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def autograd_pairs_h() -> str:
    pairs = [f'    {{"flash_attn2::{op.name}", "flash_attn2::{op.backward}"}},' for op in op_table.OPS if op.backward]
    return "\n".join(
        [
            f"// {GENERATED}",
            "// Each forward op with autograd, and the op that computes its gradients.",
            "#pragma once",
            "",
            "#include <utility>",
            "",
            "namespace flash {",
            "",
            "inline constexpr std::pair<const char*, const char*> kAutogradPairs[] = {",
            *pairs,
            "};",
            "",
            "}  // namespace flash",
            "",
        ]
    )


def py_op_table() -> str:
    lines = [
        f'"""{GENERATED}',
        "",
        "OPS: op name -> args (names, in schema order), returns ((name, fake rule), ...), the",
        'backward op of a forward op ("" if none), and "tensor" or "composite" dispatch."""',
        "",
        "OPS = {",
    ]
    for op in op_table.OPS:
        args = tuple(a.name for a in op.flat_args())
        returns = tuple((r.name, r.fake) for r in op.returns)
        lines.append(f"    {op.name!r}: {{")
        lines.append(f'        "args": {args!r},')
        lines.append(f'        "returns": {returns!r},')
        lines.append(f'        "backward": {op.backward!r},')
        lines.append(f'        "dispatch": {op.dispatch!r},')
        lines.append("    },")
    lines += ["}", ""]
    return "\n".join(lines)


WGMMA_SHAPES_TEMPLATE = """// Generated by csrc/generate.py from WGMMA_SS_SHAPES_N; do not edit.
// The fma of each wgmma shape that kernels/wgmma_ops.h serves itself (see there), by operand dtype: an accumulator
// of 64 x N floats, N / 2 of them per thread, both operands read through shared-memory descriptors.
#pragma once

#include <cstdint>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/config.hpp>
#include <cutlass/numeric_types.h>

namespace flash {{

inline constexpr int kWgmmaSsShapesN[] = {{{shapes}}};

template <class Element, int N, cute::SM90::GMMA::Major kMajorA, cute::SM90::GMMA::Major kMajorB>
struct WgmmaSsFma;
{specializations}
}}  // namespace flash
"""

WGMMA_FMA_TEMPLATE = """
template <cute::SM90::GMMA::Major kMajorA, cute::SM90::GMMA::Major kMajorB>
struct WgmmaSsFma<{element}, {n}, kMajorA, kMajorB> {{
    CUTE_HOST_DEVICE static void fma(uint64_t const& desc_a, uint64_t const& desc_b,
{params},
                                     cute::SM90::GMMA::ScaleOut const scale_d) {{
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
        // p: whether to add to the accumulators (scale_d) or overwrite them; the 1, 1 scale A and B unnegated.
        asm volatile(
            "{{\\n"
            ".reg .pred p;\\n"
            "setp.ne.b32 p, %{scale_index}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
{registers}
            "%{desc_a_index}, %{desc_b_index}, p, 1, 1, %{major_a_index}, %{major_b_index};\\n"
            "}}\\n"
{outputs}
            : "l"(desc_a), "l"(desc_b), "r"(int32_t(scale_d)), "n"(int32_t(kMajorA)), "n"(int32_t(kMajorB)));
#else
        CUTE_INVALID_CONTROL_PATH("wgmma needs sm_90a");
#endif
    }}
}};
"""


def wgmma_shapes_h() -> str:
    specializations = []
    for n in WGMMA_SS_SHAPES_N:
        assert n % 8 == 0 and 8 <= n <= 256, n
        regs = n // 2  # accumulator floats per thread
        names = [f"d{i:03d}" for i in range(regs)]
        params = ",\n".join(" " * 37 + ", ".join(f"float& {x}" for x in names[i : i + 6]) for i in range(0, regs, 6))
        operands = [f"%{i}" for i in range(regs)]
        registers = "\n".join(
            '            "'
            + ("{" if i == 0 else " ")
            + ", ".join(operands[i : i + 8])
            + ("}, " if i + 8 >= regs else ",")
            + '"'
            for i in range(0, regs, 8)
        )
        outputs = "\n".join(
            "            "
            + (": " if i == 0 else "  ")
            + ", ".join(f'"+f"({x})' for x in names[i : i + 8])
            + ("" if i + 8 >= regs else ",")
            for i in range(0, regs, 8)
        )
        for dtype, element in DTYPES.items():
            specializations.append(
                WGMMA_FMA_TEMPLATE.format(
                    element=element,
                    n=n,
                    params=params,
                    ptx_type=WGMMA_TYPES[dtype],
                    registers=registers,
                    outputs=outputs,
                    desc_a_index=regs,
                    desc_b_index=regs + 1,
                    scale_index=regs + 2,
                    major_a_index=regs + 3,
                    major_b_index=regs + 4,
                )
            )
    return WGMMA_SHAPES_TEMPLATE.format(
        shapes=", ".join(map(str, WGMMA_SS_SHAPES_N)), specializations="".join(specializations)
    )


def outputs() -> dict:
    """Every generated file's path and text, for main() and for the test that they are current."""
    files = {
        CPP_LIST: cpp_list(),
        PY_LIST: py_list(),
        OP_ARGS_H: op_args_h(),
        OPS_H: ops_h(),
        OPS_REGISTRATION: ops_registration_cpp(),
        PY_OP_TABLE: py_op_table(),
        AUTOGRAD_PAIRS_H: autograd_pairs_h(),
        WGMMA_SHAPES_H: wgmma_shapes_h(),
    }
    for path, (pass_, head_dim, dtype, mask, part) in kernel_files().items():
        parts = kernel_parts(pass_, head_dim, mask)
        name = kernel_name(pass_, head_dim, dtype, mask)
        registers = part == parts[0]
        headers = [f"launch/flash_{pass_}_launch.h"] if registers else []
        headers.append("launch/" + HEADERS[part.family].format(pass_=pass_))
        args = dict(
            pass_=pass_,
            element=DTYPES[dtype],
            is_bf16="true" if dtype == "bf16" else "false",
            head_dim=head_dim,
            causal=MASKS[mask][0],
            variants=MASKS[mask][1],
            tag=name,
        )
        args["args"] = "{element}, {head_dim}, {causal}, {variants}".format(**args)
        # What the other units of its family compile: defined in the header this unit includes too, and compiled
        # here again without `extern`.
        lines = [part.instantiation.format(**args)]
        lines += [p.extern.format(**args) for p in parts if p != part and p.family == part.family and p.extern]
        files[path] = INSTANTIATION.format(
            includes="".join(f'#include "{h}"\n' for h in headers),
            instantiation="\n".join(lines),
            registration=REGISTRATION.format(**args) if registers else "",
        )
    return files


def main() -> None:
    assert list(DTYPES) == ["fp16", "bf16"] and list(MASKS) == ["noncausal", "causal", "variants"], (
        "kernel_list.h indexes"
    )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    files = outputs()
    for stale in OUT_DIR.glob("*.cu"):
        if stale not in files:
            stale.unlink()
    for path, text in files.items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


if __name__ == "__main__":
    main()
