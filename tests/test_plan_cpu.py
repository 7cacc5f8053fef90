"""Launch plans on the CPU: the heuristics and overrides of torch.ops.flash_attn2.plan for a given GPU.

With ``arch`` and ``num_sms`` given, the plan is computed for that GPU and a build with every kernel family, so
these tests need the built extension but no GPU and no kernel (CI builds head dim 64 bf16 for sm_80 only).
H200 is (90, 132 SMs), A100 (80, 108). Tile sizes and shared memory are asserted only where csrc/launch/tile_size.h
defines them for the host (its shared-memory formulas are static_asserted against the kernels' own by the
launchers).
"""

import itertools

import pytest
import torch
from conftest import load_generator

import flash_attn_cuda
from flash_attn_cuda import _kernel_list, flash_attn_func, flash_attn_varlen_func
from flash_attn_cuda.plan import Plan, force_plan, forced, override_string, plan

H200 = {"arch": 90, "num_sms": 132}
A100 = {"arch": 80, "num_sms": 108}
# Errors for a malformed plan_override or num_splits; what matters is that the message names the argument.
BAD_ARGUMENT = (ValueError, RuntimeError)


def make(
    pass_="fwd",
    gpu=H200,
    *,
    batch=2,
    seqlen_q=512,
    seqlen_k=512,
    nheads=8,
    nheads_k=8,
    head_dim=128,
    causal=False,
    deterministic=False,
    varlen=False,
    num_splits=0,
    override=None,
    **choices,
) -> Plan:
    """The plan on ``gpu`` (H200 unless told), the override given as a string or as override_string keywords; the
    variants (``window_size``, ``softcap``, ``alibi``, ``dropout``) as plan takes them."""
    variants = {key: choices.pop(key) for key in ("window_size", "softcap", "alibi", "dropout") if key in choices}
    if override is None:
        override = override_string(**choices)
    p = plan(
        pass_,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        causal=causal,
        deterministic=deterministic,
        varlen=varlen,
        num_splits=num_splits,
        override=override,
        **variants,
        **gpu,
    )
    assert isinstance(p, Plan) and p.pass_ == pass_, p
    return p


# ---------------------------------------------------------------- kernel family


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("arch, kernel", [(80, "mma_sync"), (86, "mma_sync"), (89, "mma_sync"), (90, "wgmma")])
def test_kernel_family_per_arch(pass_, arch, kernel):
    assert make(pass_, {"arch": arch, "num_sms": 100}).kernel == kernel


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_kernel_override(pass_):
    assert make(pass_, kernel="mma_sync").kernel == "mma_sync"
    assert make(pass_, kernel="wgmma").kernel == "wgmma"
    assert make(pass_, override="kernel=mma_sync").kernel == "mma_sync"


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_wgmma_override_off_hopper(pass_):
    # The Hopper kernels exist for sm_90 only: forcing them elsewhere is refused or not taken.
    try:
        p = make(pass_, A100, kernel="wgmma")
    except BAD_ARGUMENT as error:
        assert "plan_override" in str(error)
    else:
        assert p.kernel == "mma_sync"


def test_deterministic_backward_on_hopper_runs_the_hopper_kernels_by_default():
    # Head dims 64 and 128 run the warp-specialized kernel, 160 to 256 the wide one, as a forced kernel=wgmma does;
    # 32 and 96 (the narrow kernel only, which has no fixed dQ order) and other GPUs run the mma.sync kernel.
    for head_dim in (32, 64, 96, 128, 160, 256):
        for causal in (False, True):
            default = make("bwd", head_dim=head_dim, causal=causal, deterministic=True)
            assert default == make("bwd", head_dim=head_dim, causal=causal, deterministic=True, kernel="wgmma")
            assert default.kernel == ("mma_sync" if head_dim in (32, 96) else "wgmma"), default
            assert default.warp_specialized is (head_dim in (64, 128)), default
            forced = make("bwd", head_dim=head_dim, causal=causal, deterministic=True, kernel="mma_sync")
            assert forced.kernel == "mma_sync", forced
    assert make("bwd", A100, deterministic=True).kernel == "mma_sync"
    assert make("bwd", A100, deterministic=True, kernel="wgmma").kernel == "mma_sync"
    # Deterministic mode is a backward matter.
    assert make("fwd", deterministic=True).kernel == "wgmma"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 512), (100, 300), (512, 512), (8192, 8192), (300, 5000)])
def test_deterministic_backward_on_hopper_runs_the_warp_specialized_kernel(seqlen_q, seqlen_k, head_dim, causal):
    # Forced to Hopper, plain calls at head dims 64 and 128 run it at every length and whatever else is forced: its
    # key blocks add into dQ in a fixed order, the narrow kernel's do not.
    sizes = dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal, deterministic=True)
    for choices in ({}, {"ws": False}, {"key_blocks": 2}, {"short_queries": True}):
        p = make("bwd", **sizes, kernel="wgmma", **choices)
        assert p.kernel == "wgmma" and p.warp_specialized, (choices, p)
        assert p.key_blocks_per_cta == 1 and not p.short_query_tile and p.gqa_pack == 1, (choices, p)
    # One query row with GQA: not packed, which that kernel does not do.
    p = make(
        "bwd", seqlen_q=1, nheads=32, nheads_k=4, head_dim=head_dim, causal=causal, deterministic=True, kernel="wgmma"
    )
    assert p.warp_specialized and p.gqa_pack == 1, p


VARIANT_FLAGS = ({"window_size": (64, 0)}, {"softcap": 30.0}, {"alibi": True}, {"dropout": True})


def test_hopper_runs_the_mma_sync_backward_by_default_only_where_the_build_says():
    # The release build leaves out the sm_90a SASS of the mma.sync backward at head dims outside
    # HOPPER_BWD_MMA_SYNC_HEAD_DIMS (csrc/generate.py, read by setup.py): Hopper must never pick it there unless
    # told to, in any mode; at the head dims listed it does somewhere (deterministic mode), or the list is stale.
    listed = set(load_generator().HOPPER_BWD_MMA_SYNC_HEAD_DIMS)
    for head_dim in _kernel_list.HEAD_DIMS:
        kernels = set()
        for causal, deterministic, variant, (seqlen_q, seqlen_k), nheads_k in itertools.product(
            (False, True), (False, True), ({}, *VARIANT_FLAGS), ((512, 512), (1, 70000), (70000, 70000)), (8, 1)
        ):
            sizes = dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_k=nheads_k, head_dim=head_dim)
            kernels.add(make("bwd", causal=causal, deterministic=deterministic, **sizes, **variant).kernel)
        assert ("mma_sync" in kernels) == (head_dim in listed), (head_dim, kernels)


@pytest.mark.parametrize("head_dim", [160, 192, 224, 256])
def test_deterministic_backward_wide_head_dims_run_the_wide_kernel(head_dim):
    # Forced to Hopper: its key blocks take turns too, variants included.
    for causal in (False, True):
        for variant in ({}, *VARIANT_FLAGS):
            p = make("bwd", head_dim=head_dim, causal=causal, deterministic=True, kernel="wgmma", **variant)
            assert p.kernel == "wgmma" and not p.warp_specialized and p.key_blocks_per_cta == 1, (variant, p)
    p = make("bwd", seqlen_q=1, nheads=32, nheads_k=4, head_dim=head_dim, deterministic=True, kernel="wgmma")
    assert p.kernel == "wgmma" and p.gqa_pack == 1, p


def test_deterministic_backward_elsewhere_runs_mma_sync():
    # Forced to Hopper: head dims 32 and 96 (the narrow kernel only), and the variants at head dims 64 and 128,
    # still run the mma.sync kernel.
    for head_dim in (32, 96):
        assert make("bwd", head_dim=head_dim, deterministic=True, kernel="wgmma").kernel == "mma_sync", head_dim
    for head_dim in (64, 128):
        for variant in VARIANT_FLAGS:
            p = make("bwd", head_dim=head_dim, deterministic=True, causal=True, kernel="wgmma", **variant)
            assert p.kernel == "mma_sync", (variant, p)
            assert make("bwd", head_dim=head_dim, causal=True, **variant).kernel == "wgmma", variant


def test_deterministic_causal_backward_fits_the_key_block_pairs_in_one_round():
    # Under a causal mask a key block waits for later ones of its (sequence, head): every pair of 128-key blocks
    # needs an SM of its own at once.
    for gpu, sms in ((H200, 132), ({"arch": 90, "num_sms": 78}, 78)):
        det = dict(deterministic=True, kernel="wgmma")
        fits = make("bwd", gpu, seqlen_k=2 * sms * 128, causal=True, **det)
        assert fits.kernel == "wgmma" and fits.warp_specialized, fits
        assert make("bwd", gpu, seqlen_k=2 * sms * 128 + 1, causal=True, **det).kernel == "mma_sync"
        unmasked = make("bwd", gpu, seqlen_k=2 * sms * 128 + 1, **det)
        assert unmasked.kernel == "wgmma" and unmasked.warp_specialized, unmasked


@pytest.mark.parametrize("head_dim", [160, 192, 224, 256])
def test_staggered_wide_backward(head_dim):
    # The wide kernel without a mask or variants staggers its key blocks in deterministic mode, where every key
    # block of a sequence fits the SMs at once; elsewhere only where forced, and never under a mask.
    det = make("bwd", seqlen_k=8192, head_dim=head_dim, deterministic=True)
    assert det.kernel == "wgmma" and not det.warp_specialized and det.staggered, det
    for gpu, sms in ((H200, 132), ({"arch": 90, "num_sms": 78}, 78)):
        fits = make("bwd", gpu, seqlen_k=sms * det.block_n, head_dim=head_dim, deterministic=True)
        assert fits.staggered, fits
        assert not make("bwd", gpu, seqlen_k=sms * det.block_n + 1, head_dim=head_dim, deterministic=True).staggered
        forced = make("bwd", gpu, seqlen_k=sms * det.block_n + 1, head_dim=head_dim, deterministic=True, stagger=True)
        assert not forced.staggered, forced
    assert not make("bwd", seqlen_k=8192, head_dim=head_dim).staggered
    assert make("bwd", seqlen_k=65536, head_dim=head_dim, stagger=True).staggered
    assert not make("bwd", seqlen_k=8192, head_dim=head_dim, deterministic=True, stagger=False).staggered
    for unstaggered in (
        make("bwd", seqlen_k=8192, head_dim=head_dim, deterministic=True, causal=True, stagger=True),
        make("bwd", seqlen_k=8192, head_dim=head_dim, deterministic=True, kernel="mma_sync", stagger=True),
        make("bwd", A100, seqlen_k=8192, head_dim=head_dim, deterministic=True, stagger=True),
        make("fwd", seqlen_k=8192, head_dim=head_dim, stagger=True),
        *(make("bwd", seqlen_k=8192, head_dim=head_dim, deterministic=True, stagger=True, **v) for v in VARIANT_FLAGS),
        make("bwd", seqlen_k=8192, head_dim=head_dim, window_size=(512, 512), stagger=True),
    ):
        assert not unstaggered.staggered, unstaggered
    # The narrow and warp-specialized kernels keep their walk.
    for narrow_head_dim in (64, 96, 128):
        assert not make("bwd", head_dim=narrow_head_dim, deterministic=True, stagger=True).staggered
        assert not make("bwd", head_dim=narrow_head_dim, stagger=True).staggered


# ---------------------------------------------------------------- one query row: causal dropped, GQA packed


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
def test_causal_is_noop_for_one_query_row(pass_, gpu):
    assert make(pass_, gpu, seqlen_q=1, seqlen_k=300, causal=True).causal is False
    assert make(pass_, gpu, seqlen_q=2, seqlen_k=300, causal=True).causal is True
    assert make(pass_, gpu, seqlen_q=300, seqlen_k=300, causal=True).causal is True
    assert make(pass_, gpu, seqlen_q=1, seqlen_k=300, causal=False).causal is False
    # Varlen: the maximum is 1, but the rule is for dense calls.
    assert make(pass_, gpu, seqlen_q=1, seqlen_k=300, causal=True, varlen=True).causal is True


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_packing_of_one_query_row(pass_, gpu, causal):
    assert make(pass_, gpu, seqlen_q=1, nheads=32, nheads_k=4, causal=causal).gqa_pack == 8
    assert make(pass_, gpu, seqlen_q=1, nheads=8, nheads_k=1, causal=causal).gqa_pack == 8
    assert make(pass_, gpu, seqlen_q=1, nheads=8, nheads_k=8, causal=causal).gqa_pack == 1
    assert make(pass_, gpu, seqlen_q=2, nheads=32, nheads_k=4, causal=causal).gqa_pack == 1
    assert make(pass_, gpu, seqlen_q=1, nheads=32, nheads_k=4, causal=causal, varlen=True).gqa_pack == 1


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_gqa_pack_override(pass_):
    # 0 turns packing off; 1 is the default, which packs only where the kernels can (one dense query row).
    assert make(pass_, seqlen_q=1, nheads=32, nheads_k=4, gqa_pack=False).gqa_pack == 1
    assert make(pass_, seqlen_q=1, nheads=32, nheads_k=4, gqa_pack=True).gqa_pack == 8
    assert make(pass_, seqlen_q=2, nheads=32, nheads_k=4, gqa_pack=True).gqa_pack == 1
    decode = {"batch": 2, "seqlen_q": 1, "seqlen_k": 512, "nheads": 32, "nheads_k": 4, "head_dim": 128, "kvcache": True}
    assert plan("fwd", **decode, **H200).gqa_pack == 8
    assert plan("fwd", **decode, override="gqa_pack=0", **H200).gqa_pack == 1
    with pytest.raises(BAD_ARGUMENT, match="gqa_pack"):
        make(pass_, override="gqa_pack=2")


def test_packed_backward_has_no_gqa_left():
    # Packed, dK and dV come out per key/value head: no group walk and no fp32 slices, whatever is forced.
    for walk in (None, True, False):
        p = make("bwd", seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=4, gqa_walk=walk)
        assert p.gqa_pack == 8 and p.heads_per_cta == 1 and not p.dkv_fp32_slices, p


# ---------------------------------------------------------------- split-KV


DECODE = dict(batch=1, seqlen_q=1, seqlen_k=16384, nheads=16, nheads_k=16, head_dim=128)


@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_heuristic_splits_small_grids(gpu, causal):
    p = make("fwd", gpu, **DECODE, causal=causal)
    assert 1 < p.num_splits <= 128, p
    assert p.num_splits <= DECODE["seqlen_k"] // 256, p  # at least 256 keys per split
    # Short queries against long keys, and GQA decoding (packed: 2 x 4 CTAs of one query block).
    assert make("fwd", gpu, batch=1, seqlen_q=17, seqlen_k=4097, nheads=4, nheads_k=4, causal=causal).num_splits > 1
    assert make("fwd", gpu, batch=2, seqlen_q=1, seqlen_k=4097, nheads=32, nheads_k=4, causal=causal).num_splits > 1


@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
def test_split_heuristic_leaves_large_grids(gpu):
    assert make("fwd", gpu, batch=8, seqlen_q=4096, seqlen_k=4096, nheads=32, nheads_k=32).num_splits == 1
    assert make("fwd", gpu, batch=8, seqlen_q=4096, seqlen_k=4096, nheads=32, nheads_k=32, causal=True).num_splits == 1
    # Decoding over many sequences and heads fills the GPU by itself.
    assert make("fwd", gpu, batch=64, seqlen_q=1, seqlen_k=16384, nheads=32, nheads_k=32).num_splits == 1


def test_split_heuristic_needs_1024_keys():
    below = dict(DECODE, seqlen_k=1023)
    assert make("fwd", **below).num_splits == 1
    assert make("fwd", **dict(DECODE, seqlen_k=1024)).num_splits > 1
    assert make("fwd", **dict(DECODE, seqlen_k=64)).num_splits == 1


def test_no_split_for_varlen_or_backward():
    assert make("fwd", **DECODE, varlen=True).num_splits == 1
    assert make("fwd", **DECODE, varlen=True, num_splits=3).num_splits == 1
    assert make("bwd", **DECODE).num_splits == 1
    assert make("bwd", **DECODE, num_splits=3).num_splits == 1


@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 128])
def test_forced_splits(gpu, splits):
    assert make("fwd", gpu, **DECODE, num_splits=splits).num_splits == splits
    # Also where the heuristic would not split, and with splits that get no key block at all.
    assert make("fwd", gpu, batch=8, seqlen_q=2048, seqlen_k=64, num_splits=splits).num_splits == splits


def test_forced_splits_capped_so_the_grid_fits():
    # The launch grid's x is query blocks times splits, at most 2^31 - 1.
    seqlen_q = 2**31 - 1
    p = make("fwd", batch=1, seqlen_q=seqlen_q, seqlen_k=64, nheads=1, nheads_k=1, num_splits=128)
    assert 1 <= p.num_splits < 128, p
    assert p.num_splits * -(-seqlen_q // p.block_m) <= 2**31 - 1, p


@pytest.mark.parametrize("splits", [129, 1000, -1])
def test_num_splits_out_of_range_rejected(splits):
    with pytest.raises(BAD_ARGUMENT, match="num_splits"):
        make("fwd", **DECODE, num_splits=splits)


# ---------------------------------------------------------------- Hopper short-key forward tile


@pytest.mark.parametrize(
    "head_dim, causal, seqlen_k, short",
    [
        (128, False, 512, True),
        (128, False, 513, False),
        (128, True, 1024, True),
        (128, True, 1025, False),
        (104, False, 100, True),
        (128, True, 17, True),
        (96, False, 100, False),
        (64, False, 100, False),
        (160, True, 100, False),
        (256, False, 100, False),
    ],
)
def test_short_key_tile_heuristic(head_dim, causal, seqlen_k, short):
    # 64 queries: too few for the warp-specialized kernel's two consumer warpgroups, which would otherwise run.
    p = make("fwd", seqlen_q=64, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal)
    assert p.kernel == "wgmma" and p.short_key_tile is short and not p.warp_specialized, p
    if short:  # tile_size.h, the wgmma forward's short-key tile: 64 query rows, 64-key blocks
        assert (p.block_m, p.block_n) == (64, 64), p
    # Where the warp-specialized kernel runs (persistent, so it overlaps a tile's loads with the previous tile's
    # work itself), it runs instead; varlen calls, which it does not serve, keep the short-key tile.
    dense = make("fwd", batch=16, seqlen_q=256, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal)
    assert dense.warp_specialized and not dense.short_key_tile, dense
    assert (
        make("fwd", seqlen_q=128, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal, varlen=True).short_key_tile
        is short
    )
    # Never in the backward, never on mma.sync.
    assert not make("bwd", seqlen_q=128, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal).short_key_tile
    assert not make("fwd", A100, seqlen_q=128, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal).short_key_tile


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_short_key_tile_forced(causal):
    assert make("fwd", seqlen_k=16384, causal=causal, short_keys=True).short_key_tile
    assert not make("fwd", seqlen_k=16384, causal=causal).short_key_tile
    assert not make("fwd", seqlen_k=64, causal=causal, short_keys=False).short_key_tile
    assert make("fwd", seqlen_q=64, seqlen_k=64, causal=causal).short_key_tile
    assert not make("fwd", seqlen_k=64, causal=causal).short_key_tile  # the warp-specialized kernel's
    # Only head dim 128 has the tile, and under a causal mask the warp-specialized kernel at head dims 64 and 256
    # (its own short-key tile); mma.sync has none.
    for head_dim in (64, 256):
        p = make("fwd", seqlen_k=64, head_dim=head_dim, causal=causal, short_keys=True)
        assert p.short_key_tile is causal and p.warp_specialized is causal, p
    assert not make("fwd", seqlen_k=64, head_dim=192, causal=causal, short_keys=True).short_key_tile
    assert not make("fwd", A100, seqlen_k=64, causal=causal, short_keys=True).short_key_tile
    p = make("fwd", seqlen_k=64, causal=causal, short_keys=True, kernel="mma_sync")
    assert p.kernel == "mma_sync" and not p.short_key_tile, p


# ---------------------------------------------------------------- Hopper short-query backward tile


@pytest.mark.parametrize(
    "head_dim, seqlen_q, short",
    [
        (128, 1, True),
        (128, 16, True),
        (128, 17, False),
        (128, 1000, False),
        (104, 5, True),
        (96, 1, False),
        (64, 1, False),
        (160, 16, False),
        (256, 1, False),
    ],
)
def test_short_query_tile_heuristic(head_dim, seqlen_q, short):
    p = make("bwd", seqlen_q=seqlen_q, seqlen_k=4096, head_dim=head_dim)
    assert p.kernel == "wgmma" and p.short_query_tile is short, p
    if head_dim > 96 and head_dim <= 128:  # tile_size.h: 16 rows per step on the short tile, else 64
        assert p.block_m == (16 if short else 64), p
    assert not make("fwd", seqlen_q=seqlen_q, seqlen_k=4096, head_dim=head_dim).short_query_tile
    assert not make("bwd", A100, seqlen_q=seqlen_q, seqlen_k=4096, head_dim=head_dim).short_query_tile


def test_short_query_tile_forced():
    assert make("bwd", seqlen_q=1000, short_queries=True).short_query_tile
    assert not make("bwd", seqlen_q=1, short_queries=False).short_query_tile
    assert not make("bwd", seqlen_q=1000, head_dim=64, short_queries=True).short_query_tile
    assert not make("bwd", seqlen_q=1000, head_dim=256, short_queries=True).short_query_tile
    assert not make("bwd", A100, seqlen_q=1000, short_queries=True).short_query_tile
    assert not make("bwd", seqlen_q=1000, deterministic=True, short_queries=True).short_query_tile
    assert make("bwd", seqlen_q=1000, deterministic=True, short_queries=True, kernel="wgmma").warp_specialized
    assert not make("bwd", seqlen_q=1000, kernel="mma_sync", short_queries=True).short_query_tile


# ---------------------------------------------------------------- Hopper GQA walks and fp32 dK/dV slices

GQA = dict(batch=2, seqlen_q=200, nheads=8, nheads_k=2)


@pytest.mark.parametrize(
    "head_dim, seqlen_k, num_sms, walk",
    [
        (128, 4100, 132, True),  # 33 key blocks of 128 x 2 sequences x 2 key/value heads = 132 CTAs
        (128, 4096, 132, False),  # 128 CTAs
        (128, 4096, 128, True),
        (64, 4100, 132, True),
        (256, 2112, 132, True),  # 33 key blocks of 64 keys above head dim 128
        (256, 2048, 132, False),
    ],
)
def test_gqa_walk_by_grid_size(head_dim, seqlen_k, num_sms, walk):
    p = make("bwd", {"arch": 90, "num_sms": num_sms}, **GQA, seqlen_k=seqlen_k, head_dim=head_dim)
    assert p.heads_per_cta == (4 if walk else 1), p
    assert p.dkv_fp32_slices is (not walk), p


@pytest.mark.parametrize("head_dim", [32, 128, 192, 256])
def test_gqa_walk_forced(head_dim):
    p = make("bwd", **GQA, seqlen_k=300, head_dim=head_dim, gqa_walk=True)
    assert p.heads_per_cta == 4 and not p.dkv_fp32_slices, p
    p = make("bwd", **dict(GQA, nheads_k=1), seqlen_k=300, head_dim=head_dim, gqa_walk=True)
    assert p.heads_per_cta == 8 and not p.dkv_fp32_slices, p
    p = make("bwd", **GQA, seqlen_k=16384, head_dim=head_dim, gqa_walk=False)
    assert p.heads_per_cta == 1 and p.dkv_fp32_slices, p


def test_gqa_walk_only_on_hopper_gqa():
    # MHA: nothing to walk, nothing to sum.
    p = make("bwd", **dict(GQA, nheads_k=8), seqlen_k=16384, gqa_walk=True)
    assert p.heads_per_cta == 1 and not p.dkv_fp32_slices, p
    # GQA without a walk: fp32 slices.
    for p in (
        make("bwd", A100, **GQA, seqlen_k=16384, gqa_walk=True),
        make("bwd", **GQA, seqlen_k=16384, head_dim=96, deterministic=True, gqa_walk=True),
        make("bwd", **GQA, seqlen_k=16384, kernel="mma_sync", gqa_walk=True),
    ):
        assert p.kernel == "mma_sync" and p.heads_per_cta == 1 and p.dkv_fp32_slices, p
    # Deterministic mode walks too (the warp-specialized kernel), or writes fp32 slices where forced not to.
    p = make("bwd", **GQA, seqlen_k=16384, deterministic=True, kernel="wgmma", gqa_walk=True)
    assert p.warp_specialized and p.heads_per_cta == 4 and not p.dkv_fp32_slices, p
    p = make("bwd", **GQA, seqlen_k=16384, deterministic=True, kernel="wgmma", gqa_walk=False)
    assert p.warp_specialized and p.heads_per_cta == 1 and p.dkv_fp32_slices, p
    # The forward has neither.
    p = make("fwd", **GQA, seqlen_k=16384, gqa_walk=True)
    assert p.heads_per_cta == 1 and not p.dkv_fp32_slices, p


# ---------------------------------------------------------------- Hopper key blocks per backward CTA


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 256])
@pytest.mark.parametrize("key_blocks", [2, 3])
def test_key_blocks_forced(head_dim, key_blocks):
    # Also more key blocks per CTA than the keys have (200 keys: 2 blocks of 128, 4 of 64).
    # A forced walk runs the narrow kernel (the warp-specialized one runs one key block per tile).
    p = make("bwd", seqlen_q=300, seqlen_k=200, head_dim=head_dim, key_blocks=key_blocks)
    assert not p.warp_specialized, p
    assert p.key_blocks_per_cta == (key_blocks if head_dim <= 128 else 1), p
    assert make("bwd", A100, head_dim=head_dim, key_blocks=key_blocks).key_blocks_per_cta == 1
    assert make("bwd", head_dim=head_dim, deterministic=True, key_blocks=key_blocks).key_blocks_per_cta == 1
    assert make("fwd", head_dim=head_dim, key_blocks=key_blocks).key_blocks_per_cta == 1


@pytest.mark.parametrize("seqlen_q", [1, 100])
def test_key_blocks_heuristic_short_queries_long_keys(seqlen_q):
    long_keys = dict(batch=8, seqlen_q=seqlen_q, seqlen_k=4096, nheads=16, nheads_k=16, head_dim=128)
    assert make("bwd", **long_keys).key_blocks_per_cta > 1
    assert make("bwd", **long_keys, key_blocks=1).key_blocks_per_cta == 1
    assert make("bwd", **long_keys, deterministic=True).key_blocks_per_cta == 1
    assert make("bwd", **dict(long_keys, head_dim=256)).key_blocks_per_cta == 1


def test_key_blocks_heuristic_leaves_long_queries():
    assert make("bwd", batch=8, seqlen_q=4096, seqlen_k=4096, nheads=16, nheads_k=16).key_blocks_per_cta == 1
    assert make("bwd", batch=1, seqlen_q=1, seqlen_k=100, nheads=1, nheads_k=1).key_blocks_per_cta == 1


# ---------------------------------------------------------------- tiles the host documents


@pytest.mark.parametrize(
    "head_dim, block_m, block_n, smem",
    [
        (32, 64, 128, 66560),
        (64, 128, 128, 198656),
        (128, 64, 128, 214016),
        (160, 64, 64, 140288),
        (256, 64, 64, 214016),
    ],
)
def test_hopper_backward_tile(head_dim, block_m, block_n, smem):
    # tile_size.h: 64 query rows per step (128 at head dim 64), 128 keys per CTA up to head dim 128 and 64 above.
    # Up to head dim 128 a CTA adds dQ through shared memory: at head dim 64, two fp32 dQ tiles of 128 rows (64 KiB)
    # past the 130 KiB of the rest. Above, P and dS take shared memory instead, with one K/V buffer.
    p = make("bwd", seqlen_q=1000, seqlen_k=1000, head_dim=head_dim, ws=False)
    assert (p.block_m, p.block_n, p.smem) == (block_m, block_n, smem), p


def test_hopper_forward_tile_head_dim_128():
    # tile_size.h: the wgmma forward's tile at head dim 128 is 128 x 128 (the regular tile, past the short-key
    # lengths).
    p = make("fwd", seqlen_q=4096, seqlen_k=4096, head_dim=128)
    assert (p.block_m, p.block_n) == (128, 128), p


# The two variants that the plain forward kernels take in a form of their own.
PLAIN_MODS = {"softcap": {"softcap": 30.0}, "dropout": {"dropout": True}}


@pytest.mark.parametrize("max_smem", [None, 101376], ids=["163kib", "99kib"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_mma_sync_forward_tile_head_dims_32_64(head_dim, causal, max_smem):
    # tile_size.h: the mma.sync forward at head dims 32 and 64 takes 128 x 128 tiles in both sets, the plain
    # kernels' softcap and dropout forms too, and its variants kernel 128 x 64 (variants_tile), whether or not the
    # call is causal.
    sizes = {"batch": 2, "seqlen_q": 2048, "seqlen_k": 2048, "nheads": 8, "nheads_k": 8, "head_dim": head_dim}
    p = make("fwd", A100, causal=causal, max_smem=max_smem, **sizes)
    assert (p.kernel, p.block_m, p.block_n) == ("mma_sync", 128, 128), p
    for variant in PLAIN_MODS.values():
        c = plan("fwd", **sizes, causal=causal, **variant, max_smem=max_smem, **A100)
        assert (c.kernel, c.variants, c.causal, c.block_m, c.block_n) == ("mma_sync", False, causal, 128, 128), c
    v = plan("fwd", **sizes, causal=causal, window_size=(256, 0), max_smem=max_smem, **A100)
    assert (v.kernel, v.variants, v.block_m, v.block_n) == ("mma_sync", True, 128, 64), v


@pytest.mark.parametrize("mod", list(PLAIN_MODS))
@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_or_dropout_alone_runs_a_plain_forward(gpu, causal, mod):
    # A call whose one variant is softcap, or dropout, runs the plain forward kernels (their form for it), with the
    # call's own mask: the mma.sync ones, or on Hopper the warp-specialized one. Its backward, a Hopper forward that
    # the warp-specialized kernel does not serve, and either variant with any other run the variants kernel.
    sizes = {"batch": 2, "seqlen_q": 1000, "seqlen_k": 1000, "nheads": 8, "nheads_k": 8, "head_dim": 128}
    variant = PLAIN_MODS[mod]
    for force in ({"kernel": "mma_sync"}, {}):
        override = override_string(**force)
        fwd = plan("fwd", **sizes, causal=causal, **variant, override=override, **gpu)
        mma_sync = fwd.kernel == "mma_sync"
        assert mma_sync == (gpu is A100 or bool(force)), fwd
        assert (fwd.variants, fwd.causal, fwd.warp_specialized) == (False, causal, not mma_sync), fwd
        bwd = plan("bwd", **sizes, causal=causal, **variant, override=override, **gpu)
        assert bwd.variants and bwd.causal, bwd
        others = [{"window_size": (128, 0)}, {"alibi": True}, {"softcap": 5.0, "dropout": True}]
        for other in others:
            both = plan("fwd", **sizes, causal=causal, **{**variant, **other}, override=override, **gpu)
            assert both.variants and both.causal, (other, both)
    cache = plan("fwd", **sizes, causal=causal, softcap=30.0, kvcache=True, override="kernel=mma_sync", **gpu)
    assert cache.variants, cache
    if gpu is H200:
        # Calls that the warp-specialized kernel does not serve: turned off, and too few query rows for its tile.
        off = plan("fwd", **sizes, causal=causal, **variant, override="ws=0", **gpu)
        short = plan("fwd", **{**sizes, "seqlen_q": 16}, causal=causal, **variant, **gpu)
        for p in (off, short):
            assert (p.kernel, p.variants, p.causal, p.warp_specialized) == ("wgmma", True, True, False), p


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_k", [1024, 4096])
def test_dropout_at_head_dim_256_on_hopper(seqlen_k, causal):
    # Dropout's draws need key blocks at multiples of 32 keys (tile_size.h, dropout_fits_key_blocks): the
    # warp-specialized forward's 80-key tile at head dim 256 has none, so its dropout calls run the 64-key
    # short-key tile at every length and mask; short_keys=0 leaves them to the variants kernel.
    sizes = {"batch": 2, "seqlen_q": 2048, "seqlen_k": seqlen_k, "nheads": 8, "nheads_k": 8, "head_dim": 256}
    for override in ("", "ws=1", "short_keys=1"):
        p = plan("fwd", **sizes, causal=causal, dropout=True, override=override, **H200)
        assert p.warp_specialized and p.short_key_tile and not p.variants, p
        assert (p.block_m, p.block_n) == (128, 64), p
    off = plan("fwd", **sizes, causal=causal, dropout=True, override="short_keys=0", **H200)
    assert not off.warp_specialized and off.variants, off
    plain = plan("fwd", **sizes, causal=causal, **H200)
    assert plain.warp_specialized and plain.block_n == (64 if causal and seqlen_k <= 1024 else 80), plain


# ---------------------------------------------------------------- plan_override


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize(
    "text",
    [
        "key_blocks=two",
        "gqa_walk=2",
        "short_keys=yes",
        "short_queries=-1",
        "kernel=tensor_cores",
        "key_blocks=-1",
        "key_blocks=0",
        "window=1",
        "kernel",
        "kernel=mma_sync;gqa_walk",
        "=1",
    ],
)
def test_malformed_override_rejected(pass_, text):
    with pytest.raises(BAD_ARGUMENT, match="plan_override"):
        make(pass_, override=text)


def test_override_string():
    assert override_string() == ""
    assert override_string(kernel="mma_sync") == "kernel=mma_sync"
    text = override_string(kernel="mma_sync", gqa_walk=True, key_blocks=2, short_keys=False, short_queries=True)
    assert text == "kernel=mma_sync;gqa_walk=1;key_blocks=2;short_keys=0;short_queries=1"
    assert override_string(gqa_pack=False, stagger=True) == "gqa_pack=0;stagger=1"
    # The op takes what override_string writes, and every choice in it reaches the plan.
    p = make("bwd", seqlen_q=1000, seqlen_k=300, nheads=8, nheads_k=2, override=text.replace("kernel=mma_sync;", ""))
    assert p.kernel == "wgmma" and p.heads_per_cta == 4 and p.key_blocks_per_cta == 2 and p.short_query_tile, p


def test_force_plan_scopes():
    assert forced() == (0, "")
    with force_plan(num_splits=3, kernel="mma_sync"):
        assert forced() == (3, "kernel=mma_sync")
        with force_plan(gqa_walk=False):
            assert forced() == (0, "gqa_walk=0")
        assert forced() == (3, "kernel=mma_sync")
    assert forced() == (0, "")
    with pytest.raises(KeyError):
        with force_plan(key_blocks=2):
            raise KeyError("left by an exception")
    assert forced() == (0, "")


def _bound_args(op, args, kwargs):
    """The op's arguments by schema name (kwargs and positionals alike)."""
    names = [a.name for a in op.default._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def test_force_plan_reaches_fwd_op(monkeypatch):
    # flash_attn_func passes what force_plan holds to the op as its num_splits and plan_override arguments.
    op = torch.ops.flash_attn2.fwd
    seen = []

    def fake_op(*args, **kwargs):
        seen.append(_bound_args(op, args, kwargs))
        return torch.empty_like(args[0]), torch.empty(1)

    monkeypatch.setattr(flash_attn_cuda._ops, "_FWD", fake_op)
    q, k, v = (torch.randn(2, 9, 4, 64, dtype=torch.float16) for _ in range(3))
    with force_plan(num_splits=3, kernel="mma_sync", short_keys=True):
        flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    assert seen[0]["num_splits"] == 3 and seen[0]["plan_override"] == "kernel=mma_sync;short_keys=1", seen[0]
    assert seen[1].get("num_splits", 0) == 0 and seen[1].get("plan_override", "") == "", seen[1]


def test_force_plan_reaches_varlen_fwd_op(monkeypatch):
    op = torch.ops.flash_attn2.varlen_fwd
    seen = []

    def fake_op(*args, **kwargs):
        seen.append(_bound_args(op, args, kwargs))
        return torch.empty_like(args[0]), torch.empty(1)

    monkeypatch.setattr(flash_attn_cuda._ops, "_VARLEN_FWD", fake_op)
    q, k, v = (torch.randn(9, 4, 64, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with force_plan(gqa_walk=True, key_blocks=2):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    assert seen[0]["plan_override"] == "gqa_walk=1;key_blocks=2", seen[0]
    assert "num_splits" not in seen[0]  # varlen forwards are never split


def test_schemas_take_plan_arguments():
    fwd = str(torch.ops.flash_attn2.fwd.default._schema)
    assert "int num_splits=0" in fwd and 'str plan_override=""' in fwd, fwd
    for name in ("bwd", "varlen_fwd", "varlen_bwd"):
        schema = str(getattr(torch.ops.flash_attn2, name).default._schema)
        assert 'str plan_override=""' in schema and "num_splits" not in schema, schema


# ---------------------------------------------------------------- attention variants


def make_variant(pass_="fwd", gpu=H200, *, window_size=(-1, -1), alibi=False, dropout=False, softcap=0.0, **sizes):
    sizes = {"batch": 2, "seqlen_q": 512, "seqlen_k": 512, "nheads": 8, "nheads_k": 8, "head_dim": 128, **sizes}
    return plan(pass_, **sizes, window_size=window_size, alibi=alibi, dropout=dropout, softcap=softcap, **gpu)


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize(
    "variant, runs_variants",
    [
        ({}, False),
        ({"causal": True, "window_size": (-1, 0)}, False),  # causal
        ({"window_size": (-1, 0)}, False),  # the same mask, without causal=True
        ({"causal": True, "window_size": (-1, 7)}, False),  # causal fixes right at 0
        ({"window_size": (128, 0)}, True),
        ({"window_size": (-1, 5)}, True),
        ({"softcap": 30.0}, "backward only"),
        ({"alibi": True}, True),
        ({"dropout": True}, "backward only"),
        ({"dropout": True, "softcap": 30.0}, True),
    ],
)
def test_variants_run_the_variants_kernel(pass_, gpu, variant, runs_variants):
    # Any variant runs the variants kernel, which is masked, except softcap or dropout alone in the forward, which
    # the plain kernels take (on Hopper the warp-specialized one, which serves these sizes); a call with none runs
    # a plain kernel, on the same kernel family either way.
    p = make_variant(pass_, gpu, **variant)
    if runs_variants == "backward only":
        runs_variants = pass_ == "bwd"
    assert p.variants == runs_variants, p
    if runs_variants:
        assert p.causal, p
    assert p.kernel == make_variant(pass_, gpu).kernel


@pytest.mark.parametrize(
    "variant, packs_fwd, packs_bwd",
    [
        ({"softcap": 30.0}, True, False),
        ({"alibi": True}, False, False),
        ({"dropout": True}, False, False),
        ({"window_size": (16, 0)}, True, False),
        ({"window_size": (16, 16), "softcap": 5.0}, True, False),
        ({"causal": True}, True, True),
        ({}, True, True),
    ],
)
def test_gqa_packing_with_variants(variant, packs_fwd, packs_bwd):
    # ALiBi and dropout read each query head's own position: no packing. The forward's variants kernel packs the
    # others, reading the one query's window as a range of keys; the backward's variants kernels do not pack.
    for pass_, packs in (("fwd", packs_fwd), ("bwd", packs_bwd)):
        p = make_variant(pass_, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=4, **variant)
        assert (p.gqa_pack == 8) == packs, (pass_, p)


def test_dropout_rules_out_key_splits():
    # The dropout mask follows absolute key positions: no split, even when forced.
    shape = {"batch": 1, "seqlen_q": 1, "seqlen_k": 65536, "nheads": 8, "nheads_k": 8}
    assert make_variant("fwd", **shape).num_splits > 1
    assert make_variant("fwd", dropout=True, **shape).num_splits == 1
    forced_plan = plan("fwd", **shape, head_dim=128, num_splits=4, dropout=True, **H200)
    assert forced_plan.num_splits == 1
    assert make_variant("fwd", softcap=5.0, window_size=(1024, 0), **shape).num_splits > 1


def test_left_window_walks_one_key_block():
    # Under a left window edge a key block may have no query: the Hopper backward keeps one key block per CTA.
    shape = {"batch": 1, "seqlen_q": 16, "seqlen_k": 32768, "nheads": 8, "nheads_k": 8}
    assert make_variant("bwd", **shape).key_blocks_per_cta > 1
    assert make_variant("bwd", window_size=(256, 0), **shape).key_blocks_per_cta == 1
    assert make_variant("bwd", window_size=(-1, 64), **shape).key_blocks_per_cta > 1


# ---------------------------------------------------------------- shared memory per block

KERNEL_HEAD_DIMS = list(_kernel_list.HEAD_DIMS)
# The documented opt-in shared memory per block, which plan() takes for a named arch unless max_smem is given.
SMEM_163KIB = 166912  # sm_80, sm_87
SMEM_99KIB = 101376  # sm_86, sm_89, sm_120, sm_121
SMEM_227KIB = 232448  # sm_90, sm_100, sm_103
PASS_CASES = [("fwd", False), ("bwd", False), ("bwd", True)]
MASK_CASES = {
    "noncausal": {},
    "causal": {"causal": True},
    "variants": {"window_size": (128, 0), "softcap": 5.0},
    "dropout": {"dropout": True},
}
SHAPE_CASES = {
    "long": {"batch": 2, "seqlen_q": 512, "seqlen_k": 512, "nheads": 8, "nheads_k": 8},
    "decode": {"batch": 8, "seqlen_q": 1, "seqlen_k": 4096, "nheads": 32, "nheads_k": 8},
}
# Every tile a plan may pick: the heuristics', the short tiles and several key blocks per Hopper backward CTA
# (its second K/V buffer), and mma.sync on Hopper.
OVERRIDE_CASES = ["", "short_keys=1;short_queries=1;key_blocks=4", "kernel=mma_sync"]


def smem_plan(pass_, gpu, head_dim, mask, shape, *, deterministic=False, override="", **extra) -> Plan:
    return plan(
        pass_,
        **SHAPE_CASES[shape],
        head_dim=head_dim,
        deterministic=deterministic,
        override=override,
        **MASK_CASES[mask],
        **gpu,
        **extra,
    )


@pytest.mark.parametrize("gpu, budget", [(A100, SMEM_163KIB), (H200, SMEM_227KIB)], ids=["a100", "h200"])
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("pass_, deterministic", PASS_CASES, ids=["fwd", "bwd", "bwd-deterministic"])
@pytest.mark.parametrize("mask", list(MASK_CASES))
@pytest.mark.parametrize("shape", list(SHAPE_CASES))
@pytest.mark.parametrize("override", OVERRIDE_CASES, ids=["heuristic", "short-walk", "mma_sync"])
def test_every_kernel_fits_its_arch(gpu, budget, head_dim, pass_, deterministic, mask, shape, override):
    # The tile sets are made for sm_80's 163 KiB (mma.sync) and sm_90's 227 KiB (wgmma): every kernel fits.
    p = smem_plan(pass_, gpu, head_dim, mask, shape, deterministic=deterministic, override=override)
    assert 0 < p.smem <= budget, p


@pytest.mark.parametrize(
    "pass_, gpu, seqlen_k, override, smem",
    [
        # The warp-specialized kernel: Q (128 x 128), two stages of K and of V (128 x 128 each), the output tile
        # (128 x 128) and 1 KiB of mbarriers, bf16: 32 + 128 + 32 + 1 KiB.
        ("fwd", H200, 4096, "", 197632),
        # Without it: Q and three stages of K and V: 32 + 192 KiB.
        ("fwd", H200, 4096, "ws=0", 229376),
        # The short-key tile, two CTAs per SM: Q (64 x 128) and three stages of K and V (64 x 128): 16 + 96 KiB.
        ("fwd", H200, 64, "ws=0", 114688),
        # mma.sync, non-causal: Q (128 rows x 128) and one K and one V block (64 keys x 128): 32 + 32 KiB.
        ("fwd", A100, 4096, "", 65536),
        # The Hopper backward: Q, dO (two stages each), K, V, dS^T and LSE/D, 145 KiB, and past them its second
        # K/V buffer (2 x 32 KiB) with several key blocks per CTA, or in its place two fp32 dQ tiles (2 x 32 KiB).
        ("bwd", H200, 4096, "ws=0;key_blocks=1", 214016),
        ("bwd", H200, 4096, "ws=0;key_blocks=2", 214016),
        # The warp-specialized backward: two stages of Q and of dO (64 x 128: 4 x 16 KiB), K and V (2 x 32 KiB),
        # two dS^T tiles (2 x 16 KiB), two fp32 dQ tiles (2 x 32 KiB), then LSE, D and the mbarriers, to a whole KiB.
        ("bwd", H200, 4096, "", 231424),
        # The 16-row short-query tile adds dQ from registers: no dQ tiles.
        ("bwd", H200, 4096, "key_blocks=1;short_queries=1", 87040),
        # mma.sync: K, V, P, dS (32 + 32 + 16 + 16 KiB) and two stages of Q, dO, LSE and D (2 x 32.5 KiB).
        ("bwd", A100, 4096, "", 164864),
    ],
    ids=[
        "h200-fwd",
        "h200-fwd-no-ws",
        "h200-fwd-short-keys",
        "a100-fwd",
        "h200-bwd",
        "h200-bwd-two-kv",
        "h200-bwd-ws",
        "h200-bwd-short-queries",
        "a100-bwd",
    ],
)
def test_smem_of_head_dim_128(pass_, gpu, seqlen_k, override, smem):
    p = plan(
        pass_, batch=2, seqlen_q=4096, seqlen_k=seqlen_k, nheads=8, nheads_k=8, head_dim=128, override=override, **gpu
    )
    assert p.smem == smem, p


def test_mma_sync_backward_stages_by_budget():
    # The mma.sync backward double-buffers Q and dO where that fits sm_80's 163 KiB, else loads the next query
    # block during the dQ GEMM: at head dim 256, K, V, P, dS (64 + 16 KiB) and one stage (64.5 KiB).
    p = plan("bwd", batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_k=8, head_dim=256, **A100)
    assert p.kernel == "mma_sync" and p.smem == 147968, p
    # Head dim 64's 128-row blocks: two stages, 162 KiB.
    p = plan("bwd", batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_k=8, head_dim=64, **A100)
    assert p.smem == 165888, p
    # On Hopper (mma.sync forced, or deterministic mode where the Hopper kernels have none) the mma.sync kernels
    # take the A100's set: a 227 KiB set with two stages at head dim 256 (209 KiB) measured no faster there
    # (docs/design-notes.md).
    p = make("bwd", head_dim=256, kernel="mma_sync")
    assert p.kernel == "mma_sync" and p.tile_budget == SMEM_163KIB and p.smem == 147968, p
    p = make("bwd", head_dim=128, softcap=5.0, deterministic=True)
    assert p.kernel == "mma_sync" and p.tile_budget == SMEM_163KIB, p


SMALL_GPUS = {
    "sm86": {"arch": 86, "num_sms": 84},
    "sm89": {"arch": 89, "num_sms": 128},
    "sm120": {"arch": 120, "num_sms": 170},
    "h200": H200,  # an H200 planned as a 99 KiB GPU (max_smem), as the GPU tests run the 99 KiB set
}
# Every tile a plan may pick on a 99 KiB GPU: the heuristics', several key splits, and the Hopper family asked
# for (which does not fit, so the mma.sync kernels run).
SMALL_OVERRIDE_CASES = ["", "kernel=wgmma", "short_keys=1;short_queries=1"]


@pytest.mark.parametrize("gpu", list(SMALL_GPUS))
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("pass_, deterministic", PASS_CASES, ids=["fwd", "bwd", "bwd-deterministic"])
@pytest.mark.parametrize("mask", list(MASK_CASES))
@pytest.mark.parametrize("shape", list(SHAPE_CASES))
@pytest.mark.parametrize("override", SMALL_OVERRIDE_CASES, ids=["heuristic", "wgmma", "short"])
def test_99kib_budget(gpu, head_dim, pass_, deterministic, mask, shape, override):
    # The mma.sync kernels' 99 KiB set fits every head dim, pass and mask (a head dim without a 99 KiB tile runs
    # a wider one's kernel).
    gpu_args = SMALL_GPUS[gpu]
    p = smem_plan(
        pass_, gpu_args, head_dim, mask, shape, deterministic=deterministic, override=override, max_smem=SMEM_99KIB
    )
    assert p.kernel == "mma_sync" and p.tile_budget == SMEM_99KIB, p
    assert 0 < p.smem <= SMEM_99KIB, p
    assert p.kernel_head_dim == (256 if (pass_, head_dim) == ("bwd", 224) else head_dim), p


@pytest.mark.parametrize("arch", [86, 89, 120, 121])
def test_99kib_default_for_named_arch(arch):
    # Without max_smem a named arch takes its documented budget: 99 KiB for these, whose plans take that set.
    for pass_ in ("fwd", "bwd"):
        for head_dim in KERNEL_HEAD_DIMS:
            p = make(pass_, {"arch": arch, "num_sms": 80}, head_dim=head_dim)
            assert p.tile_budget == SMEM_99KIB and 0 < p.smem <= SMEM_99KIB, (arch, p)


@pytest.mark.parametrize(
    "pass_, head_dim, causal, tile, smem",
    [
        # Head dim 128 forward: four warps on 128 x 32 (non-causal) and 64 x 64 (causal), 48 KiB each.
        ("fwd", 128, False, (128, 32), 49152),
        ("fwd", 128, True, (64, 64), 49152),
        # Backward, head dim 64: K, V, P, dS of 128 keys (64 KiB) and two 64-row Q/dO stages (2 x 16.5 KiB).
        ("bwd", 64, False, (64, 128), 99328),
        # Head dim 128: K and V of 64 keys (32 KiB), P and dS in V's, and two stages (2 x 32.5 KiB).
        ("bwd", 128, False, (64, 64), 99328),
        # Head dim 256: 32-key blocks, K and V (2 x 16 KiB) with P and dS in V's, and one stage (64.5 KiB).
        ("bwd", 256, True, (64, 32), 98816),
    ],
)
def test_99kib_tiles(pass_, head_dim, causal, tile, smem):
    p = make(pass_, {"arch": 86, "num_sms": 84}, head_dim=head_dim, causal=causal)
    assert (p.block_m, p.block_n, p.smem) == (*tile, smem), p


@pytest.mark.parametrize("variants", [{}, {"window_size": (512, 0)}], ids=["plain", "variants"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, large, small", [(224, 114688, 86016), (256, 131072, 98304)])
def test_mma_sync_forward_wide_head_dims_by_ctas_per_sm(head_dim, large, small, causal, variants):
    # tile_size.h: an A100's SM holds 164 KiB, so the 84 or 96 KiB of a 64 x 64 tile on four warps leave it one CTA
    # of four warps; its set takes 128 x 64 on eight warps (112 or 128 KiB) instead, one CTA of eight. The 99 KiB
    # GPUs' SMs hold one CTA of either, and keep the smaller tile. A Hopper SM (228 KiB) holds two of the smaller
    # tile and one of the larger (by registers at head dim 224, where two would fit its shared memory): the plan
    # runs the 99 KiB set's there (plan.cpp, fwd_tile_set), also under a max_smem whose SM holds two of them, and
    # not under one whose SM holds one.
    sizes = {"batch": 2, "seqlen_q": 4096, "seqlen_k": 4096, "nheads": 8, "nheads_k": 8, "head_dim": head_dim}
    args = {"causal": causal, **sizes, **variants}
    for gpu, max_smem, tile, budget in [
        (A100, None, (128, 64, large), SMEM_163KIB),
        (A100, SMEM_99KIB, (64, 64, small), SMEM_99KIB),
        (H200, None, (64, 64, small), SMEM_99KIB),
        (H200, 200 * 1024, (64, 64, small), SMEM_99KIB),
        (H200, SMEM_163KIB, (128, 64, large), SMEM_163KIB),
    ]:
        p = plan("fwd", **args, max_smem=max_smem, override="kernel=mma_sync", **gpu)
        assert (p.kernel, p.block_m, p.block_n, p.smem, p.tile_budget) == ("mma_sync", *tile, budget), (gpu, p)


def test_hopper_forward_head_dim_256_warp_specialized_tile():
    # tile_size.h: 80-key blocks, whose two stages of K and V (160 KiB) fill the 227 KiB beside Q with the
    # output staged in Q's buffer.
    p = make("fwd", seqlen_q=8192, seqlen_k=8192, head_dim=256)
    assert (p.warp_specialized, p.block_m, p.block_n, p.smem) == (True, 128, 80, 230400), p


def test_max_smem_selects_the_tile_set():
    # On an H200, max_smem below the Hopper kernels' 227 KiB runs the mma.sync kernels, with the set of the
    # largest budget within it.
    for pass_ in ("fwd", "bwd"):
        full = make(pass_)
        assert full.kernel == "wgmma" and full.tile_budget == SMEM_227KIB, full
        for budget in (SMEM_163KIB, SMEM_99KIB, 120000):
            small = plan(
                pass_, batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_k=8, head_dim=128, max_smem=budget, **H200
            )
            expected = SMEM_99KIB if budget < SMEM_163KIB else SMEM_163KIB
            assert small.kernel == "mma_sync" and small.tile_budget == expected, (budget, small)
            forced = make(pass_, max_smem=budget)
            assert forced == small, (forced, small)


@pytest.mark.parametrize("max_smem", [0, -2, -1000])
def test_max_smem_out_of_range_rejected(max_smem):
    with pytest.raises(ValueError, match="max_smem"):
        plan("fwd", batch=1, seqlen_q=1, seqlen_k=64, nheads=1, nheads_k=1, head_dim=64, max_smem=max_smem, **H200)
    # Checked before the device is looked for, so the message is the same without arch.
    with pytest.raises(ValueError, match="max_smem"):
        plan("fwd", batch=1, seqlen_q=1, seqlen_k=64, nheads=1, nheads_k=1, head_dim=64, max_smem=max_smem)


def test_unknown_arch_needs_max_smem():
    with pytest.raises(ValueError, match="max_smem"):
        plan("fwd", batch=1, seqlen_q=1, seqlen_k=64, nheads=1, nheads_k=1, head_dim=64, arch=75, num_sms=40)
    p = plan(
        "fwd", batch=1, seqlen_q=1, seqlen_k=64, nheads=1, nheads_k=1, head_dim=64, arch=75, num_sms=40, max_smem=65536
    )
    assert p.kernel == "mma_sync" and 0 < p.smem <= 65536, p


# ---------------------------------------------------------------- the plan op describes calls as the ops do


# (variant, variants kernel, masked at one query row, masked at 512 query rows, GQA pack fwd, GQA pack bwd): the
# rules the ops apply to a call (problem_of), at one query row with 32 query heads on 4 key/value heads. A bounded
# window, softcap, ALiBi, dropout or a KV cache runs the variants kernel, which is masked; causal with one dense
# query row runs unmasked; ALiBi and dropout never pack, and the backward's variants kernels do not pack.
PROBLEM_CASES = [
    ({}, False, False, False, 8, 8),
    ({"causal": True}, False, False, True, 8, 8),
    ({"window_size": (-1, 0)}, False, False, True, 8, 8),
    ({"causal": True, "window_size": (-1, 7)}, False, False, True, 8, 8),
    ({"window_size": (128, 0)}, True, True, True, 8, 1),
    ({"window_size": (-1, 5)}, True, True, True, 8, 1),
    ({"window_size": (16, 16), "softcap": 5.0}, True, True, True, 8, 1),
    ({"softcap": 30.0}, True, True, True, 8, 1),
    ({"alibi": True}, True, True, True, 1, 1),
    ({"dropout": True}, True, True, True, 1, 1),
    ({"kvcache": True}, True, True, True, 8, None),
    ({"kvcache": True, "causal": True}, True, True, True, 8, None),
    ({"kvcache": True, "alibi": True}, True, True, True, 1, None),
    ({"kvcache": True, "paged": True, "window_size": (16, 16), "softcap": 5.0}, True, True, True, 8, None),
]


@pytest.mark.parametrize("gpu", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("variant, variants, causal_one_row, causal_long, pack_fwd, pack_bwd", PROBLEM_CASES)
def test_plan_op_problem_rules(gpu, variant, variants, causal_one_row, causal_long, pack_fwd, pack_bwd):
    for pass_, pack in (("fwd", pack_fwd), ("bwd", pack_bwd)):
        if pack is None:  # a KV cache has a forward pass only
            with pytest.raises(ValueError, match="kvcache"):
                plan(pass_, batch=2, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=4, head_dim=128, **variant, **gpu)
            continue
        one_row = plan(pass_, batch=2, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=4, head_dim=128, **variant, **gpu)
        # Softcap or dropout alone runs the plain forward kernels, unmasked unless the call is causal: on Hopper the
        # warp-specialized one, which one query row is too few for.
        plain = set(variant) in ({"softcap"}, {"dropout"}) and pass_ == "fwd"
        plain_one_row = plain and one_row.kernel == "mma_sync"
        expected = (False, False, pack) if plain_one_row else (variants, causal_one_row, pack)
        assert (one_row.variants, one_row.causal, one_row.gqa_pack) == expected, (pass_, one_row)
        long = plan(pass_, batch=2, seqlen_q=512, seqlen_k=4096, nheads=32, nheads_k=4, head_dim=128, **variant, **gpu)
        expected = (False, False, 1) if plain else (variants, causal_long, 1)
        assert (long.variants, long.causal, long.gqa_pack) == expected, (pass_, long)


@pytest.mark.parametrize(
    "head_dim, seqlen, causal, warp_specialized",
    [
        # Head dims 32 and 64 (192-row tiles) at every length non-causal; causal, head dim 32 past 1024 keys, and
        # head dim 64 at every length (its short-key tile up to 2048 keys).
        (64, 512, False, True),
        (64, 2048, False, True),
        (64, 512, True, True),
        (64, 1024, True, True),
        (64, 1025, True, True),
        (64, 2048, True, True),
        (64, 4096, True, True),
        (32, 1024, True, False),
        (32, 2048, True, True),
        (32, 300, False, True),
        # Head dim 128 at every length, also where the short-key tile ran before the kernel was persistent.
        (128, 512, False, True),
        (128, 1024, False, True),
        (128, 1024, True, True),
        (128, 2048, True, True),
        # The other head dims at every length.
        (256, 512, False, True),
        (256, 512, True, True),
        (96, 300, True, True),
        (192, 100, False, True),
    ],
)
def test_hopper_forward_warp_specialized_by_length(head_dim, seqlen, causal, warp_specialized):
    args = dict(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, nheads=16, nheads_k=16, head_dim=head_dim, causal=causal)
    p = plan("fwd", **args, **H200)
    assert p.warp_specialized == warp_specialized, p
    # plan.cpp: fwd_ws_short_keys_max_causal
    ws_short = causal and (head_dim == 64 and seqlen <= 2048 or head_dim == 256 and seqlen <= 1024)
    if warp_specialized:
        assert p.num_splits == 1 and p.short_key_tile is ws_short, p
        assert p.block_m == (192 if head_dim <= 64 and not ws_short else 128), p
    # ws=1 forces it at every length, ws=0 never, and neither does a forced short-key tile, except the kernel's own
    # (head dims 64 and 256, causal); the mma.sync family never has it.
    assert plan("fwd", **args, override="ws=1", **H200).warp_specialized
    forced_short = plan("fwd", **args, override="ws=1;short_keys=1", **H200)
    assert forced_short.warp_specialized is (head_dim in (64, 256) and causal), forced_short
    assert not plan("fwd", **args, override="ws=0", **H200).warp_specialized
    assert not plan("fwd", **args, override="ws=1", **A100).warp_specialized


@pytest.mark.parametrize("seqlen_k", [64, 512, 2048, 2049, 16384])
def test_hopper_forward_warp_specialized_short_key_tile(seqlen_k):
    # tile_size.h: at head dim 64 the warp-specialized forward has a short-key tile for causal calls, 128 x 128 on two
    # consumer warpgroups, taken up to 2048 keys (plan.cpp); 192 x 128 on three beyond, and without a mask.
    # Enough query blocks to fill the SMs, so that no call splits its keys (which this kernel does not do).
    args = dict(batch=8, seqlen_q=512, seqlen_k=seqlen_k, nheads=16, nheads_k=16, head_dim=64)
    short = seqlen_k <= 2048
    p = plan("fwd", **args, causal=True, **H200)
    assert p.warp_specialized and p.short_key_tile is short, p
    assert (p.block_m, p.block_n) == ((128, 128) if short else (192, 128)), p
    if short:  # Q, two stages of K and V, and the output's own buffer, of 128 x 64 and 128 x 64 tiles; barriers
        assert p.smem == (128 * 64 + 2 * 2 * 128 * 64 + 128 * 64) * 2 + 1024, p
    full = plan("fwd", **args, **H200)
    assert full.warp_specialized and not full.short_key_tile and full.block_m == 192, full
    # short_keys=1 forces it at any length; short_keys=0 keeps the 192-row tile, which up to 1024 keys leaves the
    # call to the other Hopper kernel unless ws=1 forces it.
    forced = plan("fwd", **args, causal=True, override="short_keys=1", **H200)
    assert forced.warp_specialized and forced.short_key_tile and forced.block_m == 128, forced
    off = plan("fwd", **args, causal=True, override="short_keys=0", **H200)
    assert not off.short_key_tile and off.warp_specialized is (seqlen_k > 1024), off
    both = plan("fwd", **args, causal=True, override="short_keys=0;ws=1", **H200)
    assert both.warp_specialized and not both.short_key_tile and both.block_m == 192, both
    # Head dim 256's, 64-key blocks instead of 80, up to 1024 keys.
    for keys, tile in ((1024, (128, 64)), (1025, (128, 80))):
        d256 = plan("fwd", **{**args, "head_dim": 256, "seqlen_k": keys}, causal=True, **H200)
        assert d256.warp_specialized and d256.short_key_tile is (keys <= 1024), d256
        assert (d256.block_m, d256.block_n) == tile, d256
    # Head dim 32 has no such tile; calls the kernel does not serve (variants) keep the other kernel.
    d32 = plan("fwd", **{**args, "head_dim": 32}, causal=True, **H200)
    assert not d32.short_key_tile and d32.block_m == (192 if d32.warp_specialized else 128), d32
    window = plan("fwd", **args, causal=True, window_size=(256, 0), **H200)
    assert not window.warp_specialized and not window.short_key_tile, window


@pytest.mark.parametrize("head_dim, block_m, smem", [(64, 128, 232448), (128, 64, 231424)], ids=["d64", "d128"])
def test_hopper_backward_warp_specialized(head_dim, block_m, smem):
    # tile_size.h: the warp-specialized backward runs the narrow kernel's tile, one key block per tile, with two
    # Q/dO stages, K and V, two dS^T and two fp32 dQ tiles in shared memory; for plain calls of head dims 64
    # and 128 on Hopper, not on the short-query tile; by default for dense calls from 4 query blocks, causal from 1024
    # keys (plan.cpp).
    dense = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=16, nheads_k=4, head_dim=head_dim)
    assert plan("bwd", **dense, **H200).warp_specialized
    assert plan("bwd", **dense, causal=True, **H200).warp_specialized
    short_keys = dict(dense, seqlen_q=512, seqlen_k=512)
    assert plan("bwd", **short_keys, **H200).warp_specialized
    assert not plan("bwd", **short_keys, causal=True, **H200).warp_specialized
    assert plan("bwd", **short_keys, causal=True, override="ws=1", **H200).warp_specialized
    few_queries = dict(dense, seqlen_q=4 * block_m - 1)
    assert not plan("bwd", **few_queries, **H200).warp_specialized
    assert plan("bwd", **dict(few_queries, seqlen_q=4 * block_m), **H200).warp_specialized
    for causal, walk in itertools.product((False, True), (0, 1)):
        p = plan("bwd", **dense, causal=causal, override=f"ws=1;gqa_walk={walk};key_blocks=3", **H200)
        assert p.warp_specialized and (p.block_m, p.block_n, p.smem) == (block_m, 128, smem), p
        assert p.key_blocks_per_cta == 1 and p.heads_per_cta == (4 if walk else 1), p
    assert not plan("bwd", **dense, override="ws=0", **H200).warp_specialized
    # Variable-length batches where forced only.
    assert not plan("bwd", **dense, varlen=True, **H200).warp_specialized
    assert plan("bwd", **dense, varlen=True, override="ws=1", **H200).warp_specialized
    assert not plan("bwd", **dense, window_size=(256, 0), override="ws=1", **H200).warp_specialized
    assert not plan("bwd", **dense, softcap=5.0, override="ws=1", **H200).warp_specialized
    # Deterministic mode runs it whatever is forced (its dQ order; the narrow kernel has none).
    assert plan("bwd", **dense, deterministic=True, override="ws=0;kernel=wgmma", **H200).warp_specialized
    assert not plan("bwd", **dense, override="ws=1", **A100).warp_specialized
    assert not plan("bwd", **dense, override="ws=1;kernel=mma_sync", **H200).warp_specialized
    short = dict(dense, seqlen_q=16)
    assert plan("bwd", **short, override="ws=1", **H200).warp_specialized == (head_dim != 128)
    assert plan("bwd", **short, override="ws=1;short_queries=0", **H200).warp_specialized
    for other in (32, 96, 256):
        assert not plan("bwd", **dict(dense, head_dim=other), override="ws=1", **H200).warp_specialized


def test_hopper_forward_warp_specialized_needs_dense_plain_calls():
    dense = dict(batch=2, seqlen_q=4096, seqlen_k=4096, nheads=16, nheads_k=4, head_dim=128)
    assert plan("fwd", **dense, **H200).warp_specialized
    assert not plan("fwd", **dense, varlen=True, **H200).warp_specialized
    assert not plan("fwd", **dense, window_size=(256, 0), **H200).warp_specialized
    assert not plan("fwd", **dense, alibi=True, **H200).warp_specialized
    # Queries for one consumer warpgroup only (decoding and other short queries), or split keys.
    short = dict(dense, seqlen_q=64)
    assert not plan("fwd", **short, **H200).warp_specialized
    assert not plan("fwd", **short, override="ws=1", **H200).warp_specialized
    assert not plan("fwd", **dense, num_splits=2, **H200).warp_specialized


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (192, 96), (168, 128), (176, 64)])
def test_narrow_v_forward(head_dim, head_dim_v, causal):
    # tile_size.h: Q/K head dims of kernel head dim 192 with a V of at most 128 columns run the warp-specialized
    # forward's narrow-V kernel on Hopper, 128 x 128 on two stages (209 KiB, the output staged in Q's buffer).
    args = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=16, nheads_k=16, head_dim=head_dim, causal=causal)
    p = plan("fwd", **args, head_dim_v=head_dim_v, **H200)
    assert p.narrow_v and p.warp_specialized and p.kernel == "wgmma", p
    assert (p.kernel_head_dim, p.block_m, p.block_n, p.smem, p.num_splits) == (192, 128, 128, 214016, 1), p
    # The same sizes with V as wide as Q and K keep the head dim's own tile.
    uniform = plan("fwd", **args, **H200)
    assert not uniform.narrow_v and (uniform.block_m, uniform.block_n) == (128, 96), uniform


@pytest.mark.parametrize(
    "gpu, override",
    [(A100, ""), (H200, "kernel=mma_sync"), ({"arch": 86, "num_sms": 84}, ""), (H200, "max_smem=101376")],
    ids=["a100", "h200-mma-sync", "sm86", "h200-99kib"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_narrow_v_forward_mma_sync(gpu, override, causal):
    # The mma.sync forward's narrow-V kernel runs the head dim's own tile (64 x 64 on four warps in both sets), V's
    # buffer at 128 columns: 64 KiB.
    args = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=16, nheads_k=16, head_dim=192, causal=causal)
    p = plan("fwd", **args, head_dim_v=128, override=override, **gpu)
    assert p.narrow_v and p.kernel == "mma_sync", p
    assert (p.block_m, p.block_n, p.smem, p.num_splits) == (64, 64, 65536, 1), p


@pytest.mark.parametrize(
    "case",
    [
        "v_too_wide",
        "kernel_without_one",
        "softcap",
        "dropout",
        "window",
        "varlen",
        "ws_off",
        "short_queries",
        "split",
        "backward_window",
    ],
)
def test_narrow_v_elsewhere_pads_v(case):
    # Every call the narrow-V kernels do not serve runs with V zero-padded to Q's head dim (narrow_v false): their
    # variants and key splits have no narrow-V form, and Hopper's other forward kernels none at all.
    args = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=16, nheads_k=16, head_dim=192, head_dim_v=128)
    pass_, extra = "fwd", dict(H200)
    if case == "v_too_wide":
        args["head_dim_v"] = 136
    elif case == "kernel_without_one":
        args.update(head_dim=128, head_dim_v=64)
    elif case == "softcap":
        extra["softcap"] = 30.0
    elif case == "dropout":
        extra["dropout"] = True
    elif case == "window":
        extra["window_size"] = (256, 0)
    elif case == "varlen":
        extra["varlen"] = True
    elif case == "ws_off":
        extra["override"] = "ws=0"
    elif case == "short_queries":
        args["seqlen_q"] = 64
    elif case == "split":
        # A grid of one query block against 8k keys: split-KV on the mma.sync kernels.
        args.update(batch=1, seqlen_q=64, seqlen_k=8192, nheads=1, nheads_k=1)
        extra = dict(A100)
        assert plan("fwd", **args, **extra).num_splits > 1
    else:
        pass_ = "bwd"
        extra["window_size"] = (256, 0)
    p = plan(pass_, **args, **extra)
    assert not p.narrow_v, p


@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (176, 64)])
def test_narrow_v_backward(head_dim, head_dim_v, causal, deterministic):
    # Hopper's wide backward has a narrow-V form at Q/K kernel head dim 192 (V's 128) on its own 64 x 64 tile: Q and
    # dO in two stages, K, V, P and dS and the LSE and D, 137 KiB against 161 KiB with V at 192.
    args = dict(
        batch=2,
        seqlen_q=2048,
        seqlen_k=2048,
        nheads=16,
        nheads_k=16,
        head_dim=head_dim,
        causal=causal,
        deterministic=deterministic,
    )
    p = plan("bwd", **args, head_dim_v=head_dim_v, **H200)
    assert p.narrow_v and p.kernel == "wgmma" and not p.warp_specialized, p
    assert (p.kernel_head_dim, p.block_m, p.block_n, p.smem) == (192, 64, 64, 140288), p
    uniform = plan("bwd", **args, **H200)
    assert not uniform.narrow_v and uniform.smem == 164864, uniform


@pytest.mark.parametrize(
    "gpu, override, tile, smem",
    [
        (A100, "", (64, 64), 140288),
        (H200, "kernel=mma_sync", (64, 64), 140288),
        ({"arch": 86, "num_sms": 84}, "", (64, 32), 70144),
    ],
    ids=["a100", "h200-mma-sync", "sm86"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_narrow_v_backward_mma_sync(gpu, override, tile, smem, causal):
    # The mma.sync backward's narrow-V kernel runs the set's tile with dO and V at 128 columns: on 163 KiB two Q
    # stages (137 KiB; 161 KiB with V at 192), on 99 KiB one (68.5 KiB; 80.5 KiB).
    args = dict(batch=2, seqlen_q=2048, seqlen_k=2048, nheads=16, nheads_k=16, head_dim=192, causal=causal)
    p = plan("bwd", **args, head_dim_v=128, override=override, **gpu)
    assert p.narrow_v and p.kernel == "mma_sync", p
    assert ((p.block_m, p.block_n), p.smem) == (tile, smem), p


def test_narrow_v_plan_argument_checked():
    args = dict(batch=1, seqlen_q=8, seqlen_k=8, nheads=1, nheads_k=1, head_dim=128, **H200)
    for bad in (0, 136, 100):
        with pytest.raises(ValueError, match="head_dim_v must be -1"):
            plan("fwd", **args, head_dim_v=bad)
