"""A tiny random-weight causal LM of any transformers model type, built from that
type's default config with every size shrunk (hidden 64, 2 layers, 8 heads of 8,
4 KV heads, vocab 128, small expert counts), so that TP 2 and 4 divide every
sharded dim. Nothing is downloaded.

    tiny_config("gemma")             # the shrunk config
    --model tpplan.hf.tiny:gemma     # MOD:FN: the model (module attributes are model types)

For the sweep over transformers' causal-LM families (tests/test_hf_sweep.py);
the shrinking is generic (by attribute name), so a family whose config needs
more than that may fail to build: `tiny_config` then raises what transformers said.
"""

from __future__ import annotations

from typing import Any

# attribute name -> tiny value, wherever a config (or its text_config) has it
SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "mlp_dim": 128,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "shared_expert_intermediate_size": 64, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 8, "n_head": 8, "n_heads": 8, "num_heads": 8,
    "num_key_value_heads": 4, "n_kv_heads": 4, "num_kv_heads": 4, "multi_query_group_num": 4,
    "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "max_position_embeddings": 64, "n_positions": 64,
    "initializer_range": 0.2,  # 0.02 makes activations so small that any parity check passes
    "use_cache": False,
    "output_router_logits": False,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def _first(config, names: tuple[str, ...]):
    return next((vars(config)[n] for n in names if isinstance(vars(config).get(n), int)), None)


def _head_dim(config) -> int | None:
    if isinstance(vars(config).get("head_dim"), int):
        return vars(config)["head_dim"]
    hidden, heads = _first(config, ("hidden_size", "n_embd", "d_model")), _first(config, ("num_attention_heads", "n_head"))
    return hidden // heads if hidden and heads else None


def _shrink(config) -> None:
    before = getattr(config, "num_hidden_layers", None)
    head_before = _head_dim(config)
    # MLA (DeepSeek V2 style): kv_b_proj makes a key and value per query head, and eager
    # attention repeats them num_attention_heads // num_key_value_heads times: keep them equal
    mla = "kv_lora_rank" in vars(config) and vars(config).get("num_key_value_heads") == vars(config).get("num_attention_heads")
    for name, value in SIZES.items():
        if name in vars(config) and vars(config)[name] is not None and not isinstance(vars(config)[name], (list, dict)):
            setattr(config, name, value)
    layers = getattr(config, "num_hidden_layers", None)
    for name, value in list(vars(config).items()):
        # per-layer lists (layer_types, ...) follow the layer count
        if isinstance(value, list) and before and layers and len(value) == before and layers < before:
            setattr(config, name, value[:layers])
        elif name in _TOKEN_IDS and isinstance(value, int) and value >= SIZES["vocab_size"]:
            setattr(config, name, SIZES["vocab_size"] - 1 - _TOKEN_IDS.index(name))
        elif name in _TOKEN_IDS and isinstance(value, list):
            setattr(config, name, [v if v < SIZES["vocab_size"] else SIZES["vocab_size"] - 1 for v in value])
    if mla:
        config.num_key_value_heads = config.num_attention_heads
    if isinstance(vars(config).get("qk_head_dim"), int):  # stored, not derived, in some MLA configs
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    head_after = _head_dim(config)
    if isinstance(vars(config).get("rotary_dim"), int) and head_before and head_after:
        # the same rotary fraction of the (now tiny) head, an even number of dims
        config.rotary_dim = max(2, round(config.rotary_dim * head_after / head_before / 2) * 2)
    for name in ("sliding_window", "attention_chunk_size"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, 4)
    sub = getattr(config, "text_config", None)
    if sub is not None and sub is not config and hasattr(sub, "to_dict"):
        _shrink(sub)


def tiny_config(model_type: str):
    """The default config of `model_type`, shrunk. Raises what transformers raises."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    config._attn_implementation = "eager"  # every family has it; sdpa/flex are not universal
    return config


def build(model_type: str):
    """The tiny *ForCausalLM of `model_type` (under the caller's torch.device)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(model_type))


def __getattr__(name: str):
    # `--model tpplan.hf.tiny:gemma`: a factory per model type, made on first use
    if name.startswith("__"):
        raise AttributeError(name)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = name if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else name.replace("_", "-")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise AttributeError(f"{name!r} is not a transformers causal-LM model type")

    def factory():
        return build(model_type)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"transformers' {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}, tiny."
    return factory
