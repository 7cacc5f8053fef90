"""The op table: every op of torch.ops.flash_attn2 that the C++ library defines, described once.

csrc/generate.py writes from it:
- csrc/generated/op_args.h: the argument groups' structs (VariantArgs);
- csrc/generated/ops.h: one <Name>Args struct per op, and the declaration of its implementation
  (<name>_op(const <Name>Args&), written by hand in csrc/host/);
- csrc/generated/ops_registration.cpp: the schemas, and entry points that gather the arguments into the struct,
  registered through the stable ABI;
- flash_attn_cuda/_op_table.py: the same description for Python, from which flash_attn_cuda/_ops.py registers
  the fake implementations and the autograd of the forward ops.

The C++ autograd (csrc/host/autograd/autograd.cpp) reads the registered schemas themselves. So a new argument is
one line here (an entry of a group reaches every op that lists the group), the field of the params struct that
carries it, the kernel that reads it, the public wrapper that passes it, and tests.

Autograd pairs each forward op with its backward op by name: every argument of the backward is `dout` (the
gradient of `out`), an output of the forward, or an argument of the forward of the same name; every output
`d<name>` of the backward is the gradient of the forward's argument `<name>`.
"""

from dataclasses import dataclass

# Schema type -> the C++ type of an argument of the entry point and of a member of the Args struct. Members are
# references, so gathering the arguments copies no tensor handle: the struct lives as long as the call.
CPP_TYPES = {
    "Tensor": "const Tensor&",
    "Tensor?": "const std::optional<Tensor>&",
    "int": "int64_t",
    "float": "double",
    "bool": "bool",
    "str": "const std::string&",
}
CPP_RETURNS = {"Tensor": "Tensor", "str": "std::string", "str[]": "std::vector<std::string>"}


@dataclass(frozen=True)
class Arg:
    name: str
    type: str  # a schema type; "Tensor(a!)" marks a tensor the op writes in place
    default: str | None = None  # the schema's default, as the schema spells it
    doc: str = ""

    @property
    def base_type(self) -> str:
        return "Tensor" if self.type.startswith("Tensor(") else self.type


@dataclass(frozen=True)
class Group:
    """Arguments that several ops take and the host reads as one struct (csrc/host/call.h derives its methods).
    An op lists the members it takes, in its own schema order; a member it does not take gets its default."""

    name: str  # the member of the Args struct
    struct: str  # the generated struct (csrc/generated/op_args.h)
    cpp_type: str  # the struct the Args member has: the generated one, or one derived from it in csrc/host/call.h
    args: tuple[Arg, ...]

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)


@dataclass(frozen=True)
class Ret:
    name: str
    type: str
    # How the fake implementation makes it: "like:<arg>" (the argument's shape, contiguous) or "lse:<arg>" (the
    # float32 log-sum-exp of a query tensor: (batch, nheads, seqlen_q) of a 4-D one, (nheads, total_q) of a 3-D one)
    # or "like_or_empty:<arg>" (the optional argument's shape, or an empty fp32 (0,) when it is absent: the gradient
    # of an optional argument, which a schema cannot return as None) or "attn_out:<q>,<v>" (q's shape with v's last
    # dim: an attention output).
    fake: str = ""


@dataclass(frozen=True)
class Op:
    name: str
    args: tuple  # Arg, or (Group, member name) for a group's member
    returns: tuple[Ret, ...]
    doc: str
    dispatch: str = "tensor"  # "tensor": CUDA and CPU kernels (CPU ones reject CPU tensors); "composite": any device
    backward: str = ""  # the op that computes this forward op's gradients (autograd)

    def flat_args(self) -> list[Arg]:
        return [a if isinstance(a, Arg) else a[0].arg(a[1]) for a in self.args]


# The attention variants every attention op takes (flash-attn 2.x semantics). The backward gets the forward's,
# rng_state included, from which it regenerates the forward's dropout mask.
VARIANTS = Group(
    name="variants",
    struct="VariantArgs",
    cpp_type="Variants",
    args=(
        Arg("window_left", "int", "-1", "keys left of the diagonal each query sees; -1: unbounded"),
        Arg("window_right", "int", "-1", "keys right of the diagonal each query sees; -1: unbounded"),
        Arg("softcap", "float", "0.0", "scores become softcap * tanh(score / softcap); 0: off"),
        Arg("alibi_slopes", "Tensor?", "None", "fp32 (nheads,) or (batch, nheads): ALiBi's slope per head"),
        Arg("dropout_p", "float", "0.0", "the probability of dropping an attention weight"),
        Arg("rng_state", "Tensor?", "None", "int64 (2,): dropout's seed and offset; needed when dropout_p > 0"),
        Arg(
            "learnable_sink",
            "Tensor?",
            "None",
            "fp32 (nheads,): a logit per query head that joins each row's softmax denominator and carries no value",
        ),
    ),
)


def variants(*names):
    """Members of VARIANTS, in the order given (all of them, in the group's order, when none are named)."""
    return tuple((VARIANTS, n) for n in (names or tuple(a.name for a in VARIANTS.args)))


Q, K, V = Arg("q", "Tensor"), Arg("k", "Tensor"), Arg("v", "Tensor")
SCALE, CAUSAL = Arg("softmax_scale", "float"), Arg("causal", "bool")
DETERMINISTIC = Arg("deterministic", "bool", "False")
NUM_SPLITS = Arg("num_splits", "int", "0")
PLAN_OVERRIDE = Arg("plan_override", "str", '""')
DOUT, OUT, LSE = Arg("dout", "Tensor"), Arg("out", "Tensor"), Arg("softmax_lse", "Tensor")
CU_SEQLENS = (Arg("cu_seqlens_q", "Tensor"), Arg("cu_seqlens_k", "Tensor"))
MAX_SEQLENS = (Arg("max_seqlen_q", "int"), Arg("max_seqlen_k", "int"))
FWD_RETURNS = (Ret("out", "Tensor", "like:q"), Ret("softmax_lse", "Tensor", "lse:q"))
# fwd and varlen_fwd: v may be narrower than q, and out has v's head dim.
FWD_V_RETURNS = (Ret("out", "Tensor", "attn_out:q,v"), Ret("softmax_lse", "Tensor", "lse:q"))
BWD_RETURNS = (
    Ret("dq", "Tensor", "like:q"),
    Ret("dk", "Tensor", "like:k"),
    Ret("dv", "Tensor", "like:v"),
    Ret("dlearnable_sink", "Tensor", "like_or_empty:learnable_sink"),
)

OPS = (
    Op(
        name="fwd",
        args=(Q, K, V, SCALE, CAUSAL, DETERMINISTIC, NUM_SPLITS, PLAN_OVERRIDE, *variants()),
        returns=FWD_V_RETURNS,
        backward="bwd",
        doc="Attention over (batch, seqlen, nheads, head_dim) q, k, v.",
    ),
    Op(
        name="bwd",
        args=(DOUT, Q, K, V, OUT, LSE, SCALE, CAUSAL, DETERMINISTIC, PLAN_OVERRIDE, *variants()),
        returns=BWD_RETURNS,
        doc="Gradients of fwd: dq, dk, dv, contiguous, in the shapes of q, k, v; and dlearnable_sink, fp32, "
        "(nheads,) with a learnable_sink, else (0,).",
    ),
    Op(
        name="varlen_fwd",
        args=(Q, K, V, *CU_SEQLENS, *MAX_SEQLENS, SCALE, CAUSAL, DETERMINISTIC, PLAN_OVERRIDE, *variants()),
        returns=FWD_V_RETURNS,
        backward="varlen_bwd",
        doc="Attention over a variable-length batch: (total, nheads, head_dim) q, k, v and cumulative lengths.",
    ),
    Op(
        name="varlen_bwd",
        args=(
            DOUT,
            Q,
            K,
            V,
            OUT,
            LSE,
            *CU_SEQLENS,
            *MAX_SEQLENS,
            SCALE,
            CAUSAL,
            DETERMINISTIC,
            PLAN_OVERRIDE,
            *variants(),
        ),
        returns=BWD_RETURNS,
        doc="Gradients of varlen_fwd.",
    ),
    Op(
        name="plan",
        args=(
            Arg("pass_name", "str"),
            Arg("batch", "int"),
            Arg("seqlen_q", "int"),
            Arg("seqlen_k", "int"),
            Arg("nheads", "int"),
            Arg("nheads_k", "int"),
            Arg("head_dim", "int"),
            Arg("causal", "bool", "False"),
            DETERMINISTIC,
            Arg("varlen", "bool", "False"),
            NUM_SPLITS,
            PLAN_OVERRIDE,
            Arg("arch", "int", "-1"),
            Arg("num_sms", "int", "-1"),
            Arg("is_bf16", "bool", "True"),
            Arg("window_left", "int", "-1"),
            Arg("window_right", "int", "-1"),
            Arg("alibi", "bool", "False"),
            Arg("dropout", "bool", "False"),
            Arg("softcap", "float", "0.0"),
            Arg("kvcache", "bool", "False"),
            Arg("paged", "bool", "False"),
            Arg("max_smem", "int", "-1"),
            Arg("head_dim_v", "int", "-1"),
        ),
        returns=(Ret("", "str"),),
        dispatch="composite",
        doc="The plan of one pass for these sizes and variants, as to_string(Plan) writes it.",
    ),
    Op(
        name="fwd_kvcache",
        args=(
            Q,
            Arg("k_cache", "Tensor(a!)"),
            Arg("v_cache", "Tensor(b!)"),
            Arg("k", "Tensor?", "None"),
            Arg("v", "Tensor?", "None"),
            Arg("rotary_cos", "Tensor?", "None"),
            Arg("rotary_sin", "Tensor?", "None"),
            Arg("cache_seqlens", "Tensor?", "None"),
            Arg("cache_batch_idx", "Tensor?", "None"),
            Arg("cache_leftpad", "Tensor?", "None"),
            Arg("block_table", "Tensor?", "None"),
            Arg("softmax_scale", "float", "1.0"),
            Arg("causal", "bool", "False"),
            *variants("window_left", "window_right", "softcap"),
            Arg("rotary_interleaved", "bool", "True"),
            *variants("alibi_slopes"),
            NUM_SPLITS,
            PLAN_OVERRIDE,
            *variants("learnable_sink"),
        ),
        returns=FWD_RETURNS,
        doc="flash_attn_with_kvcache: appends k and v to the caches in place (rotating k, and q, with "
        "rotary_cos/sin), then attends over the caches. block_table: paged caches.",
    ),
    Op(
        name="varlen_fwd_paged",
        args=(
            Q,
            Arg("k_cache", "Tensor"),
            Arg("v_cache", "Tensor"),
            *CU_SEQLENS,
            *MAX_SEQLENS,
            Arg("block_table", "Tensor"),
            SCALE,
            CAUSAL,
            PLAN_OVERRIDE,
            *variants("window_left", "window_right", "softcap", "alibi_slopes", "learnable_sink"),
        ),
        returns=FWD_RETURNS,
        doc="flash_attn_varlen_func with block_table: varlen queries against paged caches (forward only).",
    ),
    Op(
        name="compiled_kernels",
        args=(),
        returns=(Ret("", "str[]"),),
        dispatch="composite",
        doc="The names of the kernels this build holds.",
    ),
)

GROUPS = (VARIANTS,)
