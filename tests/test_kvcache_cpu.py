"""CPU tests of the KV-cache side of flash_attn_cuda: the reference (flash_attn_cuda.reference's apply_rotary,
rotary_per_row and kvcache_ref) against independent formulations, the launch plans of KV-cache calls for a given
GPU (no GPU needed), the op schema and fake implementation, and the argument checks that run before the device
check. They need the built extension (the ops and the plan) but no GPU and no kernel."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn_cuda
from flash_attn_cuda import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn_cuda.plan import Plan, plan
from flash_attn_cuda.reference import apply_rotary, attention_ref, kvcache_ref, rotary_per_row

H200 = {"arch": 90, "num_sms": 132}
A100 = {"arch": 80, "num_sms": 108}
F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, dtype=F64):
    return torch.randn(shape, dtype=dtype)


def angles(seqlen_ro, rotary_dim):
    return torch.rand(seqlen_ro, rotary_dim // 2, dtype=F64) * (2 * math.pi)


# ---------------------------------------------------------------- rotary embedding


def rotate_complex(x, angle, positions, rotary_dim, interleaved):
    """Rotary embedding as complex multiplication: each rotated pair (a, b) is the complex number a + ib, multiplied
    by e^{i angle[position, pair]}. Pairs are (2j, 2j + 1) interleaved, (j, j + rotary_dim / 2) otherwise."""
    half = rotary_dim // 2
    head = x[..., :rotary_dim]
    if interleaved:
        pairs = head.reshape(*head.shape[:-1], half, 2)
    else:
        pairs = torch.stack((head[..., :half], head[..., half:]), dim=-1)
    phase = angle[positions].unsqueeze(2)  # (batch, seqlen, 1, half)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(phase), phase))
    rotated = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [2, 10, 32, 64])
def test_apply_rotary_is_complex_multiplication(rotary_dim, interleaved):
    x = randn(2, 5, 3, 64)
    angle = angles(40, rotary_dim)
    positions = torch.randint(0, 40, (2, 5))
    ours = apply_rotary(x, torch.cos(angle), torch.sin(angle), positions, interleaved)
    torch.testing.assert_close(
        ours, rotate_complex(x, angle, positions, rotary_dim, interleaved), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("rotary_dim", [4, 16, 64])
def test_neox_is_interleaved_after_permuting_features(rotary_dim):
    """With y[2j] = x[j] and y[2j + 1] = x[j + rotary_dim / 2] (the tail kept in place), rotating x GPT-NeoX style
    and permuting gives the GPT-J rotation of y, exactly."""
    half = rotary_dim // 2
    perm = [i // 2 + (i % 2) * half for i in range(rotary_dim)] + list(range(rotary_dim, 64))
    x = randn(2, 7, 4, 64)
    angle = angles(30, rotary_dim)
    cos, sin = torch.cos(angle), torch.sin(angle)
    positions = torch.randint(0, 30, (2, 7))
    neox = apply_rotary(x, cos, sin, positions, interleaved=False)
    assert torch.equal(neox[..., perm], apply_rotary(x[..., perm], cos, sin, positions, interleaved=True))


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_partial_rotary_leaves_the_tail(interleaved):
    x = randn(2, 6, 3, 64)
    angle = angles(20, 24)
    cos, sin = torch.cos(angle), torch.sin(angle)
    positions = torch.randint(0, 20, (2, 6))
    ours = apply_rotary(x, cos, sin, positions, interleaved)
    assert torch.equal(ours[..., 24:], x[..., 24:])
    assert torch.equal(ours[..., :24], apply_rotary(x[..., :24], cos, sin, positions, interleaved))
    assert not torch.allclose(ours[..., :24], x[..., :24])


def test_rotary_keeps_pair_norms_and_angle_zero_is_identity():
    x = randn(1, 4, 2, 16)
    positions = torch.arange(4)[None]
    zero = torch.zeros(4, 8, dtype=F64)
    assert torch.equal(apply_rotary(x, torch.cos(zero), torch.sin(zero), positions), x)
    angle = angles(4, 16)
    ours = apply_rotary(x, torch.cos(angle), torch.sin(angle), positions)
    norms = lambda t: t.reshape(*t.shape[:-1], 8, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(ours), norms(x), rtol=1e-12, atol=1e-12)


def test_apply_rotary_computes_in_the_input_dtype():
    x = randn(1, 3, 2, 16, dtype=torch.bfloat16)
    angle = angles(8, 16)
    ours = apply_rotary(x, torch.cos(angle).float(), torch.sin(angle).float(), torch.arange(3)[None])
    assert ours.dtype == torch.bfloat16


# (causal, window_size, seqlen_q, capacity, alibi, per row): flash-attn 2.x's rule. One query row without ALiBi
# is not causal; a window side at or past the capacity is unbounded; any bounded side makes the rotation per row.
PER_ROW_RULES = [
    (False, (-1, -1), 7, 128, False, False),
    (True, (-1, -1), 7, 128, False, True),
    (True, (-1, -1), 1, 128, False, False),
    (True, (-1, -1), 1, 128, True, True),
    (False, (-1, -1), 7, 128, True, False),
    (False, (10, -1), 7, 128, False, True),
    (False, (-1, 0), 7, 128, False, True),
    (False, (0, 0), 1, 128, False, True),
    (False, (127, -1), 7, 128, False, True),
    (False, (128, -1), 7, 128, False, False),
    (False, (-1, 128), 7, 128, False, False),
    (False, (500, 300), 1, 128, False, False),
    (False, (-1, 127), 7, 128, False, True),
    (True, (128, 5), 7, 128, False, True),
]


@pytest.mark.parametrize("causal, window, seqlen_q, capacity, alibi, expected", PER_ROW_RULES)
def test_rotary_per_row(causal, window, seqlen_q, capacity, alibi, expected):
    assert rotary_per_row(causal, window, seqlen_q, capacity, alibi) is expected


# ---------------------------------------------------------------- kvcache_ref


def cache_inputs(batch=3, seqlen_q=4, seqlen_new=3, capacity=64, nheads=6, nheads_k=2, head_dim=32, rotary_dim=16):
    """Random float64 inputs of a KV-cache call (the reference then computes in float64 with upcast=False)."""
    q = randn(batch, seqlen_q, nheads, head_dim)
    k_cache, v_cache = randn(batch, capacity, nheads_k, head_dim), randn(batch, capacity, nheads_k, head_dim)
    k, v = randn(batch, seqlen_new, nheads_k, head_dim), randn(batch, seqlen_new, nheads_k, head_dim)
    angle = angles(capacity + seqlen_q, rotary_dim)
    return q, k_cache, v_cache, k, v, torch.cos(angle), torch.sin(angle)


def to_pages(dense, block_table, num_pages, page_size):
    """The paged copy of a dense cache (batch, capacity, ...) under block_table; unused pages random."""
    pages = torch.randn(num_pages, page_size, *dense.shape[2:], dtype=dense.dtype)
    for b in range(dense.shape[0]):
        for j, page in enumerate(block_table[b].tolist()):
            pages[page] = dense[b, j * page_size : (j + 1) * page_size]
    return pages


def from_pages(pages, block_table, page_size):
    return torch.stack([pages[block_table[b].long()].flatten(0, 1) for b in range(block_table.shape[0])])


@pytest.mark.parametrize(
    "variant",
    [dict(causal=True), dict(window_size=(9, 2), softcap=5.0), dict(causal=True, alibi_slopes="batch")],
    ids=["causal", "window", "alibi"],
)
@pytest.mark.parametrize("page_size", [16, 48])
def test_kvcache_ref_paged_equals_dense(page_size, variant):
    """kvcache_ref on a paged cache (shuffled pages, unused pages) equals it on the dense cache holding the same
    rows, with an append, rotary and left padding: same outputs, and the same rows after the append."""
    capacity = 96
    q, k_cache, v_cache, k, v, cos, sin = cache_inputs(capacity=capacity)
    max_pages = capacity // page_size
    num_pages = 3 * max_pages + 4
    block_table = torch.randperm(num_pages)[: 3 * max_pages].view(3, max_pages).to(torch.int32)
    seqlens = torch.tensor([page_size - 1, 0, 70], dtype=torch.int32)
    leftpad = torch.tensor([5, 0, 33], dtype=torch.int32)
    variant = dict(variant)
    if variant.get("alibi_slopes") == "batch":
        variant["alibi_slopes"] = torch.rand(3, 6)
    common = dict(
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=seqlens,
        cache_leftpad=leftpad,
        rotary_interleaved=False,
        upcast=False,
        **variant,
    )
    out_d, lse_d, k_d, v_d = kvcache_ref(q, k_cache, v_cache, **common)
    k_pages = to_pages(k_cache, block_table, num_pages, page_size)
    v_pages = to_pages(v_cache, block_table, num_pages, page_size)
    out_p, lse_p, k_p, v_p = kvcache_ref(q, k_pages, v_pages, block_table=block_table, **common)
    torch.testing.assert_close(out_p, out_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p, lse_d, rtol=1e-12, atol=1e-12)
    assert torch.equal(from_pages(k_p, block_table, page_size), k_d)
    assert torch.equal(from_pages(v_p, block_table, page_size), v_d)
    # Pages no sequence uses are left alone.
    unused = sorted(set(range(num_pages)) - set(block_table.flatten().tolist()))
    assert torch.equal(k_p[unused], k_pages[unused]) and torch.equal(v_p[unused], v_pages[unused])


def test_kvcache_ref_batch_idx_equals_reordered_cache():
    q, k_cache, v_cache, k, v, cos, sin = cache_inputs()
    rows = torch.randn(5, 64, 2, 32, dtype=F64), torch.randn(5, 64, 2, 32, dtype=F64)
    batch_idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    rows[0][batch_idx.long()], rows[1][batch_idx.long()] = k_cache, v_cache
    seqlens = torch.tensor([10, 0, 60], dtype=torch.int32)
    common = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True, upcast=False)
    out, lse, k_after, v_after = kvcache_ref(q, k_cache, v_cache, **common)
    out_i, lse_i, k_i, v_i = kvcache_ref(q, *rows, cache_batch_idx=batch_idx, **common)
    assert torch.equal(out_i, out) and torch.equal(lse_i, lse)
    assert torch.equal(k_i[batch_idx.long()], k_after) and torch.equal(v_i[batch_idx.long()], v_after)
    for unused in (1, 2):
        assert torch.equal(k_i[unused], rows[0][unused]) and torch.equal(v_i[unused], rows[1][unused])


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(causal=True), dict(window_size=(6, 1), softcap=3.0), dict(alibi_slopes="heads")],
    ids=["plain", "causal", "window", "alibi"],
)
def test_kvcache_ref_without_append_is_attention_on_the_slice(variant):
    """No append: sequence b attends to its cache rows [cache_leftpad[b], cache_seqlens[b]), positions counted
    from the left padding; None for cache_seqlens means the whole cache. Caches unchanged."""
    q, k_cache, v_cache, *_ = cache_inputs()
    variant = dict(variant)
    if variant.get("alibi_slopes") == "heads":
        variant["alibi_slopes"] = torch.rand(6)
    seqlens, leftpad = [30, 0, 64], [4, 0, 50]
    out, lse, k_after, v_after = kvcache_ref(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor(seqlens).int(),
        cache_leftpad=torch.tensor(leftpad).int(),
        upcast=False,
        **variant,
    )
    assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache)
    for b in range(3):
        keys = slice(leftpad[b], seqlens[b])
        want_out, want_lse = attention_ref(
            q[b : b + 1], k_cache[b : b + 1, keys], v_cache[b : b + 1, keys], upcast=False, **variant
        )
        torch.testing.assert_close(out[b : b + 1], want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b : b + 1], want_lse, rtol=1e-12, atol=1e-12)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()  # no key at all
    out_all, _, _, _ = kvcache_ref(q, k_cache, v_cache, upcast=False)
    torch.testing.assert_close(out_all, attention_ref(q, k_cache, v_cache, upcast=False)[0], rtol=1e-12, atol=1e-12)


def test_kvcache_ref_appends_at_cache_seqlens():
    """Without rotary the new rows land verbatim at cache_seqlens[b] + i; every other row is unchanged."""
    q, k_cache, v_cache, k, v, _, _ = cache_inputs()
    seqlens = [0, 17, 61]
    _, _, k_after, v_after = kvcache_ref(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), upcast=False
    )
    for b, n in enumerate(seqlens):
        assert torch.equal(k_after[b, n : n + 3], k[b]) and torch.equal(v_after[b, n : n + 3], v[b])
        keep = torch.ones(64, dtype=torch.bool)
        keep[n : n + 3] = False
        assert torch.equal(k_after[b, keep], k_cache[b, keep]) and torch.equal(v_after[b, keep], v_cache[b, keep])


# (causal, window, seqlen_q, alibi, per row) for test_kvcache_ref_rotates_queries (capacity 64).
ROTATION_CASES = {
    "plain": (False, (-1, -1), 4, False, False),
    "causal": (True, (-1, -1), 4, False, True),
    "window": (False, (10, 3), 4, False, True),
    "window-at-capacity": (False, (64, -1), 4, False, False),
    "window-below-capacity": (False, (63, -1), 4, False, True),
    "decode-causal": (True, (-1, -1), 1, False, False),
    "decode-causal-alibi": (True, (-1, -1), 1, True, True),
}


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("case", list(ROTATION_CASES))
def test_kvcache_ref_rotates_queries_and_keys(case, interleaved):
    """kvcache_ref with rotary tables equals kvcache_ref without them on inputs rotated beforehand (by complex
    multiplication): new keys at cache_seqlens[b] + i, queries at cache_seqlens[b] + i when the rule says per row,
    else all at cache_seqlens[b]. Positions count from cache row 0 even with left padding."""
    causal, window, seqlen_q, alibi, per_row = ROTATION_CASES[case]
    q, k_cache, v_cache, k, v, cos, sin = cache_inputs(seqlen_q=seqlen_q, rotary_dim=16)
    angle = torch.atan2(sin, cos)
    seqlens = torch.tensor([5, 0, 40], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 7], dtype=torch.int32)
    slopes = torch.rand(6) if alibi else None
    base = seqlens.long()[:, None]
    q_pos = base + (torch.arange(seqlen_q) if per_row else torch.zeros(seqlen_q, dtype=torch.long))
    q_rot = rotate_complex(q, angle, q_pos, 16, interleaved)
    k_rot = rotate_complex(k, angle, base + torch.arange(3), 16, interleaved)
    common = dict(
        cache_seqlens=seqlens,
        cache_leftpad=leftpad,
        causal=causal,
        window_size=window,
        alibi_slopes=slopes,
        upcast=False,
    )
    ours = kvcache_ref(q, k_cache, v_cache, k, v, cos, sin, rotary_interleaved=interleaved, **common)
    want = kvcache_ref(q_rot, k_cache, v_cache, k_rot, v, **common)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), ours, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    if seqlen_q > 1 and not per_row:
        # The rule matters here: rotating per row would give another output.
        q_other = rotate_complex(q, angle, base + torch.arange(seqlen_q), 16, interleaved)
        other = kvcache_ref(q_other, k_cache, v_cache, k_rot, v, **common)
        assert not torch.allclose(other[0], ours[0])


def test_kvcache_ref_upcast_dtypes():
    q, k_cache, v_cache, k, v, cos, sin = (t.to(torch.bfloat16) for t in cache_inputs())
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32)
    out, lse, k_after, v_after = kvcache_ref(q, k_cache, v_cache, k, v, cos, sin, seqlens)
    assert out.dtype == lse.dtype == k_after.dtype == v_after.dtype == torch.float32
    out, lse, k_after, v_after = kvcache_ref(q, k_cache, v_cache, k, v, cos, sin, seqlens, upcast=False)
    assert out.dtype == k_after.dtype == v_after.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (3, 6, 4) and k_after.shape == k_cache.shape


# ---------------------------------------------------------------- plans


def kv_plan(gpu=H200, *, batch=2, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=8, head_dim=128, **kwargs) -> Plan:
    p = plan(
        "fwd",
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        kvcache=True,
        **gpu,
        **kwargs,
    )
    assert isinstance(p, Plan) and p.pass_ == "fwd"
    return p


@pytest.mark.parametrize("seqlen_q", [1, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_runs_the_variants_kernel(causal, seqlen_q):
    p = kv_plan(seqlen_q=seqlen_q, causal=causal)
    assert p.variants and p.causal, p  # the masked variants kernel, even without a window, softcap or ALiBi
    plain = plan("fwd", batch=2, seqlen_q=seqlen_q, seqlen_k=4096, nheads=32, nheads_k=8, head_dim=128, **H200)
    assert not plain.variants, plain


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(100, -1)),
        dict(softcap=10.0),
        dict(causal=True, window_size=(64, 0), softcap=5.0),
    ],
    ids=["plain", "causal", "window", "softcap", "combo"],
)
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (6, 2), (4, 1)], ids=["8-2", "32-8", "6-2", "mqa"])
def test_kvcache_packs_gqa_for_one_query_row(heads, extra):
    nheads, nheads_k = heads
    assert kv_plan(nheads=nheads, nheads_k=nheads_k, **extra).gqa_pack == nheads // nheads_k


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_does_not_pack_with_alibi(causal):
    assert kv_plan(alibi=True, causal=causal).gqa_pack == 1
    assert kv_plan(alibi=True, gpu=A100).gqa_pack == 1


def test_kvcache_packs_only_one_query_row_and_only_gqa():
    assert kv_plan(seqlen_q=2).gqa_pack == 1
    assert kv_plan(seqlen_q=64, causal=True).gqa_pack == 1
    assert kv_plan(nheads=8, nheads_k=8).gqa_pack == 1
    assert kv_plan(varlen=True).gqa_pack == 1


@pytest.mark.parametrize("nheads_k", [32, 8])
def test_long_decode_splits_keys(nheads_k):
    """Batch 1, one query row, 64k cached keys, 32 heads, head dim 128 on an H200: too few CTAs to fill the GPU
    without key splits."""
    p = kv_plan(batch=1, seqlen_k=65536, nheads=32, nheads_k=nheads_k)
    assert p.num_splits > 1, p
    assert kv_plan(batch=1, seqlen_k=65536, nheads=32, nheads_k=nheads_k, gpu=A100).num_splits > 1


def test_short_cache_is_not_split_and_forced_splits_hold():
    assert kv_plan(batch=1, seqlen_k=512).num_splits == 1
    for splits in (1, 3, 8):
        assert kv_plan(seqlen_k=512, num_splits=splits).num_splits == splits
    # Paged prefill (varlen) never splits.
    assert kv_plan(batch=1, seqlen_k=65536, varlen=True, seqlen_q=4).num_splits == 1


def test_kvcache_kernel_families():
    assert kv_plan().kernel == "wgmma"
    assert kv_plan(override="kernel=mma_sync").kernel == "mma_sync"
    p = kv_plan(gpu=A100)
    assert p.kernel == "mma_sync" and p.variants


@pytest.mark.parametrize(
    "extra",
    [dict(), dict(causal=True), dict(window_size=(1000, 0)), dict(nheads_k=32)],
    ids=["plain", "causal", "window", "mha"],
)
def test_paged_decode_takes_the_short_key_tile(extra):
    """On Hopper at head dim 128, decoding from a paged cache (queries within one 64-row warpgroup, after GQA
    packing) runs the 64-row, two-CTAs-per-SM tile; the dense cache keeps the 128-row tile."""
    args = dict(batch=1, seqlen_k=65536) | extra
    paged = kv_plan(paged=True, **args)
    assert paged.short_key_tile and (paged.block_m, paged.block_n) == (64, 64), paged
    dense = kv_plan(**args)
    assert not dense.short_key_tile and (dense.block_m, dense.block_n) == (128, 128), dense
    assert not kv_plan(paged=True, override="short_keys=0", **args).short_key_tile


def test_paged_short_key_tile_only_where_it_applies():
    assert kv_plan(paged=True, seqlen_q=16).short_key_tile  # 16 query rows (no packing past one row)
    assert kv_plan(paged=True, nheads=64, nheads_k=1).short_key_tile  # one row, 64 heads packed: 64 rows
    assert not kv_plan(paged=True, nheads=65, nheads_k=1).short_key_tile  # 65 packed rows
    assert not kv_plan(paged=True, seqlen_q=65).short_key_tile
    assert kv_plan(paged=True, varlen=True, seqlen_q=8, seqlen_k=65536).short_key_tile  # paged prefill, short
    assert not kv_plan(paged=True, varlen=True, seqlen_q=512, seqlen_k=65536).short_key_tile
    assert not kv_plan(paged=True, head_dim=64).short_key_tile  # no such tile at head dim 64
    assert not kv_plan(paged=True, gpu=A100).short_key_tile  # mma.sync
    assert not kv_plan(paged=True, override="kernel=mma_sync").short_key_tile
    with pytest.raises((ValueError, RuntimeError), match="paged"):
        plan("fwd", batch=1, seqlen_q=1, seqlen_k=128, nheads=4, nheads_k=4, head_dim=64, paged=True, **H200)


def test_kvcache_plan_is_forward_only():
    with pytest.raises((ValueError, RuntimeError), match="kvcache"):
        plan("bwd", batch=1, seqlen_q=1, seqlen_k=128, nheads=4, nheads_k=4, head_dim=64, kvcache=True, **H200)


# ---------------------------------------------------------------- schema and fake implementation


def test_fwd_kvcache_schema_mutates_the_caches():
    schema = torch.ops.flash_attn2.fwd_kvcache.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache"}, written
    names = [a.name for a in schema.arguments]
    assert names[:11] == [
        "q",
        "k_cache",
        "v_cache",
        "k",
        "v",
        "rotary_cos",
        "rotary_sin",
        "cache_seqlens",
        "cache_batch_idx",
        "cache_leftpad",
        "block_table",
    ], names
    assert [r.name for r in schema.returns] == ["out", "softmax_lse"]
    assert all(r.alias_info is None for r in schema.returns)


def test_varlen_fwd_paged_schema_mutates_nothing():
    schema = torch.ops.flash_attn2.varlen_fwd_paged.default._schema
    assert all(a.alias_info is None for a in schema.arguments), str(schema)
    assert "Tensor block_table" in str(schema)


def test_flash_attn_with_kvcache_is_exported():
    assert "flash_attn_with_kvcache" in flash_attn_cuda.__all__
    assert flash_attn_cuda.flash_attn_with_kvcache is flash_attn_with_kvcache


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("append", [False, True], ids=["read-only", "append"])
def test_fake_fwd_kvcache(append, paged):
    with FakeTensorMode():
        q = torch.randn(3, 5, 8, 64, dtype=torch.bfloat16, device="cuda")
        shape = (10, 16, 2, 64) if paged else (3, 96, 2, 64)
        k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        k = v = None
        if append:
            k, v = (torch.randn(3, 2, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        seqlens = torch.zeros(3, dtype=torch.int32, device="cuda")
        table = torch.zeros(3, 3, dtype=torch.int32, device="cuda") if paged else None
        out, lse = torch.ops.flash_attn2.fwd_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, softmax_scale=0.125, causal=True
        )
    assert out.shape == (3, 5, 8, 64) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert lse.shape == (3, 8, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize("head_dim", [64, 100])
def test_fake_flash_attn_with_kvcache(head_dim):
    """The public function under FakeTensorMode, paged, with rotary and an int cache_seqlens; a head dim that is
    not a multiple of 8 goes through the padding path."""
    with FakeTensorMode():
        q = torch.randn(2, 3, 8, head_dim, dtype=torch.float16, device="cuda")
        k_cache, v_cache = (torch.randn(9, 16, 2, head_dim, dtype=torch.float16, device="cuda") for _ in range(2))
        k, v = (torch.randn(2, 3, 2, head_dim, dtype=torch.float16, device="cuda") for _ in range(2))
        table = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
        cos = torch.randn(64, 16, dtype=torch.float16, device="cuda")
        out, lse = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=cos,
            cache_seqlens=5,
            block_table=table,
            causal=True,
            return_softmax_lse=True,
        )
        single = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, block_table=table)
    assert out.shape == (2, 3, 8, head_dim) and out.dtype == torch.float16
    assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32
    assert isinstance(single, torch.Tensor) and single.shape == out.shape


def test_fake_varlen_paged():
    with FakeTensorMode():
        q = torch.randn(11, 6, 64, dtype=torch.bfloat16, device="cuda")
        k_cache, v_cache = (torch.randn(9, 48, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cu_q = torch.zeros(4, dtype=torch.int32, device="cuda")
        cu_k = torch.zeros(4, dtype=torch.int32, device="cuda")
        table = torch.zeros(3, 3, dtype=torch.int32, device="cuda")
        out, lse, probs = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, cu_k, 5, 100, causal=True, return_attn_probs=True, block_table=table
        )
    assert out.shape == (11, 6, 64) and lse.shape == (6, 11) and probs is None


def test_meta_fwd_kvcache():
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    k_cache = torch.randn(2, 256, 1, 128, dtype=torch.bfloat16, device="meta")
    out, lse = torch.ops.flash_attn2.fwd_kvcache(q, k_cache, k_cache.clone())
    assert out.shape == q.shape and lse.shape == (2, 8, 1)


# ---------------------------------------------------------------- argument checks before the device check
#
# On CPU tensors every check of flash_attn_with_kvcache (Python) and of the op (csrc/host/checks.cpp check_kvcache) runs
# before the device check, which then reports "q must be a CUDA tensor": a message that names none of the
# arguments below, so a check that did not fire fails the match.


def base_args(paged=False, dtype=torch.bfloat16):
    """Valid CPU arguments: batch 2, 4 query heads, 2 key/value heads, head dim 64, a dense cache of 64 rows (paged:
    6 pages of 16 rows, 3 per sequence), one new row at cache_seqlens (3, 5)."""
    args = dict(q=torch.randn(2, 1, 4, 64, dtype=dtype))
    if paged:
        args["k_cache"], args["v_cache"] = (torch.randn(6, 16, 2, 64, dtype=dtype) for _ in range(2))
        args["block_table"] = torch.tensor([[0, 1, 2], [5, 4, 3]], dtype=torch.int32)
    else:
        args["k_cache"], args["v_cache"] = (torch.randn(2, 64, 2, 64, dtype=dtype) for _ in range(2))
    args["k"], args["v"] = (torch.randn(2, 1, 2, 64, dtype=dtype) for _ in range(2))
    args["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    return args


def i32(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def rotary(args, rows, pairs, dtype=None):
    args["rotary_cos"], args["rotary_sin"] = (torch.rand(rows, pairs, dtype=dtype or args["q"].dtype) for _ in range(2))


def cpu_randn(*shape):
    return torch.randn(shape, dtype=torch.bfloat16)


# id: (paged base, what to change, what the ValueError's message must name).
BAD_ARGS = {
    "window-one-value": (False, lambda a: a.update(window_size=(1,)), "window_size"),
    "window-three-values": (False, lambda a: a.update(window_size=(1, 2, 3)), "window_size"),
    "window-int": (False, lambda a: a.update(window_size=5), "window_size"),
    "window-below-minus-one": (False, lambda a: a.update(window_size=(-2, 0)), "window_size"),
    "softcap-negative": (False, lambda a: a.update(softcap=-1.0), "softcap"),
    "alibi-shape": (False, lambda a: a.update(alibi_slopes=torch.rand(3)), "alibi_slopes"),
    "page-size-24": (
        True,
        lambda a: a.update(k_cache=cpu_randn(6, 24, 2, 64), v_cache=cpu_randn(6, 24, 2, 64)),
        "page size",
    ),
    "page-size-8": (
        True,
        lambda a: a.update(k_cache=cpu_randn(6, 8, 2, 64), v_cache=cpu_randn(6, 8, 2, 64)),
        "page size",
    ),
    "block-table-int64": (True, lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    "block-table-1d": (True, lambda a: a.update(block_table=a["block_table"].flatten()), "block_table"),
    "block-table-batch": (True, lambda a: a.update(block_table=torch.zeros(3, 3, dtype=torch.int32)), "block_table"),
    "block-table-strided": (
        True,
        lambda a: a.update(block_table=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]),
        "block_table",
    ),
    "cache-seqlens-int-past": (False, lambda a: a.update(cache_seqlens=64), "cache_seqlens"),
    "cache-seqlens-int-past-paged": (True, lambda a: a.update(cache_seqlens=48), "cache_seqlens"),
    "cache-seqlens-int-negative": (False, lambda a: a.update(cache_seqlens=-1), "cache_seqlens"),
    "cache-seqlens-int-no-append": (False, lambda a: a.update(k=None, v=None, cache_seqlens=65), "cache_seqlens"),
    "cache-seqlens-missing": (False, lambda a: a.update(cache_seqlens=None), "cache_seqlens"),
    "cache-seqlens-int64": (False, lambda a: a.update(cache_seqlens=i32(3, 5, dtype=torch.int64)), "cache_seqlens"),
    "cache-seqlens-shape": (False, lambda a: a.update(cache_seqlens=i32(3, 5, 7)), "cache_seqlens"),
    "rotary-dim-over-head-dim": (False, lambda a: rotary(a, 64, 40), "rotary_cos"),
    "rotary-without-k": (False, lambda a: (rotary(a, 64, 16), a.update(k=None, v=None)), "rotary_cos"),
    "rotary-too-few-rows": (False, lambda a: rotary(a, 63, 16), "rotary_cos"),
    "rotary-fp32": (False, lambda a: rotary(a, 64, 16, torch.float32), "rotary_cos"),
    "rotary-sin-shape": (
        False,
        lambda a: (rotary(a, 64, 16), a.update(rotary_sin=a["rotary_sin"][:, :8])),
        "rotary_sin",
    ),
    "k-without-v": (False, lambda a: a.update(v=None), "k and v"),
    "v-without-k": (False, lambda a: a.update(k=None), "k and v"),
    "batch-idx-with-block-table": (True, lambda a: a.update(cache_batch_idx=i32(1, 0)), "cache_batch_idx"),
    "batch-idx-int64": (False, lambda a: a.update(cache_batch_idx=i32(1, 0, dtype=torch.int64)), "cache_batch_idx"),
    "leftpad-shape": (False, lambda a: a.update(cache_leftpad=i32(0, 0, 0)), "cache_leftpad"),
    "k-heads": (False, lambda a: a.update(k=cpu_randn(2, 1, 4, 64), v=cpu_randn(2, 1, 4, 64)), "k must have shape"),
    "v-seqlen": (False, lambda a: a.update(v=cpu_randn(2, 2, 2, 64)), "seqlen_new"),
    "k-dtype": (False, lambda a: a.update(k=a["k"].half()), "k must have the dtype"),
    "k-longer-than-cache": (
        False,
        lambda a: a.update(k=cpu_randn(2, 65, 2, 64), v=cpu_randn(2, 65, 2, 64)),
        "seqlen_new",
    ),
    "cache-batch-rows": (
        False,
        lambda a: a.update(k_cache=cpu_randn(1, 64, 2, 64), v_cache=cpu_randn(1, 64, 2, 64)),
        "k_cache",
    ),
    "v-cache-shape": (False, lambda a: a.update(v_cache=cpu_randn(2, 32, 2, 64)), "v_cache"),
    "cache-dtype": (False, lambda a: a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()), "k_cache"),
    "cache-head-dim": (
        False,
        lambda a: a.update(k_cache=cpu_randn(2, 64, 2, 32), v_cache=cpu_randn(2, 64, 2, 32)),
        "head_dim",
    ),
    "cache-3d": (False, lambda a: a.update(k_cache=cpu_randn(2, 64, 128)), "k_cache"),
    "heads-not-multiple": (False, lambda a: a.update(q=cpu_randn(2, 1, 5, 64)), "nheads"),
    "q-3d": (False, lambda a: a.update(q=cpu_randn(2, 4, 64)), "q must be a 4-D"),
    "q-fp32": (False, lambda a: a.update(q=a["q"].float()), "q must be float16 or bfloat16"),
    "num-splits": (False, lambda a: a.update(num_splits=1000), "num_splits"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_rejects_bad_arguments_before_the_device_check(case):
    paged, change, name = BAD_ARGS[case]
    args = base_args(paged)
    change(args)
    with pytest.raises(ValueError, match=name):
        flash_attn_with_kvcache(**args)


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(cache_leftpad=i32(1, 5), rotary_interleaved=False),
        dict(window_size=(5, 0), softcap=3.0, alibi_slopes=torch.rand(2, 4)),
    ],
    ids=["plain", "leftpad-rotary", "variants"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_valid_arguments_reach_the_device_check(paged, extra):
    """Valid calls pass every check, a page size of 48 (not a power of two) and a rotary dim of 10 included, and
    stop at the device check only."""
    args = base_args(paged)
    if paged:
        args["k_cache"], args["v_cache"] = (torch.randn(6, 48, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    rotary(args, 200, 5)
    args.update(extra)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_with_kvcache(**args)
    args.update(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_with_kvcache(**args)


def test_rotary_cos_without_rotary_sin():
    args = base_args()
    rotary(args, 64, 16)
    args["rotary_sin"] = None
    with pytest.raises(ValueError, match="rotary"):
        flash_attn_with_kvcache(**args)


def varlen_paged_args():
    lens = [5, 9]
    q = torch.randn(14, 4, 64, dtype=torch.bfloat16)
    caches = [torch.randn(4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    table = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    return q, caches, cu, table, max(lens)


def test_varlen_paged_rejects_dropout_and_takes_grad():
    q, (k_cache, v_cache), cu, table, max_len = varlen_paged_args()
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max_len, max_len, dropout_p=0.1, block_table=table)
    # A q that requires grad is no reason to refuse the forward (only a backward through it is): the call gets as
    # far as the op's device check, with grad mode on and off.
    q.requires_grad_()
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max_len, max_len, block_table=table)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max_len, max_len, block_table=table)


# ---------------------------------------------------------------- paged varlen autograd


def paged_attention_on_cpu(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    block_table,
    softmax_scale,
    causal,
    plan_override="",
    window_left=-1,
    window_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    learnable_sink=None,
):
    """A CPU kernel for varlen_fwd_paged (its schema, its outputs): attention_ref on each sequence's keys gathered
    from its pages. It lets the autograd around the op run on the CPU, eagerly and under torch.compile."""
    outs, lses = [], []
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(block_table.shape[0]):
        pages = block_table[b].long()
        n = starts_k[b + 1] - starts_k[b]
        k, v = (cache[pages].flatten(0, 1)[None, :n] for cache in (k_cache, v_cache))
        out, lse = attention_ref(
            q[None, starts_q[b] : starts_q[b + 1]],
            k,
            v,
            softmax_scale,
            causal,
            window_size=(window_left, window_right),
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            learnable_sink=learnable_sink,
        )
        outs.append(out[0].to(q.dtype))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.fixture
def paged_cpu_kernel():
    """varlen_fwd_paged runs paged_attention_on_cpu on CPU tensors for the duration of the test (the registration is
    dropped afterwards, and the op's own CPU kernel, which refuses CPU tensors, is back)."""
    with torch.library._scoped_library("flash_attn2", "IMPL") as lib:
        lib.impl("varlen_fwd_paged", paged_attention_on_cpu, "CPU")
        yield


def paged_grad_inputs(grad_of, sink_name="learnable_sink"):
    """(inputs, call): paged varlen inputs on the CPU, those named in grad_of requiring grad ("q", "k", "v",
    "sink"), and call(**inputs) -> (out, lse) through flash_attn_varlen_func, with the sink under sink_name."""
    q, (k_cache, v_cache), cu, table, max_len = varlen_paged_args()
    sink = torch.randn(q.shape[1])
    inputs = dict(q=q, k=k_cache, v=v_cache, sink=sink)
    for name in grad_of:
        inputs[name].requires_grad_()

    def call(q, k, v, sink):
        out, lse, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu,
            max_len,
            max_len,
            causal=True,
            return_attn_probs=True,
            block_table=table,
            **{sink_name: sink},
        )
        return out, lse

    return inputs, call


GRAD_OF = {"q": ("q",), "k": ("k",), "v": ("v",), "sink": ("sink",), "all": ("q", "k", "v", "sink")}


@pytest.mark.parametrize("sink_name", ["learnable_sink", "s_aux"])
@pytest.mark.parametrize("grad_of", list(GRAD_OF))
def test_varlen_paged_forward_with_grad_then_backward_raises(grad_of, sink_name, paged_cpu_kernel):
    # flash-attn 2.x's tests run the paged forward with inputs that require grad and skip only its backward: the
    # forward runs, its outputs carry a grad_fn (so out.sum() and the like work), are those of the same call without
    # grad, and a backward through either output raises, naming block_table and the sink under both its names.
    inputs, call = paged_grad_inputs(GRAD_OF[grad_of], sink_name)
    out, lse = call(**inputs)
    assert out.grad_fn is not None and lse.grad_fn is not None
    with torch.no_grad():
        out_ref, lse_ref = call(**inputs)
    assert out_ref.grad_fn is None
    assert torch.equal(out.detach(), out_ref) and torch.equal(lse.detach(), lse_ref)
    # The stand-in kernel is right: the same attention on dense keys, gathered from the pages by hand.
    rows = inputs["k"].detach()[[0, 1, 3, 2]].flatten(0, 1)
    v_rows = inputs["v"].detach()[[0, 1, 3, 2]].flatten(0, 1)
    first, _ = attention_ref(
        inputs["q"].detach()[None, :5], rows[None, :5], v_rows[None, :5], causal=True, learnable_sink=inputs["sink"]
    )
    assert torch.equal(out_ref[:5], first[0].to(out_ref.dtype))
    loss = out.float().sum() + lse.sum()
    for target in (loss, lse.sum()):
        with pytest.raises(RuntimeError, match="block_table") as raised:
            target.backward(retain_graph=True)
        assert "learnable_sink (s_aux)" in str(raised.value)
    leaves = [inputs[name] for name in GRAD_OF[grad_of]]
    assert all(t.grad is None for t in leaves)


def test_varlen_paged_grad_off_records_nothing(paged_cpu_kernel):
    inputs, call = paged_grad_inputs(())
    out, lse = call(**inputs)
    assert not out.requires_grad and not lse.requires_grad
    inputs, call = paged_grad_inputs(("q", "k", "v", "sink"))
    with torch.inference_mode():
        out, _ = call(**inputs)
    assert not out.requires_grad


def test_varlen_paged_backward_message_survives_a_cache_write(paged_cpu_kernel):
    # The node keeps no tensor: a cache written in place after the forward (the next decoding step) would otherwise
    # fail autograd's version check first, with a message about in-place writes rather than block_table.
    q, (k_cache, v_cache), cu, table, max_len = varlen_paged_args()
    k_leaf = k_cache.clone().requires_grad_()
    k_used = k_leaf * 1.0  # a non-leaf cache that requires grad, written in place below
    out = flash_attn_varlen_func(q, k_used, v_cache, cu, cu, max_len, max_len, block_table=table)
    with torch.no_grad():
        k_used[0].zero_()
    with pytest.raises(RuntimeError, match="block_table"):
        out.sum().backward()


def test_varlen_paged_op_backward_raises(paged_cpu_kernel):
    # The op called directly, through its registered autograd (not the public function's eager path).
    q, (k_cache, v_cache), cu, table, max_len = varlen_paged_args()
    out, lse = torch.ops.flash_attn2.varlen_fwd_paged(
        q, k_cache.requires_grad_(), v_cache, cu, cu, max_len, max_len, table, 0.125, False
    )
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="block_table"):
        torch.autograd.grad(out.sum(), k_cache)


@pytest.mark.parametrize("grad_of", ["q", "k", "sink"])
def test_varlen_paged_backward_raises_under_compile(grad_of, paged_cpu_kernel):
    # torch.compile traces the backward with the forward as soon as an input requires grad; the error is an op in
    # the traced backward, so the forward compiles and runs, and the compiled backward raises when it runs.
    torch._dynamo.reset()
    inputs, call = paged_grad_inputs(GRAD_OF[grad_of])
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    out, lse = compiled(**inputs)
    with torch.no_grad():
        out_ref, lse_ref = call(**inputs)
    assert torch.equal(out.detach(), out_ref) and torch.equal(lse.detach(), lse_ref)
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="block_table"):
        (out.float().sum() + lse.sum()).backward()


def test_paged_no_backward_op():
    # Raises whenever it runs; its fake gives the scalar that the traced gradients are views of.
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.flash_attn2.paged_no_backward(torch.ones(3))
    with FakeTensorMode():
        anchor = torch.ops.flash_attn2.paged_no_backward(torch.ones(3, dtype=torch.bfloat16))
    assert anchor.shape == () and anchor.dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["page-size", "table-batch", "max-seqlen-k", "table-int64"])
def test_varlen_paged_rejects_bad_arguments(case):
    q, (k_cache, v_cache), cu, table, max_len = varlen_paged_args()
    max_k, name = max_len, None
    if case == "page-size":
        k_cache, v_cache, name = k_cache[:, :8].contiguous(), v_cache[:, :8].contiguous(), "page size"
    elif case == "table-batch":
        table, name = table[:1], "block_table"
    elif case == "max-seqlen-k":
        max_k, name = 33, "max_seqlen_k"  # the table holds 2 pages of 16 rows per sequence
    else:
        table, name = table.long(), "block_table"
    with pytest.raises(ValueError, match=name):
        flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max_len, max_k, block_table=table)
