"""Models' attention through our kernels.

A model that trains with attention sinks: a small gpt-oss (HF transformers' GptOss, whose
layers alternate a 128-key sliding window and full causal attention, with a learnable sink per head; its
attention's shapes, GQA 64:8 at head dim 64, with a smaller hidden size, two layers and four experts), its
attention routed to flash_attn_func through transformers' AttentionInterface. Each token's loss and the gradients
of the sinks and of the attention projections meet the correctness rule against the model's own eager attention in
float32 (the reference) and in bfloat16 (the low-precision baseline), the same weights in all three. With the
kernels replaced by the float32 reference rounded to bfloat16, on the CPU, the test passed, and failed with the
window one key wider or without the sinks. Skips where transformers has no GptOss, or the build has no head-dim-64
bf16 kernels.

DeepSeek's multi-head latent attention in prefill form (128 heads, queries and keys of 192 dimensions, values of 128
sliced from the expanded latent), causal: one layer's output and its projections' gradients, with its attention
through flash_attn_func, meet the rule against the same layer with its own eager attention in float32 and in
bfloat16. With the kernels replaced by the float32 reference rounded to bfloat16, on the CPU, it passed, and failed
with the softmax scale of head dim 128, without the causal mask, with every output one bf16 ulp high, and with no
gradient through q or through v. Skips where the build has no head-dim-192 bf16 kernels.
"""

import pytest
import torch
from conftest import check_close, require_fwd_bwd_kernels, requires_gpu

from flash_attn_cuda import flash_attn_func

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

try:
    import transformers
except ImportError:
    transformers = None
HAS_GPT_OSS = transformers is not None and all(
    hasattr(transformers, name) for name in ("GptOssConfig", "GptOssForCausalLM", "AttentionInterface")
)

# transformers (5.x) takes any implementation name that contains "flash" for a flash-attn package to load.
IMPLEMENTATION = "ours_cuda_sinks"


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface on flash_attn_func: (batch, heads, seqlen, head_dim) in, (batch, seqlen,
    heads, head_dim) out. GptOss passes its sink as s_aux and its window as sliding_window, which sees the current
    key and the sliding_window - 1 before it (transformers' sliding_window_overlay). Causal, without padding: the
    test's batches have none, so attention_mask adds nothing."""
    window = kwargs.get("sliding_window")
    out = flash_attn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        learnable_sink=kwargs.get("s_aux"),
    )
    return out, None


def make_model(dtype, implementation):
    """A 2-layer gpt-oss with every expert routed to (so that routing is smooth in the weights and the three models
    route alike), its weights and sinks drawn from a fixed seed."""
    config = transformers.GptOssConfig(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=4,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        head_dim=64,
        num_attention_heads=64,  # gpt-oss's attention: 64 query heads on 8 key/value heads of 64
        num_key_value_heads=8,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,  # yarn's factor 32 over its 4096 original positions
        attn_implementation=implementation,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            # Sinks near the scores (softmax_scale q.k is about N(0, 1) here, over up to 300 keys), one per head.
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads) + 4.0)
    return model.to(device="cuda", dtype=dtype)


def loss_and_grads(model, tokens):
    """Each token's next-token loss, and the gradients of their mean by every layer's sinks, q_proj and o_proj
    weights (float32). Per token: the rule's maxima over hundreds of losses are steady, where one mean's rounding
    error can by chance be small in the baseline."""
    model.zero_grad()
    logits = model(input_ids=tokens).logits.float()
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    losses.mean().backward()
    grads = {}
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for name, param in (
            ("sinks", attention.sinks),
            ("q_proj", attention.q_proj.weight),
            ("o_proj", attention.o_proj.weight),
        ):
            # A parameter the loss did not reach has no gradient: zeros, which the check then rejects.
            grads[f"layer{i}.{name}"] = (
                param.grad.float() if param.grad is not None else torch.zeros_like(param).float()
            )
    return losses.detach(), grads


@pytest.mark.skipif(not HAS_GPT_OSS, reason="no transformers, or one without GptOss or AttentionInterface")
def test_gpt_oss_trains_through_our_kernels():
    # The model's sliding-window layers take the variants kernels, its full layers the causal ones.
    for variants in (False, True):
        require_fwd_bwd_kernels(64, torch.bfloat16, True, variants=variants)
    transformers.AttentionInterface.register(IMPLEMENTATION, flash_attention)
    tokens = torch.randint(0, 512, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(make_model(torch.float32, "eager"), tokens)
    lowp_loss, lowp_grads = loss_and_grads(make_model(torch.bfloat16, "eager"), tokens)
    loss, grads = loss_and_grads(make_model(torch.bfloat16, IMPLEMENTATION), tokens)
    check_close("losses", loss, ref_loss, lowp_loss)
    for name, ref in ref_grads.items():
        check_close(name, grads[name], ref, lowp_grads[name])
    # The sinks' gradients are what this path adds: they must be far from zero for the check above to mean it.
    for i in range(2):
        assert ref_grads[f"layer{i}.sinks"].abs().max() > 0


# ---------------------------------------------------------------- DeepSeek's multi-head latent attention (prefill)

# DeepSeek-V2/V3's attention shapes: 128 heads, each query and key 128 dimensions without position plus 64 rotated
# ones (one rotated key part shared by every head), values of 128; keys and values expanded from a 512-dimension
# latent. A smaller hidden size, and no low-rank query projection, keep the test small.
MLA_HEADS, MLA_NOPE, MLA_ROPE, MLA_V, MLA_LATENT, MLA_HIDDEN = 128, 128, 64, 128, 512, 256


class MlaAttention(torch.nn.Module):
    """One MLA layer in prefill form (keys and values expanded from the latent), its attention through ``attend``:
    (q, k, v) in (batch, seqlen, heads, head dim), q and k of 192 dimensions and v of 128, causal, to (batch,
    seqlen, heads, 128). v is a view of the expanded latent, as a model slices it, not a copy."""

    def __init__(self):
        super().__init__()
        qk_dim = MLA_NOPE + MLA_ROPE
        self.q_proj = torch.nn.Linear(MLA_HIDDEN, MLA_HEADS * qk_dim, bias=False)
        self.kv_a_proj = torch.nn.Linear(MLA_HIDDEN, MLA_LATENT + MLA_ROPE, bias=False)
        self.kv_a_norm = torch.nn.RMSNorm(MLA_LATENT)
        self.kv_b_proj = torch.nn.Linear(MLA_LATENT, MLA_HEADS * (MLA_NOPE + MLA_V), bias=False)
        self.o_proj = torch.nn.Linear(MLA_HEADS * MLA_V, MLA_HIDDEN, bias=False)

    @staticmethod
    def rotate(x, cos, sin):
        """Rotary embedding of the last dim's halves (GPT-NeoX style): x (batch, seqlen, heads, MLA_ROPE)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x, attend):
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device, dtype=torch.float32)
        inv_freq = 10000.0 ** (-torch.arange(0, MLA_ROPE, 2, device=x.device, dtype=torch.float32) / MLA_ROPE)
        angles = positions[:, None] * inv_freq[None, :]  # (seqlen, MLA_ROPE / 2)
        cos, sin = (f(angles)[None, :, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
        q = self.q_proj(x).view(b, s, MLA_HEADS, MLA_NOPE + MLA_ROPE)
        q = torch.cat((q[..., :MLA_NOPE], self.rotate(q[..., MLA_NOPE:], cos, sin)), dim=-1)
        latent, k_rot = self.kv_a_proj(x).split((MLA_LATENT, MLA_ROPE), dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(b, s, MLA_HEADS, MLA_NOPE + MLA_V)
        k_rot = self.rotate(k_rot.view(b, s, 1, MLA_ROPE), cos, sin).expand(b, s, MLA_HEADS, MLA_ROPE)
        k = torch.cat((kv[..., :MLA_NOPE], k_rot), dim=-1)
        v = kv[..., MLA_NOPE:]  # (b, s, heads, MLA_V), rows MLA_NOPE + MLA_V apart
        out = attend(q, k, v)
        return self.o_proj(out.reshape(b, s, MLA_HEADS * MLA_V))


def mla_attend_ours(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def mla_attend_eager(q, k, v):
    """The model's own attention in its dtype: softmax((q k^T) / sqrt(192), causal) v."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) * q.shape[-1] ** -0.5
    s_q, s_k = q.shape[1], k.shape[1]
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(s_k - s_q + 1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.einsum("bhst,bthd->bshd", probs, v)


def mla_outputs_and_grads(dtype, attend, x, target):
    """Each output entry of an MLA layer (weights from a fixed seed) and the gradients of their mean squared
    distance to ``target`` by its projections' weights (float32)."""
    torch.manual_seed(0)
    layer = MlaAttention().to(device="cuda", dtype=dtype)
    out = layer(x.to(dtype), attend)
    loss = (out.float() - target).square().mean()
    loss.backward()
    # A weight the loss did not reach has no gradient: zeros, which the check then rejects.
    grads = {
        name: module.weight.grad.float() if module.weight.grad is not None else torch.zeros_like(module.weight).float()
        for name, module in (("q_proj", layer.q_proj), ("kv_b_proj", layer.kv_b_proj), ("o_proj", layer.o_proj))
    }
    return out.detach().float(), grads


def test_deepseek_mla_prefill_through_our_kernels():
    # (192, 128) runs the head dim 192 kernels, V zero-padded, causal: forward and backward, bf16.
    require_fwd_bwd_kernels(MLA_NOPE + MLA_ROPE, torch.bfloat16, True)
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(2, 300, MLA_HIDDEN, device="cuda", generator=gen)
    target = torch.randn(2, 300, MLA_HIDDEN, device="cuda", generator=gen)
    ref_out, ref_grads = mla_outputs_and_grads(torch.float32, mla_attend_eager, x, target)
    lowp_out, lowp_grads = mla_outputs_and_grads(torch.bfloat16, mla_attend_eager, x, target)
    out, grads = mla_outputs_and_grads(torch.bfloat16, mla_attend_ours, x, target)
    check_close("out", out, ref_out, lowp_out)
    for name, ref in ref_grads.items():
        check_close(name, grads[name], ref, lowp_grads[name])
