"""Plain PyTorch attention used as the ground truth in tests and benchmarks.

It materialises the full score matrix, so it is meant for moderate sequence lengths only.
"""

import math

import torch


def attention_ref(q, k, v, softmax_scale=None, causal=False, upcast=True):
    """Softmax attention with the same layout and semantics as ``flash_attn2.fwd``.

    Args:
        q: (batch, seqlen_q, nheads, head_dim).
        k, v: (batch, seqlen_k, nheads_k, head_dim); nheads must be a multiple of nheads_k
            (each key/value head serves nheads // nheads_k consecutive query heads).
        softmax_scale: multiplier of q @ k^T; defaults to 1 / sqrt(head_dim).
        causal: query row i sees key j iff j <= i + seqlen_k - seqlen_q (the mask is aligned
            to the bottom-right corner of the score matrix).
        upcast: compute in float32 and return a float32 ``out``; otherwise compute entirely in
            the input dtype, which gives the low-precision baseline of the correctness rule.

    Returns:
        out: (batch, seqlen_q, nheads, head_dim). Rows that see no key are 0.
        lse: float32 (batch, nheads, seqlen_q), natural-log logsumexp of the scaled scores.
            Rows that see no key are +inf.
    """
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if upcast:
        q, k, v = q.float(), k.float(), v.float()

    # GQA/MQA: expand the key/value heads so that query head h reads kv head h // group.
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    seqlen_q, seqlen_k = scores.shape[-2:]
    row = torch.arange(seqlen_q, device=q.device).unsqueeze(1)
    col = torch.arange(seqlen_k, device=q.device).unsqueeze(0)
    visible = col <= row + (seqlen_k - seqlen_q) if causal else torch.ones_like(col <= row)
    scores = scores.masked_fill(~visible, float("-inf"))

    probs = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1).float()
    # A row with no visible key (causal with seqlen_q > seqlen_k, or seqlen_k == 0) has a NaN softmax
    # and a logsumexp of -inf; the kernel's convention is out = 0 and lse = +inf, so that
    # exp(score - lse) is 0 for such rows.
    empty_rows = ~visible.any(dim=-1)  # (seqlen_q,)
    probs = probs.masked_fill(empty_rows.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(empty_rows, float("inf"))

    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse
