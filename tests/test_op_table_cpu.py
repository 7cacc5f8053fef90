"""The op table (csrc/op_table.py): the generated files are current, the registered schemas are the table's, and
the fakes and autograd that _ops.py derives from it behave as the ops do. No GPU needed."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import CSRC, load_generator
from torch._subclasses.fake_tensor import FakeTensorMode


def test_generated_files_are_current():
    # Every generated file is committed; one that differs from the generator's output was edited by hand or not
    # regenerated after a table change (`make generate`).
    generator = load_generator()
    stale = [
        str(path.relative_to(CSRC.parent))
        for path, text in generator.outputs().items()
        if not path.is_file() or path.read_text() != text
    ]
    assert not stale, f"run `python csrc/generate.py`: {stale}"
    on_disk = {p.name for p in generator.OUT_DIR.glob("*.cu")}
    assert on_disk == {p.name for p in generator.outputs() if p.parent == generator.OUT_DIR}


def test_registered_schemas_are_the_tables():
    generator = load_generator()
    import flash_attn_cuda  # noqa: F401  (registers the ops)

    for op in generator.op_table.OPS:
        registered = getattr(torch.ops.flash_attn2, op.name).default._schema
        expected = torch._C.parse_schema("flash_attn2::" + generator.schema(op))
        assert str(registered) == str(expected), op.name


def test_python_table_matches_the_registered_ops():
    import flash_attn_cuda  # noqa: F401
    from flash_attn_cuda._op_table import OPS

    for name, op in OPS.items():
        schema = getattr(torch.ops.flash_attn2, name).default._schema
        assert tuple(a.name for a in schema.arguments) == op["args"], name
        if op["backward"]:
            bwd = OPS[op["backward"]]
            outputs = {r for r, _ in op["returns"]}
            for arg in bwd["args"]:
                assert arg in op["args"] or arg in outputs or arg[1:] in outputs, (name, arg)
            assert all(r[0] == "d" and r[1:] in op["args"] for r, _ in bwd["returns"]), name


def test_fakes_follow_the_table():
    import flash_attn_cuda  # noqa: F401

    with FakeTensorMode():
        q = torch.empty(2, 33, 6, 64, dtype=torch.float16)
        k = v = torch.empty(2, 17, 2, 64, dtype=torch.float16)
        out, lse = torch.ops.flash_attn2.fwd(q, k, v, 0.125, True)
        assert out.shape == q.shape and lse.shape == (2, 6, 33) and lse.dtype == torch.float32
        cache = torch.empty(2, 40, 2, 64, dtype=torch.float16)
        out, lse = torch.ops.flash_attn2.fwd_kvcache(q, cache, cache)
        assert out.shape == q.shape and lse.shape == (2, 6, 33)
        qv = torch.empty(50, 6, 64, dtype=torch.float16)
        cu = torch.tensor([0, 20, 50], dtype=torch.int32)
        out, lse = torch.ops.flash_attn2.varlen_fwd(qv, qv[:, :2], qv[:, :2], cu, cu, 30, 30, 0.125, False)
        assert out.shape == qv.shape and lse.shape == (6, 50)
        table = torch.zeros(2, 3, dtype=torch.int32)
        pages = torch.empty(6, 16, 2, 64, dtype=torch.float16)
        out, lse = torch.ops.flash_attn2.varlen_fwd_paged(qv, pages, pages, cu, cu, 30, 48, table, 0.125, False)
        assert out.shape == qv.shape and lse.shape == (6, 50)


@pytest.mark.parametrize("python_rule", [False, True])
def test_autograd_passes_every_backward_argument(python_rule):
    # The backward op receives the forward's arguments by name. A wrapper records the backward call on meta
    # tensors, through the registered autograd (C++ where built, else Python) or the Python rule itself.
    from flash_attn_cuda import _ops

    q, k, v = (torch.empty(2, 9, 4, 64, dtype=torch.float16, device="meta").requires_grad_() for _ in range(3))
    alibi = torch.empty(4, dtype=torch.float32, device="meta")
    sink = torch.empty(4, dtype=torch.float32, device="meta").requires_grad_()
    args = (q, k, v, 0.25, True, True, 0, "kernel=mma_sync", 3, 5, 7.0, alibi, 0.0, None, sink)
    if python_rule:
        calls = []

        def recorder(*a):
            calls.append(a)
            return torch.ops.flash_attn2.bwd.default(*a)

        setup_context, backward = _ops._autograd_rule("fwd", backward_op=recorder)

        class Ctx:
            def save_for_backward(self, *tensors):
                self.saved_tensors = tensors

            def set_materialize_grads(self, value):
                pass

        ctx = Ctx()
        output = torch.ops.flash_attn2.fwd.default(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
        setup_context(ctx, args, output)
        grads = backward(ctx, torch.empty_like(output[0]), None)
        (call,) = calls
        assert call[1:4] == tuple(args[:3]) and call[4] is output[0] and call[5] is output[1]
        assert call[6:] == (0.25, True, True, "kernel=mma_sync", 3, 5, 7.0, alibi, 0.0, None, sink)
        assert len(grads) == len(args) and all(g is None for g in grads[3:-1])
        assert all(g.shape == q.shape for g in grads[:3]) and grads[-1].shape == sink.shape
        # Without the sink (None), its placeholder gradient goes nowhere.
        calls.clear()
        ctx = Ctx()
        no_sink = (*args[:-1], None)
        output = torch.ops.flash_attn2.fwd.default(*(a.detach() if isinstance(a, torch.Tensor) else a for a in no_sink))
        setup_context(ctx, no_sink, output)
        grads = backward(ctx, torch.empty_like(output[0]), None)
        assert calls[0][-1] is None and len(grads) == len(args) and all(g is None for g in grads[3:])
    else:
        out, _ = torch.ops.flash_attn2.fwd(*args)
        dq, dk, dv, dsink = torch.autograd.grad(out.sum(), (q, k, v, sink))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dsink.shape == sink.shape
        # An optional differentiable argument left out is no input of the autograd node.
        out, _ = torch.ops.flash_attn2.fwd(*args[:-1])
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert dq.shape == q.shape


def test_public_variants_follow_the_schema():
    # interface.py passes its Variants as the ops' trailing arguments, in this order.
    from flash_attn_cuda._op_table import OPS
    from flash_attn_cuda.interface import Variants

    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"):
        assert OPS[name]["args"][-len(Variants._fields) :] == Variants._fields, name


def test_each_kernel_file_holds_one_family():
    # A kernel's translation units each include one family's launchers, so that the build can compile each for
    # that family's archs alone; exactly one of them, the mma.sync one, registers the kernel's launcher.
    generator = load_generator()
    files = generator.kernel_files()
    assert len(files) == sum(len(generator.kernel_parts(*k[:2], k[3])) for k in generator.kernels())
    for path, (pass_, _, _, _, part) in files.items():
        text = path.read_text()
        other = "sm90" if part.family == "mma_sync" else "mma_sync"
        assert f"flash_{pass_}_launch_{other}.h" not in text, path.name
        assert ("FLASH_REGISTER_KERNEL" in text) == (part.name == "mma_sync"), path.name


def test_each_mma_sync_backward_kernel_compiles_once():
    # The mma.sync backward's two tile sets compile in one unit or a unit each (kernel_parts); either way each set's
    # launcher is instantiated in exactly one unit, and the other unit, whose header defines it too, names it extern.
    generator = load_generator()
    launchers = ("BWD_MMA_SYNC({args}, flash::kSmem163KiB)", "BWD_MMA_SYNC({args}, flash::kSmem99KiB)")
    for pass_, head_dim, dtype, mask in generator.kernels():
        if pass_ != "bwd":
            continue
        name = generator.kernel_name(pass_, head_dim, dtype, mask)
        parts = [p for p in generator.kernel_parts(pass_, head_dim, mask) if p.family == "mma_sync"]
        texts = [(generator.OUT_DIR / f"{name}_{p.name}.cu").read_text().splitlines() for p in parts]
        fields = dict(element=generator.DTYPES[dtype], head_dim=head_dim, causal=generator.MASKS[mask][0])
        fields["args"] = "{element}, {head_dim}, {causal}, ".format(**fields) + generator.MASKS[mask][1]
        names = [form.format(**fields) for form in launchers]
        for launcher in names:
            made = [i for i, lines in enumerate(texts) if "FLASH_INSTANTIATE_" + launcher in lines]
            assert len(made) == 1, (name, launcher, made)
            for i, lines in enumerate(texts):
                assert ("FLASH_EXTERN_" + launcher in lines) == (i != made[0]), (name, launcher, i)
        assert len(parts) == (1 if (head_dim, mask) not in generator.BWD_MMA_SYNC_SETS_APART else len(names)), name


def test_no_source_includes_cutes_extended_wgmma_shapes():
    # CuTe's extended wgmma shapes header adds 16-23 s of front end to each file that includes it; the shapes the
    # kernels need come from kernels/wgmma_ops.h instead.
    generator = load_generator()  # skips where no csrc/ stands next to the tests
    sources = [p for p in generator.CSRC.rglob("*") if p.suffix in (".h", ".cu", ".cpp", ".hpp")]
    assert sources
    for path in sources:
        assert "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" not in path.read_text(), path


def test_generated_wgmma_shapes_hold_one_fma_per_shape_and_dtype():
    # Each shape's wgmma, per dtype: N / 2 accumulator registers, as many in-out operands, the descriptors after.
    generator = load_generator()
    text = generator.WGMMA_SHAPES_H.read_text()
    blocks = text.split("template <cute::SM90::GMMA::Major kMajorA, cute::SM90::GMMA::Major kMajorB>\nstruct")[1:]
    assert len(blocks) == len(generator.WGMMA_SS_SHAPES_N) * len(generator.DTYPES)
    seen = set()
    for block in blocks:
        element, n = re.search(r"WgmmaSsFma<([\w:]+), (\d+), kMajorA, kMajorB>", block).groups()
        n = int(n)
        dtype = next(d for d, e in generator.DTYPES.items() if e == element)
        ptx_type = generator.WGMMA_TYPES[dtype]
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} " in block
        assert block.count('"+f"(') == n // 2 and block.count("float& ") == n // 2
        assert f'"%{n // 2}, %{n // 2 + 1}, p, 1, 1, %{n // 2 + 3}, %{n // 2 + 4};' in block
        assert f"setp.ne.b32 p, %{n // 2 + 2}, 0;" in block
        seen.add((dtype, n))
    assert seen == {(d, n) for d in generator.DTYPES for n in generator.WGMMA_SS_SHAPES_N}


def test_nvcc_per_file_replaces_the_gencodes_of_mapped_files(tmp_path):
    # csrc/nvcc_per_file.py, setup.py's PYTORCH_NVCC: a mapped source gets its own -gencode flags in place of
    # torch's and its include directories ahead of all others, any other source keeps torch's flags; the other
    # arguments pass through in order.
    mapped = tmp_path / "a_mma_sync.cu"
    gencode_map = tmp_path / "map.json"
    gencode_map.write_text(
        json.dumps({str(mapped): {"gencode": ["-gencode=arch=compute_90a,code=sm_90a"], "include": ["/overlay"]}})
    )
    # The wrapped command: a Python one that prints the arguments it gets.
    echo = json.dumps([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"])

    def run(source):
        # As torch writes it: "-c" twice.
        args = ["-I/torch", "-O3", "-gencode=arch=compute_80,code=sm_80", "-c", "-c", str(source), "-o", "x.o", "-DX"]
        out = subprocess.run(
            [sys.executable, str(CSRC / "nvcc_per_file.py"), str(gencode_map), echo, *args],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    expected = [
        *("-I/overlay", "-I/torch", "-O3", "-c", "-c", str(mapped), "-o", "x.o", "-DX"),
        "-gencode=arch=compute_90a,code=sm_90a",
    ]
    assert run(mapped) == expected
    other = tmp_path / "b.cu"
    assert run(other) == [
        *("-I/torch", "-O3", "-gencode=arch=compute_80,code=sm_80", "-c", "-c", str(other), "-o", "x.o", "-DX")
    ]


def test_nvcc_per_file_logs_each_compile(tmp_path):
    # FLASH_ATTN2_BUILD_LOG: one JSON line per compile, with its time and peak memory, and the compiler's exit
    # status passed on.
    gencode_map = tmp_path / "map.json"
    gencode_map.write_text("{}")
    log = tmp_path / "build.jsonl"
    failing = json.dumps([sys.executable, "-c", "import sys; sys.exit(3)"])
    result = subprocess.run(
        [sys.executable, str(CSRC / "nvcc_per_file.py"), str(gencode_map), failing, "-c", "-c", "k.cu", "-o", "k.o"],
        env={**os.environ, "FLASH_ATTN2_BUILD_LOG": str(log)},
    )
    assert result.returncode == 3
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["source"] == "k.cu" and record["seconds"] >= 0 and record["peak_gib"] > 0
