"""Plain PyTorch attention used as the ground truth in tests and benchmarks.

It materialises the full score matrix, so it is meant for moderate sequence lengths only.

The attention variants follow the semantics of the kernels (and of flash-attn 2.x):

- Query row i sits at key position p = i + seqlen_k - seqlen_q: the masks are aligned to the bottom-right corner
  of the score matrix, so that the last query row is the last key.
- A sliding window (left, right) lets position p see key j iff j >= p - left (unless left < 0) and j <= p + right
  (unless right < 0). causal=True is the window with right = 0 (it keeps left).
- softcap c > 0 replaces the scaled score s by c * tanh(s / c); ALiBi then adds -slope * |p - j|; the masked scores
  become -inf; softmax; dropout last, on the probabilities.
- A row that sees no key has out = 0 and lse = +inf, so that exp(score - lse) is 0 in its backward.
- A learnable sink (one logit per query head, FlashAttention-4's ``learnable_sink``, gpt-oss's attention sinks)
  joins every row's softmax denominator and carries no value: out = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) +
  exp(sink - M)), M the larger of the row's max score and the sink, and the LSE includes it. A row that sees no key
  then has out = 0 and lse = sink (the sink takes all of the row's mass). Dropout never drops the sink's share.
- V's head dim may differ from Q's and K's (d_v != d_qk, DeepSeek's MLA): out has V's head dim.
- Dropout acts at a resolution of 1/256 (the kernels draw 8 random bits per probability): an entry is dropped
  with probability p' = effective_dropout_p(p), round(256 p) / 256 but at least 1/256, and the kept ones are
  scaled by dropout_keep_scale(p) = 1 / (1 - p), as flash-attn 2.x and PyTorch scale them (the expected output
  is then (1 - p') / (1 - p) times the undropped one: from p = 1/512 up, within 1/512 / (1 - p) of it).
"""

from __future__ import annotations

import math

import torch


def effective_dropout_p(dropout_p: float) -> float:
    """The dropout probability the kernels apply for ``dropout_p``: round(256 p) / 256, at least 1/256 and at most
    255/256 for p > 0, and 0 for p = 0 (each probability is dropped when 8 random bits fall below 256 p')."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return 0.0
    return min(max(math.floor(float(dropout_p) * 256.0 + 0.5), 1), 255) / 256.0


def dropout_keep_scale(dropout_p: float) -> float:
    """The factor the kernels scale kept probabilities by: 1 / (1 - dropout_p), of the p asked for (not of
    effective_dropout_p), as flash-attn 2.x and PyTorch's own kernels; 1 for p = 0."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return 1.0 / (1.0 - float(dropout_p))


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Which keys each query row sees: bool (seqlen_q, seqlen_k), True where row i may attend to key j.

    Args:
        causal: the same as window_size[1] = 0 (window_size[0] is kept).
        window_size: (left, right); a negative bound is no bound on that side.
    """
    left, right = window_size
    if causal:
        right = 0
    # Bottom-right alignment: row i stands at key position p, which is negative for the first rows when
    # seqlen_q > seqlen_k.
    pos = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= col >= pos - left
    if right >= 0:
        visible &= col <= pos + right
    return visible


def _alibi_bias(
    alibi_slopes: torch.Tensor,
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.Tensor:
    """(batch or 1, nheads, seqlen_q, seqlen_k) in ``dtype``: -slope[b, h] * |p - j|."""
    if alibi_slopes.shape == (nheads,):
        slopes = alibi_slopes.unsqueeze(0)  # one set of slopes for every batch row
    elif alibi_slopes.shape == (batch, nheads):
        slopes = alibi_slopes
    else:
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}"
        )
    slopes = slopes.to(device=device, dtype=dtype)
    pos = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k, device=device).unsqueeze(0)
    distance = (pos - col).abs().to(dtype)  # exact below 2^24 in float32
    return -slopes[:, :, None, None] * distance


def _masked_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores fed to the softmax, (batch, nheads, seqlen_q, seqlen_k) in q's dtype, -inf where masked,
    and the visible mask (seqlen_q, seqlen_k). q and k must already have the dtype to compute in."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])

    # GQA/MQA: expand the key heads so that query head h reads kv head h // group.
    k = k.repeat_interleave(nheads // nheads_k, dim=2)
    qk = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if softcap > 0:
        # c * tanh(scale * qk / c), with scale / c folded into one multiplier as the kernels do, so that the
        # low-precision baseline rounds once before the tanh rather than twice.
        scores = torch.tanh(qk * (softmax_scale / softcap)) * softcap
    else:
        scores = qk * softmax_scale

    batch, _, seqlen_q, seqlen_k = scores.shape
    if alibi_slopes is not None:
        # The slopes are float32 by contract and the distances are exact integers, so a float32 product (float64
        # for float64 scores) is the exact bias rounded once, as in the kernels; a low-precision baseline rounds
        # it once more, to its own dtype, and adds it in that dtype.
        wide = torch.promote_types(scores.dtype, torch.float32)
        bias = _alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k, wide, q.device)
        scores = scores + bias.to(scores.dtype)

    visible = visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    return scores.masked_fill(~visible, float("-inf")), visible


def _sink_column(scores: torch.Tensor, learnable_sink: torch.Tensor) -> torch.Tensor:
    """The sink logits as one more key column of ``scores`` (batch, nheads, seqlen_q, 1), in scores' dtype."""
    batch, nheads, seqlen_q, _ = scores.shape
    if learnable_sink.shape != (nheads,):
        raise ValueError(f"learnable_sink must have shape ({nheads},), got {tuple(learnable_sink.shape)}")
    sink = learnable_sink.to(device=scores.device, dtype=scores.dtype)
    return sink[None, :, None, None].expand(batch, nheads, seqlen_q, 1)


def _softmax(
    scores: torch.Tensor, visible: torch.Tensor, learnable_sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over the keys (with the sink in the denominator, its own share left out) and the float32
    natural-log LSE of each row. A row that sees no key gets probabilities 0 (rather than NaN) and LSE +inf, or the
    sink's logit with one."""
    if learnable_sink is not None:
        # The sink as one more key that carries no value: every row then has a finite entry, and a row that sees no
        # key gives the sink all of its mass.
        extended = torch.cat((scores, _sink_column(scores, learnable_sink)), dim=-1)
        return torch.softmax(extended, dim=-1)[..., :-1], torch.logsumexp(extended, dim=-1).float()
    # A row with no visible key (causal with seqlen_q > seqlen_k, a window that misses every key, or seqlen_k == 0)
    # has a logsumexp of -inf; the kernel's convention is lse = +inf, so that exp(score - lse) is 0 for such rows.
    empty_rows = ~visible.any(dim=-1)  # (seqlen_q,)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty_rows.unsqueeze(-1), 0.0)
    return probs, torch.logsumexp(scores, dim=-1).float().masked_fill(empty_rows, float("inf"))


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 softmax probabilities P of attention_ref (before dropout).

    Args: as attention_ref.

    Returns:
        float32 (batch, nheads, seqlen_q, seqlen_k); 0 where a key is masked and in the rows that see no key. With
        learnable_sink a row sums to 1 minus the sink's share.
    """
    scores, visible = _masked_scores(q.float(), k.float(), softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _softmax(scores, visible, learnable_sink)[0]


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    upcast: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with the same layout and semantics as ``flash_attn2.fwd``.

    Args:
        q: (batch, seqlen_q, nheads, head_dim).
        k: (batch, seqlen_k, nheads_k, head_dim); nheads must be a multiple of nheads_k
            (each key/value head serves nheads // nheads_k consecutive query heads).
        v: (batch, seqlen_k, nheads_k, head_dim_v); head_dim_v may differ from head_dim.
        softmax_scale: multiplier of q @ k^T; defaults to 1 / sqrt(head_dim).
        causal: query row i sees key j iff j <= i + seqlen_k - seqlen_q (the mask is aligned
            to the bottom-right corner of the score matrix). The same as window_size[1] = 0.
        upcast: compute in float32 and return a float32 ``out``; otherwise compute entirely in
            the input dtype, which gives the low-precision baseline of the correctness rule.
        window_size: (left, right): row i, at key position p = i + seqlen_k - seqlen_q, sees key j iff
            j >= p - left and j <= p + right; a negative bound is no bound on that side.
        softcap: if > 0, a score s = softmax_scale * q.k becomes softcap * tanh(s / softcap).
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds -slope * |p - j| to the score of key j
            (after softcap).
        dropout_p: dropout probability; the kept probabilities are scaled by dropout_keep_scale(dropout_p),
            1 / (1 - dropout_p) (the mask drops with effective_dropout_p(dropout_p)).
        dropout_mask: bool (batch, nheads, seqlen_q, seqlen_k), True where an entry is kept; required when
            dropout_p > 0 (flash_attn_cuda.dropout.keep_mask gives the kernels' mask).
        learnable_sink: (nheads,), one logit per query head (float32, or q's dtype), computed in the dtype of the
            rest; it joins each row's softmax denominator and adds no value. Dropout leaves its share alone.

    Returns:
        out: (batch, seqlen_q, nheads, head_dim_v). Rows that see no key are 0.
        lse: float32 (batch, nheads, seqlen_q), natural-log logsumexp of the scores (with softcap and
            ALiBi, without dropout), and of the sink with one. Rows that see no key are +inf, or the sink.
    """
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("dropout_p > 0 needs a dropout_mask")
    if upcast:
        q, k, v = q.float(), k.float(), v.float()

    scores, visible = _masked_scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    probs, lse = _softmax(scores, visible, learnable_sink)

    if dropout_mask is not None:
        # Dropout acts on the probabilities only: the lse above stays that of the full softmax, which is what
        # the kernels store and what their backward recomputes P from.
        probs = probs * dropout_mask.to(probs.device) * dropout_keep_scale(dropout_p)

    group = q.shape[2] // k.shape[2]
    v = v.repeat_interleave(group, dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def sink_grad_ref(
    out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, learnable_sink: torch.Tensor
) -> torch.Tensor:
    """The gradient of a loss with respect to learnable_sink, from the forward's out and lse and the loss's dout.

    The sink's probability in row i is exp(sink - lse_i), and raising the sink scales every key probability of
    the row by 1 minus that share, so d out_i / d sink = -exp(sink - lse_i) out_i and

        d sink_h = -sum over batch and rows i of exp(sink_h - lse_{b,h,i}) * D_{b,h,i},  D = rowsum(dout * out),

    the D that the backward computes anyway (with dropout too: out is the dropped output, whose dout it is).

    Args:
        out, dout: (batch, seqlen_q, nheads, head_dim_v).
        lse: float32 (batch, nheads, seqlen_q), attention_ref's with the sink.
        learnable_sink: (nheads,).

    Returns:
        float32 (nheads,).
    """
    d = (dout.float() * out.float()).sum(dim=-1).transpose(1, 2)  # (batch, nheads, seqlen_q)
    share = torch.exp(learnable_sink.float()[None, :, None] - lse.float())
    return -(share * d).sum(dim=(0, 2))


# ---- KV caches (flash_attn_with_kvcache) ----


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotary embedding of x at the given positions, computed in x's dtype (cast cos and sin to it first).

    Args:
        x: (batch, seqlen, nheads, head_dim).
        cos, sin: (seqlen_ro, rotary_dim / 2); rotary_dim <= head_dim.
        positions: int (batch, seqlen): the position of each row of x.
        interleaved: rotate pairs (2i, 2i + 1) (GPT-J) if True, else (i, i + rotary_dim / 2) (GPT-NeoX).

    Returns:
        x with its first rotary_dim features of each row rotated by the angle of its position: a pair (x0, x1)
        becomes (x0 cos - x1 sin, x0 sin + x1 cos); the other features unchanged.
    """
    half = cos.shape[1]
    rotary_dim = 2 * half
    c = cos.to(x.dtype)[positions].unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin.to(x.dtype)[positions].unsqueeze(2)
    rot = x[..., :rotary_dim]
    if interleaved:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def rotary_per_row(causal: bool, window_size: tuple[int, int], seqlen_q: int, capacity: int, alibi: bool) -> bool:
    """Whether flash_attn_with_kvcache rotates query row i at cache_seqlens[b] + i (True) or every row at
    cache_seqlens[b]: per row when causal (one query row without ALiBi counts as not causal) or when the window is
    bounded on a side (a side at or past the cache's capacity counting as unbounded), as in flash-attn 2.x."""
    left, right = window_size
    left = -1 if left >= capacity else left
    right = -1 if right >= capacity else right
    is_causal = causal and not (seqlen_q == 1 and not alibi)
    return is_causal or left >= 0 or right >= 0


def _cache_rows(
    cache: torch.Tensor, b: int, block_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None
) -> torch.Tensor:
    """Sequence b's cache rows (capacity, nheads_k, head_dim) as a view (dense) or gathered copy (paged)."""
    if block_table is not None:
        return cache[block_table[b].long()].flatten(0, 1)
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return cache[row]


def kvcache_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    upcast: bool = True,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache in plain PyTorch, one sequence at a time (small sizes only).

    Args: as flash_attn_with_kvcache, with cache_seqlens an int32 tensor (or None) and indices in range (the
        kernels clamp bad ones; this does not). upcast: compute everything (rotary included) in float32,
        otherwise in the inputs' dtype (the low-precision baseline). learnable_sink: as attention_ref's.

    Returns:
        (out, lse, k_cache, v_cache): out (batch, seqlen_q, nheads, head_dim_v) and lse (batch, nheads, seqlen_q) as
        attention_ref's; the caches after the append, new tensors (float32 with upcast) with the caches' shape.
    """
    dtype = torch.float32 if upcast else q.dtype
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype).clone(), v_cache.to(dtype).clone()
    batch, seqlen_q, nheads, head_dim = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        cached = torch.full((batch,), capacity, dtype=torch.long)
    else:
        cached = cache_seqlens.long().cpu()
    seqlen_new = 0
    if k is not None:
        k, v = k.to(dtype), v.to(dtype)
        seqlen_new = k.shape[1]
        if rotary_cos is not None:
            positions = cached.to(q.device)[:, None] + torch.arange(seqlen_new, device=q.device)
            k = apply_rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
            per_row = rotary_per_row(causal, window_size, seqlen_q, capacity, alibi_slopes is not None)
            offsets = (
                torch.arange(seqlen_q, device=q.device)
                if per_row
                else torch.zeros(seqlen_q, dtype=torch.long, device=q.device)
            )
            q = apply_rotary(q, rotary_cos, rotary_sin, cached.to(q.device)[:, None] + offsets, rotary_interleaved)
        for b in range(batch):
            rows = torch.arange(int(cached[b]), int(cached[b]) + seqlen_new)
            if block_table is not None:
                pages = block_table[b].long().cpu()[rows // k_cache.shape[1]]
                k_cache[pages, rows % k_cache.shape[1]] = k[b]
                v_cache[pages, rows % v_cache.shape[1]] = v[b]
            else:
                row = b if cache_batch_idx is None else int(cache_batch_idx[b])
                k_cache[row, rows] = k[b]
                v_cache[row, rows] = v[b]
    outs, lses = [], []
    for b in range(batch):
        end = min(int(cached[b]) + seqlen_new, capacity)
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys = _cache_rows(k_cache, b, block_table, cache_batch_idx)[start:end]
        values = _cache_rows(v_cache, b, block_table, cache_batch_idx)[start:end]
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        out, lse = attention_ref(
            q[b : b + 1],
            keys[None],
            values[None],
            softmax_scale,
            causal,
            upcast=False,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            learnable_sink=learnable_sink,
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache
