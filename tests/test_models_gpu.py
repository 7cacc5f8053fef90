"""A model that trains with attention sinks, through our kernels: a small gpt-oss (HF transformers' GptOss, whose
layers alternate a 128-key sliding window and full causal attention, with a learnable sink per head; its
attention's shapes, GQA 64:8 at head dim 64, with a smaller hidden size, two layers and four experts), its
attention routed to flash_attn_func through transformers' AttentionInterface. Each token's loss and the gradients
of the sinks and of the attention projections meet the correctness rule against the model's own eager attention in
float32 (the reference) and in bfloat16 (the low-precision baseline), the same weights in all three. With the
kernels replaced by the float32 reference rounded to bfloat16, on the CPU, the test passed, and failed with the
window one key wider or without the sinks. Skips where transformers has no GptOss, or the build has no head-dim-64
bf16 kernels.
"""

import pytest
import torch
from conftest import check_close, require_fwd_bwd_kernels, requires_gpu

from flash_attn_cuda import flash_attn_func

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.usefixtures("seeded_exact_reference")]

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, name) for name in ("GptOssConfig", "GptOssForCausalLM", "AttentionInterface")):
    pytest.skip("this transformers has no GptOss or no AttentionInterface", allow_module_level=True)

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
