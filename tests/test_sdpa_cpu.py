"""CPU tests of flash_attn_cuda.sdpa, the glue that runs PyTorch SDPA's flash backend on our kernels.

Registration and activation are checked as they are: the CUDA kernels of the aten flash attention ops are
replaced on activate() and restored on deactivate(), with or without a GPU. The glue itself (argument binding,
layouts, the pairing of forward and backward, dropout's rng_state, fallbacks) runs here on CPU tensors: the same
kernels are registered for the CPU key, with the float32 reference standing in for the attention ops, so that
PyTorch's own autograd of the aten ops drives them as on a GPU.
"""

import pytest
import torch

from flash_attn_cuda import dropout, reference, sdpa
from flash_attn_cuda._kernel_list import kernel_name
from flash_attn_cuda.plan import plan

BF16 = torch.bfloat16
REPLACED = [name for name in sdpa._REPLACED if sdpa._present(name)]


@pytest.fixture(autouse=True)
def inactive_after():
    yield
    sdpa.deactivate()
    assert not sdpa.is_active()


def cuda_kernels():
    return {name: repr(torch.library.get_kernel(f"aten::{name}", "CUDA")) for name in REPLACED}


def test_registered_on_import_not_active():
    assert sdpa.NAME in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() != sdpa.NAME
    assert not sdpa.is_active()


def test_activate_replaces_and_deactivate_restores_the_cuda_kernels():
    stock = cuda_kernels()
    sdpa.activate()
    assert sdpa.is_active() and torch.nn.attention.current_flash_attention_impl() == sdpa.NAME
    active = cuda_kernels()
    for name in REPLACED:
        assert active[name] != stock[name] and "sdpa.py" in active[name], name
    sdpa.activate()  # again: still one replacement, still undone by one deactivate()
    sdpa.deactivate()
    assert cuda_kernels() == stock
    sdpa.deactivate()  # inactive: nothing to do
    assert cuda_kernels() == stock


def test_registry_activation_is_the_same():
    stock = cuda_kernels()
    torch.nn.attention.activate_flash_attention_impl(sdpa.NAME)
    assert sdpa.is_active() and cuda_kernels() != stock
    torch.nn.attention.restore_flash_attention_impl()
    assert not sdpa.is_active() and cuda_kernels() == stock


def test_the_forward_ops_of_every_supported_torch_are_replaced():
    # torch 2.11 has all but the in-place forward, which later versions added.
    assert {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward",
        "_flash_attention_backward",
    } <= set(REPLACED)


# ---------------------------------------------------------------- what the kernels serve


def qkv(b=2, sq=9, sk=13, h=4, h_k=2, d=16, dtype=BF16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, n, d, generator=g).to(dtype) for s, n in ((sq, h), (sk, h_k), (sk, h_k))]


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda t: [x.float() for x in t], "dtype"),
        (lambda t: [t[0], t[1], t[2][..., :8]], "head dims"),
        (lambda t: [x[..., :12] for x in t], "head dim 12"),
        (lambda t: [torch.cat([x] * 17, -1)[..., :264] for x in t], "head dim 264"),
        (lambda t: [t[0][:, :0], t[1], t[2]], "empty"),
    ],
)
def test_unserved_names_the_reason(change, reason):
    q, k, v = change(qkv())
    assert reason in sdpa._unserved(q, k, v, 0.0, False, None, -1, -1)


def test_unserved_negative_scale_and_cpu_tensors():
    q, k, v = qkv()
    assert "negative scale" in sdpa._unserved(q, k, v, 0.0, False, -0.5, -1, -1)
    assert sdpa._unserved(q, k, v, 0.0, False, 0.5, -1, -1) == sdpa.NOT_ON_ONE_GPU


# ---------------------------------------------------------------- the glue, on the CPU


def _mask(rng_state, dropout_p, b, h, sq, sk):
    return dropout.keep_mask(rng_state, dropout_p, b, h, sq, sk) if dropout_p > 0.0 else None


class ReferenceOps:
    """Stands in for torch.ops.flash_attn2 on CPU tensors: the float32 reference, rounded to the input dtype, with
    the kernels' dropout mask rebuilt from rng_state. Records what each op was handed."""

    def __init__(self):
        self.seen = []

    def fwd(self, q, k, v, scale, causal, deterministic, num_splits, plan, wl, wr, softcap, alibi, p, rng, sink):
        self.seen.append(("fwd", q, rng))
        mask = _mask(rng, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        out, lse = reference.attention_ref(q, k, v, scale, causal, window_size=(wl, wr), dropout_p=p, dropout_mask=mask)
        return out.to(q.dtype).contiguous(), lse

    def bwd(self, dout, q, k, v, out, lse, scale, causal, deterministic, plan, wl, wr, softcap, alibi, p, rng, sink):
        # Attention's gradients written out: the op runs below autograd, where the reference records no graph.
        self.seen.append(("bwd", q, rng))
        assert dout.is_contiguous()
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_k = k.shape[1], k.shape[2]
        group = nheads // nheads_k
        probs = reference.attention_probs(q, k, scale, causal, (wl, wr))
        mask = _mask(rng, p, batch, nheads, seqlen_q, seqlen_k)
        kept = 1.0 if mask is None else mask * reference.dropout_keep_scale(p)
        qf, kf, vf, do = q.float(), k.float().repeat_interleave(group, 2), v.float().repeat_interleave(group, 2), dout
        dv = torch.einsum("bhqk,bqhd->bkhd", probs * kept, do.float())
        d_probs = torch.einsum("bqhd,bkhd->bhqk", do.float(), vf) * kept
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
        scale = head_dim**-0.5 if scale is None else scale
        dq = scale * torch.einsum("bhqk,bkhd->bqhd", d_scores, kf)
        dk = scale * torch.einsum("bhqk,bqhd->bkhd", d_scores, qf)

        def per_kv_head(g):
            return g.view(batch, seqlen_k, nheads_k, group, head_dim).sum(3)

        return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype), torch.empty(0)

    def varlen_fwd(
        self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, det, plan, wl, wr, softcap, alibi, p, rng, sink
    ):
        outs, lses = [], []
        for i in range(cu_q.numel() - 1):
            rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            out, lse = self.fwd(
                q[None, rows_q],
                k[None, rows_k],
                v[None, rows_k],
                scale,
                causal,
                det,
                0,
                plan,
                wl,
                wr,
                0.0,
                None,
                p,
                rng,
                None,
            )
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, det, plan, wl, wr, *rest):
        grads = [[], [], []]
        for i in range(cu_q.numel() - 1):
            rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            dq, dk, dv, _ = self.bwd(
                dout[None, rows_q],
                q[None, rows_q],
                k[None, rows_k],
                v[None, rows_k],
                None,
                None,
                scale,
                causal,
                det,
                plan,
                wl,
                wr,
                *rest,
            )
            for acc, g in zip(grads, (dq, dk, dv)):
                acc.append(g[0])
        return (*(torch.cat(g) for g in grads), torch.empty(0))


@pytest.fixture
def cpu_glue(monkeypatch):
    """The glue registered for the CPU key, the reference standing in for the kernels, and every check of
    _unserved but the one for a CUDA device."""
    ops = ReferenceOps()
    monkeypatch.setattr(sdpa, "_OPS", ops)
    served = sdpa._unserved

    def unserved_on_cpu(*args):
        reason = served(*args)
        return None if reason == sdpa.NOT_ON_ONE_GPU else reason

    monkeypatch.setattr(sdpa, "_unserved", unserved_on_cpu)
    handle = sdpa.register_kernels("CPU")
    sdpa.calls.clear()
    yield ops
    handle.remove()


def leaves(tensors):
    return [x.detach().clone().requires_grad_() for x in tensors]


def reference_grads(q, k, v, dout, scale, causal, mask=None, p=0.0):
    """(out, dq, dk, dv) of the float32 reference over (b, s, h, d) tensors."""
    ql, kl, vl = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, _ = reference.attention_ref(ql, kl, vl, scale, causal, dropout_p=p, dropout_mask=mask)
    return (out, *torch.autograd.grad(out, (ql, kl, vl), dout.float()))


def check(ours, ref, what):
    # The stand-in is the reference rounded to bf16: the glue adds nothing but layout changes.
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2, msg=what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bshd_view", "bhsd_contiguous"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_op_forward_and_backward(cpu_glue, causal, layout, scale):
    sq = sk = 11 if causal else None
    q, k, v = qkv(sq=sq or 9, sk=sk or 13)
    base = leaves([q, k, v])
    if layout == "bshd_view":
        query, key, value = (x.transpose(1, 2) for x in base)
    else:
        query, key, value = (x.transpose(1, 2).contiguous() for x in base)
        query.retain_grad(), key.retain_grad(), value.retain_grad()
    result = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, scale=scale)
    out, lse = result[0], result[1]
    assert out.shape == query.shape and out.stride() == torch.empty_like(query).stride()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert result[4:6] == (q.shape[1], k.shape[1])
    assert result[6].dtype == torch.uint64 and result[6].shape == (2,)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    out.backward(dout)
    ref_out, *ref_grads = reference_grads(q, k, v, dout.transpose(1, 2), scale, causal)
    check(out.transpose(1, 2), ref_out, "out")
    grads = [x.grad for x in base] if layout == "bshd_view" else [x.grad.transpose(1, 2) for x in (query, key, value)]
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        check(g, r, name)
    if layout == "bhsd_contiguous":
        assert all(x.grad.is_contiguous() for x in (query, key, value))
    assert sdpa.calls == {"forward": 1, "backward": 1}
    assert [kind for kind, *_ in cpu_glue.seen] == ["fwd", "bwd"]


def test_dropout_pairs_the_forward_rng_state_with_the_backward(cpu_glue):
    q, k, v = qkv()
    base = leaves([q, k, v])
    p = 0.25
    result = torch.ops.aten._scaled_dot_product_flash_attention(*(x.transpose(1, 2) for x in base), p, False)
    out, rng_state = result[0], result[6]
    assert sdpa._drawn_here(rng_state) and rng_state.untyped_storage().nbytes() == sdpa._MARKED_RNG_BYTES
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    out.backward(dout)
    (_, fwd_q, fwd_rng), (_, _, bwd_rng) = cpu_glue.seen
    assert torch.equal(fwd_rng, bwd_rng)
    mask = dropout.keep_mask(fwd_rng, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    assert 0 < mask.sum() < mask.numel()
    ref_out, *ref_grads = reference_grads(q, k, v, dout.transpose(1, 2), None, False, mask, p)
    check(out.transpose(1, 2), ref_out, "out")
    for name, x, r in zip(("dq", "dk", "dv"), base, ref_grads):
        check(x.grad, r, name)


def test_varlen_forward_and_backward(cpu_glue):
    lens_q, lens_k = [5, 1, 8], [7, 3, 2]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (x[0] for x in qkv(b=1, sq=sum(lens_q), sk=sum(lens_k)))
    out, lse, rng, unused, debug = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.0, True, False, scale=0.25
    )
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and debug.numel() == 0
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), 0.0, True, rng, unused, scale=0.25
    )
    for i in range(3):
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref_out, *ref_grads = reference_grads(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], dout[None, rows_q], 0.25, True
        )
        check(out[rows_q], ref_out[0], f"out of sequence {i}")
        for name, g, r in zip(("dq", "dk", "dv"), (dq[rows_q], dk[rows_k], dv[rows_k]), ref_grads):
            check(g, r[0], f"{name} of sequence {i}")
    assert sdpa.calls == {"forward": 1, "backward": 1}


@pytest.mark.skipif(not sdpa._present("_flash_attention_forward_no_dropout_inplace"), reason="torch without the op")
def test_in_place_forward_writes_out(cpu_glue):
    q, k, v = qkv()
    out = torch.full_like(q, float("nan"))
    lse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(
        out, q, k, v, None, None, q.shape[1], k.shape[1], 0.0, False, False
    )
    ref_out, _ = reference.attention_ref(q, k, v)
    check(out, ref_out, "out")
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])


# ---------------------------------------------------------------- fallbacks


class Recorder:
    """Stands in for one of PyTorch's kernels: records the call, returns a marker."""

    def __init__(self):
        self.args = None

    def call_boxed(self, keyset, *args, **kwargs):
        self.args = (args, kwargs)
        return "pytorch"


@pytest.fixture
def stock():
    recorders = {name: Recorder() for name in sdpa._REPLACED}
    sdpa.calls.clear()
    return sdpa._Kernels(recorders), recorders


@pytest.mark.parametrize(
    "extra",
    [{"seqused_k": torch.ones(2, dtype=torch.int32)}, {"alibi_slopes": torch.ones(4)}, {"return_debug_mask": True}],
)
def test_forward_only_arguments_run_pytorchs_kernel(cpu_glue, stock, extra):
    kernels, recorders = stock
    q, k, v = qkv()
    args = [q, k, v, None, None, q.shape[1], k.shape[1], 0.0, False, extra.pop("return_debug_mask", False)]
    assert kernels.flash_forward(None, *args, **extra) == "pytorch"
    assert recorders["_flash_attention_forward"].args is not None
    assert sdpa.calls == {"fallback_forward": 1} and cpu_glue.seen == []


def test_int64_cumulative_lengths_run_pytorchs_kernel(cpu_glue, stock):
    kernels, recorders = stock
    q, k, v = (x[0] for x in qkv(b=1))
    cu_q, cu_k = torch.tensor([0, 4, 9]), torch.tensor([0, 6, 13])
    assert kernels.flash_forward(None, q, k, v, cu_q, cu_k, 5, 7, 0.0, False, False) == "pytorch"
    assert sdpa.calls == {"fallback_forward": 1}


def test_a_copied_dropout_rng_state_still_pairs_the_passes(cpu_glue):
    # Saved-tensor hooks that offload activations hand the backward a copy, without the forward's storage.
    q, k, v = qkv()
    base = leaves([q, k, v])
    with torch.autograd.graph.save_on_cpu():
        result = torch.ops.aten._scaled_dot_product_flash_attention(*(x.transpose(1, 2) for x in base), 0.25, False)
    rng_state = result[6]
    copy = rng_state.clone()
    assert copy.untyped_storage().nbytes() != sdpa._MARKED_RNG_BYTES and sdpa._drawn_here(copy)
    assert not sdpa._drawn_here(torch.tensor([5, 7]).view(torch.uint64))  # PyTorch's (seed, offset)
    copied = [rng_state.clone()]
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x):
        result = torch.ops.aten._scaled_dot_product_flash_attention(*(x.transpose(1, 2) for x in base), 0.25, False)
    result[0].float().sum().backward()
    assert sdpa.calls["backward"] == 1 and "fallback_backward" not in sdpa.calls, (sdpa.calls, copied)


@pytest.mark.parametrize(
    "dropout_p, causal, window",
    [
        (0.0, True, (-1, 0)),  # varlen_attn's causal: the plain causal kernels, not the variants ones
        (0.0, False, (-1, 0)),
        (0.0, True, (-1, 5)),
        (0.0, False, (-1, 5)),
        (0.0, True, (3, 0)),
        (0.0, False, (-1, -1)),
        (0.1, False, (-1, -1)),  # dropout alone: the plain forward kernel, the variants backward
        (0.1, True, (-1, -1)),
    ],
)
def test_the_kernels_asked_for_are_the_ones_the_plan_runs(dropout_p, causal, window):
    names = sdpa._kernels(dropout_p, causal, *window, 64, BF16)
    for pass_, name in zip(("fwd", "bwd"), names):
        planned = plan(
            pass_,
            batch=1,
            seqlen_q=128,
            seqlen_k=128,
            nheads=2,
            nheads_k=2,
            head_dim=64,
            causal=causal,
            window_size=window,
            dropout=dropout_p > 0,
            arch=80,
            num_sms=108,
        )
        assert name == kernel_name(pass_, 64, "bf16", planned.causal, planned.variants), (pass_, planned)


def test_backward_of_a_foreign_dropout_forward_runs_pytorchs_kernel(cpu_glue, stock):
    kernels, recorders = stock
    q, k, v = qkv()
    out, lse = cpu_glue.fwd(q, k, v, 0.25, False, False, 0, "", -1, -1, 0.0, None, 0.0, None, None)
    foreign = torch.tensor([1, 2], dtype=torch.int64).view(torch.uint64)  # as PyTorch's kernel makes it
    args = [out, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.1, False, foreign, foreign]
    assert kernels.flash_backward(None, *args) == "pytorch"
    assert sdpa.calls == {"fallback_backward": 1}
    # Without dropout the forward's rng_state means nothing: the backward runs here whoever ran the forward.
    args[10] = 0.0
    grads = kernels.flash_backward(None, *args)
    assert len(grads) == 3 and sdpa.calls["backward"] == 1


def test_unservable_tensors_run_pytorchs_kernels_in_both_passes(cpu_glue, stock):
    kernels, recorders = stock
    q, k, v = (x.float() for x in qkv())
    assert kernels.sdpa_forward(None, *(x.transpose(1, 2) for x in (q, k, v))) == "pytorch"
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
    rng = torch.empty(2, dtype=torch.uint64)
    sdpa_args = [x.transpose(1, 2) for x in (out, q, k, v, out)] + [lse, None, None, 9, 13, 0.0, False, rng, rng]
    assert kernels.sdpa_backward(None, *sdpa_args) == "pytorch"
    assert sdpa.calls == {"fallback_forward": 1, "fallback_backward": 1} and cpu_glue.seen == []


@pytest.mark.parametrize("layout", ["bshd_view", "bhsd_contiguous"])
def test_torch_compile_fullgraph_runs_the_glue(cpu_glue, layout):
    # Inductor plans its buffers from the aten ops' meta functions; the glue's outputs must have their layouts.
    def step(query, key, value):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True)[0]

    results = []
    for run in (torch.compile(step, fullgraph=True), step):
        base = leaves(qkv(sq=11, sk=11))
        if layout == "bshd_view":
            inputs = [x.transpose(1, 2) for x in base]
        else:
            inputs = base = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in base]
        out = run(*inputs)
        out.float().square().sum().backward()
        results.append([out, *(x.grad for x in base)])
    for name, compiled, eager in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(compiled, eager), name
    assert sdpa.calls == {"forward": 2, "backward": 2}
