"""Tiny random-weight HuggingFace models, for `--model tpplan.models.hf:llama` and the tests.

Every factory builds from a small config (hidden 64, 2 layers, 8 query heads and
4 KV heads, so TP 2 and 4 divide every sharded dim) and never names a device:
the CLI calls them under `with torch.device("meta")`. Needs `transformers`
(`pip install tpplan[hf]`). No weights are downloaded.
"""

from __future__ import annotations

from typing import Any

# The sizes every family shares. vocab and intermediate sizes divide by 8 too,
# so a vocab-parallel embedding and colwise MLPs shard evenly at TP 2 and 4.
TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,  # HF's 0.02 makes activations so small that any parity check passes
    tie_word_embeddings=False,
    use_cache=False,
)


def _build(config_cls_name: str, model_cls_name: str, attn_implementation: str, **overrides: Any):
    import transformers

    config = getattr(transformers, config_cls_name)(**{**TINY, **overrides})
    # Set on the config rather than passed to the model constructor, which ignores it.
    config._attn_implementation = attn_implementation
    return getattr(transformers, model_cls_name)(config)


def llama(attn_implementation: str = "sdpa"):
    """LlamaForCausalLM, GQA (8 query heads, 4 KV heads)."""
    return _build("LlamaConfig", "LlamaForCausalLM", attn_implementation)


def llama_tied(attn_implementation: str = "sdpa"):
    """LlamaForCausalLM whose lm_head shares its weight with model.embed_tokens."""
    return _build("LlamaConfig", "LlamaForCausalLM", attn_implementation, tie_word_embeddings=True)


def qwen2(attn_implementation: str = "sdpa"):
    """Qwen2ForCausalLM: biases on q/k/v, none on o_proj."""
    return _build("Qwen2Config", "Qwen2ForCausalLM", attn_implementation)


def mistral(attn_implementation: str = "sdpa"):
    """MistralForCausalLM with a 4-token sliding window, so masks are not plain causal."""
    return _build("MistralConfig", "MistralForCausalLM", attn_implementation, sliding_window=4)


def qwen3(attn_implementation: str = "sdpa"):
    """Qwen3ForCausalLM: per-head RMSNorms q_norm/k_norm inside attention."""
    return _build("Qwen3Config", "Qwen3ForCausalLM", attn_implementation, head_dim=8)


def phi3(attn_implementation: str = "sdpa"):
    """Phi3ForCausalLM: fused qkv_proj and gate_up_proj."""
    return _build("Phi3Config", "Phi3ForCausalLM", attn_implementation, pad_token_id=0)


def qwen2_moe(attn_implementation: str = "sdpa"):
    """Qwen2MoeForCausalLM: every layer sparse (4 routed experts, top 2, plus a shared expert),
    as Qwen1.5-MoE-A2.7B. The routed experts are fused 3-D parameters (`experts.gate_up_proj`)."""
    return _build(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        attn_implementation,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )


def mixtral(attn_implementation: str = "sdpa"):
    """MixtralForCausalLM: 4 routed experts, top 2, stored as fused 3-D parameters."""
    return _build(
        "MixtralConfig",
        "MixtralForCausalLM",
        attn_implementation,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
    )


def qwen3_moe(attn_implementation: str = "sdpa"):
    """Qwen3MoeForCausalLM: every layer sparse (4 routed experts, top 2, no shared expert),
    per-head q_norm/k_norm in attention."""
    return _build(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        attn_implementation,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )


def gpt_oss(attn_implementation: str = "eager"):
    """GptOssForCausalLM: 4 routed experts (top 2) with biases, gate/up interleaved and stored
    transposed ([E, H, 2I]); attention with per-head sinks and biases, alternating sliding and
    full attention. Eager attention: transformers' sdpa path has no sinks."""
    return _build(
        "GptOssConfig",
        "GptOssForCausalLM",
        attn_implementation,
        head_dim=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        output_router_logits=False,
    )


def apertus(attn_implementation: str = "sdpa"):
    """ApertusForCausalLM: xIELU activation with learnable alpha_p/alpha_n between the MLP's
    up_proj and down_proj; per-head q_norm/k_norm."""
    return _build(
        "ApertusConfig",
        "ApertusForCausalLM",
        attn_implementation,
        head_dim=8,
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 12000000.0},
    )


def llama_kv2(attn_implementation: str = "sdpa"):
    """LlamaForCausalLM with 2 KV heads (8 query heads): TP 4 and 8 need replicated KV heads."""
    return _build("LlamaConfig", "LlamaForCausalLM", attn_implementation, num_key_value_heads=2)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_config():
    """peft LoRA adapters (r 4) on every projection, only they train; lora_B random
    (peft's default zeros would make the adapters' forward a no-op to compare)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False)


def _lora(model):
    """The adapters of `_lora_config` in place: the module paths stay the model's
    (inject_adapter_in_model, not get_peft_model's base_model.model. prefix)."""
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(_lora_config(), model)


def llama_lora(attn_implementation: str = "sdpa"):
    """`llama` with LoRA adapters (needs peft)."""
    return _lora(llama(attn_implementation))


def qwen3_lora(attn_implementation: str = "sdpa"):
    """`qwen3` with LoRA adapters (needs peft)."""
    return _lora(qwen3(attn_implementation))


def llama_peft(attn_implementation: str = "sdpa"):
    """`llama_lora` as people hold it: peft's PeftModel (get_peft_model), the model
    under base_model.model, where the model's plan applies as it is."""
    from peft import get_peft_model

    return get_peft_model(llama(attn_implementation), _lora_config())


def llama_kv2_lora(attn_implementation: str = "sdpa"):
    """`llama_kv2` with LoRA adapters: at TP 4 the KV heads, and their lora_B, are replicated."""
    return _lora(llama_kv2(attn_implementation))


FACTORIES = {
    "llama": llama,
    "llama_tied": llama_tied,
    "qwen2": qwen2,
    "mistral": mistral,
    "qwen3": qwen3,
    "phi3": phi3,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
    "apertus": apertus,
    "llama_kv2": llama_kv2,
}
