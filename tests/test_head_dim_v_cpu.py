"""CPU tests of V with a head dim of its own (d_v != d_qk): the public functions give out and dv V's head dim, dq and
dk Q's; a narrower Q and K are zero-padded to V's, a narrower V goes to the ops at its own head dim (which run it
on a kernel of its own or pad it themselves). Meta tensors run the ops' fake
implementations and autograd; the values are checked on the GPU (test_head_dim_v_gpu.py)."""

import pytest
import torch

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, interface


def meta(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 192), (64, 40), (72, 96)])
def test_dense_shapes_and_gradients(d_qk, d_v):
    q = meta(2, 9, 4, d_qk).requires_grad_()
    k = meta(2, 11, 2, d_qk).requires_grad_()
    v = meta(2, 11, 2, d_v).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 9, 4, d_v) and lse.shape == (2, 4, 9)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_varlen_shapes_and_gradients():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device="meta")
    q, k = meta(9, 4, 192).requires_grad_(), meta(9, 2, 192).requires_grad_()
    v = meta(9, 2, 128).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert out.shape == (9, 4, 128)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_ops_get_v_at_its_own_head_dim(monkeypatch):
    # The op sees a narrower v at its own head dim (rounded up to a multiple of 8; the op pads it further where no
    # kernel of its own runs it), and a narrower q and k zero-padded to v's.
    seen = {}

    def record(q, k, v, *args):
        seen["dims"] = (q.shape[-1], k.shape[-1], v.shape[-1])
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        return out, q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

    monkeypatch.setattr(interface._ops, "fwd", record)
    out = flash_attn_func(meta(1, 3, 2, 192), meta(1, 5, 2, 192), meta(1, 5, 2, 128))
    assert seen["dims"] == (192, 192, 128) and out.shape[-1] == 128
    out = flash_attn_func(meta(1, 3, 2, 192), meta(1, 5, 2, 192), meta(1, 5, 2, 100))
    assert seen["dims"] == (192, 192, 104) and out.shape[-1] == 100
    out = flash_attn_func(meta(1, 3, 2, 64), meta(1, 5, 2, 64), meta(1, 5, 2, 100))
    assert seen["dims"] == (104, 104, 104) and out.shape[-1] == 100


def test_kvcache_shapes():
    q, k_cache, v_cache = meta(2, 1, 4, 192), meta(2, 16, 2, 192), meta(2, 16, 2, 128)
    seqlens = torch.zeros(2, dtype=torch.int32, device="meta")
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k=meta(2, 1, 2, 192), v=meta(2, 1, 2, 128), cache_seqlens=seqlens
    )
    assert out.shape == (2, 1, 4, 128)


def test_mismatched_head_dims_are_refused():
    with pytest.raises(ValueError, match="k must have the head_dim of q"):
        flash_attn_func(meta(1, 3, 2, 64), meta(1, 5, 2, 48), meta(1, 5, 2, 64))
    with pytest.raises(ValueError, match="the head_dim of v must be in"):
        flash_attn_func(meta(1, 3, 2, 64), meta(1, 5, 2, 64), meta(1, 5, 2, 264))
    with pytest.raises(ValueError, match="k_cache must have the head_dim of q"):
        flash_attn_with_kvcache(meta(1, 1, 2, 64), meta(1, 16, 2, 32), meta(1, 16, 2, 64))
    seqlens = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="head dims of k_cache and v_cache"):
        flash_attn_with_kvcache(
            meta(1, 1, 2, 64),
            meta(1, 16, 2, 64),
            meta(1, 16, 2, 32),
            k=meta(1, 1, 2, 64),
            v=meta(1, 1, 2, 64),
            cache_seqlens=seqlens,
        )
