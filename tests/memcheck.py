"""Small forward and backward calls for compute-sanitizer (not a pytest module): odd lengths, causal both
ways, GQA, padded head dims, strided views, deterministic mode and variable-length batches (with empty and
one-token sequences), forced split-KV forwards, the warp-specialized Hopper forward and backward with several
tiles per CTA, forced multi-key-block backwards, the attention variants (windows, softcap, ALiBi, dropout) and
learnable sinks on both kernel families, so out-of-bounds reads or writes show up as memcheck errors.

    compute-sanitizer --tool memcheck python tests/memcheck.py [section ...]

With section names (the functions below, e.g. `short_queries`), only those run. Paths are forced with
flash_attn_cuda.plan.force_plan, and each forced call first asserts through its plan that it takes the path
where this GPU has it (conftest.check_forced_plans).
"""

import itertools
import sys

import torch
from conftest import KERNEL_HEAD_DIMS, check_forced_plans

import flash_attn_cuda
from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from flash_attn_cuda.plan import force_plan

# Variable-length batches: lengths with empty and one-token sequences, and every kernel head dim.
LENS_Q, LENS_K = [0, 1, 17, 130, 64], [5, 0, 17, 77, 129]


def cu_seqlens():
    return (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda") for n in (LENS_Q, LENS_K))


def dense():
    """Odd lengths, causal both ways, GQA, padded head dims, strided views, deterministic mode; returns the calls."""
    calls = 0
    for head_dim in (32, 40, 64, 96, 128, 160, 192, 224, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                if not flash_attn_cuda.kernel_available(head_dim, dtype, causal):
                    continue
                with_bwd = flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True)
                for i, (sq, sk) in enumerate(((1, 17), (17, 1), (113, 77), (77, 203), (130, 130))):
                    # A packed (b, s, 3, h, d) buffer gives strided q, k, v views.
                    qkv = torch.randn(2, max(sq, sk), 3, 4, head_dim, device="cuda", dtype=dtype)
                    qkv.requires_grad_(with_bwd)
                    q = qkv[:, :sq, 0]
                    k = qkv[:, :sk, 1, :2]
                    v = qkv[:, :sk, 2, :2]
                    out = flash_attn_func(q, k, v, causal=causal, deterministic=i % 2 == 1)
                    if with_bwd:
                        out.backward(torch.randn_like(out))
                    calls += 1
    return calls


def varlen():
    """Variable-length batches with empty and one-token sequences; returns the calls."""
    calls = 0
    cu_q, cu_k = cu_seqlens()
    for head_dim, dtype, causal in itertools.product(KERNEL_HEAD_DIMS, (torch.float16, torch.bfloat16), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True):
            continue
        # Packed (total, 3, h, d) buffers: strided q, k, v of exactly total rows each.
        q = torch.randn(sum(LENS_Q), 3, 4, head_dim, device="cuda", dtype=dtype)[:, 0].requires_grad_()
        kv = torch.randn(sum(LENS_K), 2, 2, head_dim, device="cuda", dtype=dtype).requires_grad_()
        out = flash_attn_varlen_func(
            q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, deterministic=causal
        )
        out.backward(torch.randn_like(out))
        calls += 1
    return calls


def split_kv():
    """Split-KV forwards, forced (the heuristic leaves shapes this small unsplit); 7 splits of 203 keys leave
    some splits without a key block. Returns the calls."""
    calls = 0
    for splits, head_dim, causal in itertools.product((3, 7), (32, 64, 96, 128, 256), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal):
            continue
        q = torch.randn(2, 17, 4, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, 2, 203, 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
        force = {"num_splits": splits}
        check_forced_plans(q, k, causal, force, passes=("fwd",))
        with force_plan(**force):
            flash_attn_func(q, k, v, causal=causal)
        calls += 1
    return calls


def warp_specialized():
    """Hopper forwards on the warp-specialized kernel (forced, also where the plans would pick another) with more
    units of its persistent schedule than an H200 has SMs, so that CTAs run several tiles, query rows that see no
    key among them (seqlen_q > seqlen_k, causal), and sequences that end inside a tile; without dropout and in its
    dropout form; at head dims 64 and 256 under a causal mask on both of its tiles (the short-key one too). Returns
    the calls."""
    calls = 0
    for head_dim, causal in itertools.product(KERNEL_HEAD_DIMS, (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal):
            continue
        forces = [{"ws": True, "short_keys": False}]
        if head_dim in (64, 256) and causal:
            forces.append({"ws": True, "short_keys": True})
        for force, (sq, sk), dropout_p in itertools.product(forces, ((700, 900), (900, 301)), (0.0, 0.2)):
            q = torch.randn(3, sq, 24, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(2, 3, sk, 8, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
            check_forced_plans(q, k, causal, force, passes=("fwd",), variants={"dropout": dropout_p > 0})
            with force_plan(**force):
                flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
            calls += 1
    return calls


def hopper_backward_calls(head_dim, dtype, causal, force, deterministic=False):
    """One head dim's backwards under force_plan(**force), the warp-specialized and deterministic sections' shapes:
    more tiles than an H200 has SMs, causal pairs of key blocks, sequences that end inside a query block and a key
    block, strided views, GQA, then a variable-length batch whose tiles hold the next sequence's rows and whose last
    sequence's rows run past the tensor. Returns the calls."""
    calls = 0
    for sq, sk in ((1, 700), (700, 900), (900, 301)):
        q = torch.randn(3, sq, 12, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        kv = torch.randn(3, sk, 2, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        check_forced_plans(q, kv[:, :, 0], causal, force, deterministic=deterministic)
        with force_plan(**force):
            out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal, deterministic=deterministic)
            out.backward(torch.randn_like(out))
        calls += 1
    cu_q, cu_k = cu_seqlens()
    q = torch.randn(sum(LENS_Q), 6, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    kv = torch.randn(sum(LENS_K), 2, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    check_forced_plans(q, kv[:, 0], causal, force, deterministic=deterministic, lens=(LENS_Q, LENS_K))
    with force_plan(**force):
        out = flash_attn_varlen_func(
            q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, deterministic=deterministic
        )
        out.backward(torch.randn_like(out))
    return calls + 1


def warp_specialized_backward():
    """Hopper backwards on the warp-specialized kernel (forced), GQA walked per tile and in fp32 slices, in both
    dtypes (hopper_backward_calls). Returns the calls."""
    calls = 0
    for head_dim, dtype, causal, walk in itertools.product(
        (40, 64, 128), (torch.bfloat16, torch.float16), (False, True), (False, True)
    ):
        if flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True):
            force = {"ws": True, "gqa_walk": walk, "short_queries": False}
            calls += hopper_backward_calls(head_dim, dtype, causal, force)
    return calls


def deterministic_backward():
    """Deterministic Hopper backwards: the warp-specialized kernel at head dims 40, 64 and 128 and the wide one from
    160 to 256, GQA walked and in fp32 slices (hopper_backward_calls). Returns the calls."""
    calls = 0
    for head_dim, causal, walk in itertools.product((40, 64, 128, 160, 192, 224, 256), (False, True), (False, True)):
        if flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            force = {"gqa_walk": walk}
            calls += hopper_backward_calls(head_dim, torch.bfloat16, causal, force, deterministic=True)
    return calls


def staggered_backward():
    """Hopper backwards on the wide kernel's staggered walk (forced: stagger=1; deterministic mode runs it by
    default), both dtypes, GQA walked and in fp32 slices (hopper_backward_calls). Returns the calls."""
    calls = 0
    for head_dim, dtype, walk in itertools.product((160, 192, 224, 256), (torch.bfloat16, torch.float16), (0, 1)):
        if flash_attn_cuda.kernel_available(head_dim, dtype, False, backward=True):
            calls += hopper_backward_calls(head_dim, dtype, False, {"stagger": True, "gqa_walk": bool(walk)})
    return calls


def gqa_walk():
    """GQA backwards with every CTA walking its whole group (forced; a Hopper-only path), dense and varlen;
    returns the calls."""
    calls = 0
    cu_q, cu_k = cu_seqlens()
    force = {"gqa_walk": True}
    for head_dim, causal in itertools.product(KERNEL_HEAD_DIMS, (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            continue
        q = torch.randn(2, 77, 6, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 203, 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_forced_plans(q, kv[:, :, 0], causal, force)
        with force_plan(**force):
            out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
            out.backward(torch.randn_like(out))
        q = torch.randn(sum(LENS_Q), 6, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(LENS_K), 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_forced_plans(q, kv[:, 0], causal, force, lens=(LENS_Q, LENS_K))
        with force_plan(**force):
            out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
            out.backward(torch.randn_like(out))
        calls += 2
    return calls


def key_blocks():
    """Backwards with every CTA walking 3 key blocks (forced; Hopper, head dims <= 128), dense and varlen;
    returns the calls."""
    calls = 0
    cu_q, cu_k = cu_seqlens()
    force = {"key_blocks": 3}
    for head_dim, causal in itertools.product((32, 64, 96, 128), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            continue
        for sq, sk in ((1, 700), (300, 200)):
            q = torch.randn(2, sq, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(2, sk, 2, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            check_forced_plans(q, kv[:, :, 0], causal, force)
            with force_plan(**force):
                out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
                out.backward(torch.randn_like(out))
        q = torch.randn(sum(LENS_Q), 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(LENS_K), 2, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_forced_plans(q, kv[:, 0], causal, force, lens=(LENS_Q, LENS_K))
        with force_plan(**force):
            out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
            out.backward(torch.randn_like(out))
        calls += 3
    return calls


def short_queries():
    """Backwards of head dim 128 on the 16-row query tile of the Hopper kernel, forced at every length, and on
    the 64-row one at lengths that otherwise run the 16-row tile; with one and with 3 key blocks per CTA, dense
    and varlen; returns the calls."""
    calls = 0
    cu_q, cu_k = cu_seqlens()
    for short, walk, causal in itertools.product((True, False), (1, 3), (False, True)):
        if not flash_attn_cuda.kernel_available(128, torch.bfloat16, causal, backward=True):
            continue
        force = {"short_queries": short, "key_blocks": walk}
        for sq, sk in ((1, 700), (5, 200), (40, 300)):
            q = torch.randn(2, sq, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv = torch.randn(2, sk, 2, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            check_forced_plans(q, kv[:, :, 0], causal, force)
            with force_plan(**force):
                out = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
                out.backward(torch.randn_like(out))
        q = torch.randn(sum(LENS_Q), 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(sum(LENS_K), 2, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_forced_plans(q, kv[:, 0], causal, force, lens=(LENS_Q, LENS_K))
        with force_plan(**force):
            out = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
            out.backward(torch.randn_like(out))
        calls += 4
    return calls


def fwd_regular_tile():
    """Head dim 128 forwards on the regular Hopper tile at lengths that otherwise run the short-key tile;
    returns the calls."""
    calls = 0
    force = {"short_keys": False}
    for dtype, causal in itertools.product((torch.float16, torch.bfloat16), (False, True)):
        if not flash_attn_cuda.kernel_available(128, dtype, causal):
            continue
        for sq, sk in ((1, 17), (113, 77), (77, 203)):
            q = torch.randn(2, sq, 4, 128, device="cuda", dtype=dtype)
            k, v = torch.randn(2, 2, sk, 2, 128, device="cuda", dtype=dtype).unbind(0)
            check_forced_plans(q, k, causal, force, passes=("fwd",))
            with force_plan(**force):
                flash_attn_func(q, k, v, causal=causal)
            calls += 1
    return calls


def variants():
    """Windows (empty rows, one-sided, wider than the sequence), softcap, ALiBi of both slope shapes and dropout,
    combined, dense and varlen, on both kernel families; returns the calls."""
    calls = 0
    windows = ((0, 0), (5, -1), (-1, 3), (300, 300), (40, 0))
    cu_q, cu_k = cu_seqlens()
    for head_dim, dtype, causal in itertools.product((64, 128, 256), (torch.float16, torch.bfloat16), (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, dtype, causal, backward=True):
            continue
        for i, (sq, sk) in enumerate(((1, 17), (113, 77), (77, 203))):
            q = torch.randn(2, sq, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(2, sk, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
            slopes = torch.rand(2, 4, device="cuda") if i % 2 else torch.rand(4, device="cuda")
            for kernel in ("mma_sync", None):
                with force_plan(kernel=kernel):
                    out = flash_attn_func(
                        q,
                        k,
                        v,
                        dropout_p=0.2 * (i % 2),
                        causal=causal,
                        window_size=windows[(i + (kernel is None)) % len(windows)],
                        softcap=5.0 * (i != 1),
                        alibi_slopes=slopes,
                        deterministic=i == 2,
                    )
                    out.backward(torch.randn_like(out))
                calls += 1
        total_q, total_k = sum(LENS_Q), sum(LENS_K)
        q = torch.randn(total_q, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(total_k, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(LENS_Q),
            max(LENS_K),
            dropout_p=0.1,
            causal=causal,
            window_size=(7, 2),
            softcap=3.0,
            alibi_slopes=torch.rand(len(LENS_Q), 4, device="cuda"),
        )
        out.backward(torch.randn_like(out))
        calls += 1
    return calls


def kvcache():
    """flash_attn_with_kvcache and paged varlen attention: dense caches (with cache_batch_idx into a cache with more
    batch rows) and paged ones (page sizes 16 and 48, shuffled tables with unused pages), appends across page edges
    with rotary embedding (both layouts, full and partial), left padding, GQA decode packing, windows, softcap,
    ALiBi, forced key splits, both kernel families, every kernel head dim; then each call again with out-of-range
    page indices, batch indices, lengths and left padding (which the kernels must clamp), 2^31 - 1 among them.
    Returns the calls."""
    from flash_attn_cuda import flash_attn_with_kvcache

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    big, small = 2**31 - 1, -(2**31)
    calls = 0
    # (page size, kernel family, forced splits, query rows, window, softcap, ALiBi)
    configs = (
        (None, "mma_sync", 0, 1, (-1, -1), 0.0, False),
        (None, None, 3, 7, (20, -1), 5.0, False),
        (16, None, 0, 1, (30, 4), 5.0, False),
        (48, "mma_sync", 5, 7, (-1, -1), 0.0, True),
    )
    for head_dim, dtype in itertools.product(KERNEL_HEAD_DIMS, (torch.float16, torch.bfloat16)):
        if not flash_attn_cuda.kernel_available(head_dim, dtype, True, variants=True):
            continue
        for i, (page_size, kernel, splits, seqlen_q, window, softcap, alibi) in enumerate(configs):
            batch, capacity, new, nheads, nheads_k = 3, 96, 5, 8, 2
            table = batch_idx = None
            if page_size:
                num_pages = batch * capacity // page_size + 3
                shape = (num_pages, page_size, nheads_k, head_dim)
                table = torch.randperm(num_pages, device="cuda")[: batch * capacity // page_size].view(batch, -1)
                table = table.to(torch.int32)
            else:
                shape = (batch + 2, capacity, nheads_k, head_dim)
                batch_idx = torch.randperm(batch + 2, device="cuda")[:batch].to(torch.int32)
            k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
            q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, new, nheads_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
            rotary_dim = head_dim if i % 2 else head_dim // 2
            angle = torch.rand(capacity + seqlen_q, rotary_dim // 2, device="cuda") * 6.3
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            slopes = torch.rand(batch, nheads, device="cuda") if alibi else None
            seqlens = i32((page_size or 16) - 2, 0, capacity - new)
            leftpad = i32(3, 0, 40)
            kwargs = dict(
                rotary_cos=cos,
                rotary_sin=sin,
                block_table=table,
                causal=i % 2 == 1,
                window_size=window,
                softcap=softcap,
                rotary_interleaved=i % 2 == 0,
                alibi_slopes=slopes,
            )
            with force_plan(num_splits=splits, kernel=kernel):
                flash_attn_with_kvcache(
                    q,
                    k_cache,
                    v_cache,
                    k,
                    v,
                    cache_seqlens=seqlens,
                    cache_batch_idx=batch_idx,
                    cache_leftpad=leftpad,
                    **kwargs,
                )
                if page_size:
                    table[0, 0], table[1, -1], table[2, 1] = -5, num_pages + 7, big
                else:
                    batch_idx = i32(batch + 10, -3, big)
                for bad_seqlens, bad_leftpad in (
                    ((big, -5, capacity + 9), (big, small, 2 * capacity)),
                    ((big - 1, small, capacity - 1), (-1, 0, big)),
                ):
                    flash_attn_with_kvcache(
                        q,
                        k_cache,
                        v_cache,
                        k,
                        v,
                        cache_seqlens=i32(*bad_seqlens),
                        cache_batch_idx=batch_idx,
                        cache_leftpad=i32(*bad_leftpad),
                        **kwargs,
                    )
            calls += 3
        for page_size in (16, 48):
            # Paged varlen: an empty sequence, and then a table with out-of-range pages.
            lens_q, lens_k = [3, 0, 17, 5], [40, 0, 90, 0]
            pages_per_seq = -(-max(lens_k) // page_size) + 1
            num_pages = len(lens_q) * pages_per_seq + 2
            table = torch.randperm(num_pages, device="cuda")[: len(lens_q) * pages_per_seq].view(len(lens_q), -1)
            table = table.to(torch.int32)
            k_cache, v_cache = (
                torch.randn(num_pages, page_size, 2, head_dim, device="cuda", dtype=dtype) for _ in range(2)
            )
            q = torch.randn(sum(lens_q), 6, head_dim, device="cuda", dtype=dtype)
            cu_q, cu_k = (
                torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda") for n in (lens_q, lens_k)
            )
            for bad in (False, True):
                if bad:
                    table[0, 0], table[2, 1], table[1, 0] = -7, num_pages + 3, big
                flash_attn_varlen_func(
                    q,
                    k_cache,
                    v_cache,
                    cu_q,
                    cu_k,
                    max(lens_q),
                    max(lens_k),
                    causal=True,
                    window_size=(50, -1),
                    softcap=4.0,
                    block_table=table,
                )
                calls += 1
    return calls


def sinks():
    """Learnable sinks on both kernel families: dense forwards and backwards with GQA, odd lengths and rows that see
    no key (causal with seqlen_q > seqlen_k), varlen batches with empty sequences, forced split-KV forwards (the
    sink joins at the combine), and GQA-packed decoding from a paged cache, whose packed rows read their own heads'
    sinks. Returns the calls."""
    calls = 0
    families = [None, "mma_sync"] if torch.cuda.get_device_capability()[0] == 9 else [None]
    cu_q, cu_k = cu_seqlens()
    for head_dim, family, causal in itertools.product((64, 128), families, (False, True)):
        if not flash_attn_cuda.kernel_available(head_dim, torch.bfloat16, causal, backward=True):
            continue
        force = {} if family is None else {"kernel": family}
        sink = torch.randn(6, device="cuda", dtype=torch.float32).requires_grad_()
        with force_plan(**force):
            for sq, sk in ((113, 77), (77, 203)):
                q = torch.randn(2, sq, 6, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                k, v = torch.randn(2, 2, sk, 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
                out = flash_attn_func(q, k.requires_grad_(), v.requires_grad_(), causal=causal, learnable_sink=sink)
                out.backward(torch.randn_like(out))
                calls += 1
            q = torch.randn(sum(LENS_Q), 6, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
            k, v = torch.randn(2, sum(LENS_K), 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
            out = flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, learnable_sink=sink
            )
            out.backward(torch.randn_like(out))
            calls += 1
        with torch.no_grad():
            q = torch.randn(2, 17, 6, head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(2, 2, 203, 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
            with force_plan(num_splits=7, **force):
                flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
            # One query token, 3 query heads per key/value head, paged: the packed decode path.
            k_cache, v_cache = torch.randn(2, 12, 16, 2, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
            table = torch.randperm(12, device="cuda", dtype=torch.int32).view(3, 4)
            lens = torch.tensor([0, 33, 64], device="cuda", dtype=torch.int32)
            q = torch.randn(3, 1, 6, head_dim, device="cuda", dtype=torch.bfloat16)
            with force_plan(**force):
                flash_attn_cuda.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=causal, s_aux=sink
                )
            calls += 2
    return calls


SECTIONS = [
    dense,
    varlen,
    split_kv,
    warp_specialized,
    warp_specialized_backward,
    deterministic_backward,
    staggered_backward,
    gqa_walk,
    key_blocks,
    short_queries,
    fwd_regular_tile,
    variants,
    kvcache,
    sinks,
]


def main():
    names = sys.argv[1:] or [section.__name__ for section in SECTIONS]
    unknown = set(names) - {section.__name__ for section in SECTIONS}
    if unknown:
        raise SystemExit(f"unknown sections: {sorted(unknown)}")
    torch.manual_seed(0)
    calls = sum(section() for section in SECTIONS if section.__name__ in names)
    torch.cuda.synchronize()
    print(f"memcheck: {calls} calls done")


if __name__ == "__main__":
    main()
