"""A tiny random-weight causal LM of any transformers model type, built from that
type's default config with every size shrunk (hidden 64, 2 layers, 8 heads of 8,
4 KV heads, vocab 128, small expert counts), so that TP 2 and 4 divide every
sharded dim. Nothing is downloaded.

    tiny_config("gemma")                # the shrunk config
    --model tpplan.models.hf_any:gemma  # MOD:FN: the model (module attributes are model types)

`tpplan.models.hf` holds a few named families at one fixed config each (the shipped
plans' models); this module builds any type, for the sweep over transformers'
causal-LM families (tests/test_hf_sweep.py) and `tpplan init` in the README. The
shrinking is generic (by attribute name; FAMILIES adds what a few default
configs lack), so a family whose config needs more than that may fail to build:
`tiny_config` then raises what transformers said (its config validators included).
"""

from __future__ import annotations

from typing import Any

# attribute name -> tiny value, wherever a config (or its text_config) has it
SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "mlp_dim": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
    "shared_expert_intermediate_size": 64, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "num_layers_per_stack": 2,
    "encoder_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 8, "n_head": 8, "n_heads": 8, "num_heads": 8,
    "encoder_attention_heads": 8, "decoder_attention_heads": 8,
    "num_key_value_heads": 4, "n_kv_heads": 4, "num_kv_heads": 4, "multi_query_group_num": 4,
    "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "mamba_n_heads": 16, "mamba_d_head": 8, "mamba_d_state": 16, "mamba_d_ssm": 128,  # heads * head = 2 * hidden
    "max_position_embeddings": 64, "n_positions": 64,
    "initializer_range": 0.2,  # 0.02 makes activations so small that any parity check passes
    "use_cache": False,
    "output_router_logits": False,
}
# sizes a default config leaves None that the model code reads as numbers (a real checkpoint sets them)
UNSET: dict[str, Any] = {"head_dim": 8, "num_key_value_heads": 4}
# what one family's default config lacks for the tiny model to build, or to hold the layers its
# real checkpoints mix (the default has one kind only)
FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default, and its router's topk needs a k
    # its input, recurrent (looped) and output layers must sum to the layers: one of each
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    # 15 of its 35 layers share KV by default: of 2, the last reads the first's; its per-layer widths are a list
    "gemma3n_text": {"num_kv_shared_layers": 1, "intermediate_size": [128, 128]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"expand": 1},  # hidden * expand = num_heads * head_dim
    "reformer": {"axial_pos_embds_dim": (32, 32)},  # they sum to hidden_size
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def _kept_layers(layer_types: Any, before: int, layers: int, each_kind: bool) -> list[int]:
    """The layers the tiny model keeps: the first ones, or with `each_kind` the first of each
    layer type (a hybrid that needs both kinds: linear and full attention), then the first others."""
    if not each_kind or not isinstance(layer_types, (list, tuple)) or len(layer_types) != before:
        return list(range(layers))
    firsts = sorted({t: i for i, t in reversed(list(enumerate(layer_types)))}.values())
    if len(firsts) > layers:
        return list(range(layers))
    rest = [i for i in range(before) if i not in firsts]
    return sorted(firsts + rest[: layers - len(firsts)])


def _first(config, names: tuple[str, ...]):
    return next((vars(config)[n] for n in names if isinstance(vars(config).get(n), int)), None)


def _head_dim(config) -> int | None:
    if isinstance(vars(config).get("head_dim"), int):
        return vars(config)["head_dim"]
    hidden, heads = _first(config, ("hidden_size", "n_embd", "d_model")), _first(config, ("num_attention_heads", "n_head"))
    return hidden // heads if hidden and heads else None


def _shrink(config, each_kind: bool = False) -> None:
    fields = vars(config)
    before = fields.get("num_hidden_layers")
    head_before = _head_dim(config)
    # MLA (DeepSeek V2 style): kv_b_proj makes a key and value per query head, and eager
    # attention repeats them num_attention_heads // num_key_value_heads times: keep them equal
    mla = "kv_lora_rank" in fields and fields.get("num_key_value_heads") == fields.get("num_attention_heads")
    for name, value in SIZES.items():
        if name in fields and fields[name] is not None and not isinstance(fields[name], (list, dict)):
            setattr(config, name, value)
    for name, value in UNSET.items():
        if name in fields and fields[name] is None:
            setattr(config, name, value)
    if "is_decoder" in fields and not fields.get("is_encoder_decoder"):
        config.is_decoder = True  # a causal LM decodes (bert-like families refuse, or attend both ways)
    layers = fields.get("num_hidden_layers")
    keep = _kept_layers(fields.get("layer_types"), before, layers, each_kind) if before and layers and layers < before else None
    for name, value in list(fields.items()):
        # per-layer lists (layer_types, ...) follow the kept layers; a count of them (kv-shared layers) too
        if keep and isinstance(value, (list, tuple)) and len(value) == before:
            setattr(config, name, type(value)(value[i] for i in keep))
        elif keep and name.endswith("_layers") and type(value) is int and value == before:
            setattr(config, name, layers)
        elif name in _TOKEN_IDS and isinstance(value, int) and value >= SIZES["vocab_size"]:
            setattr(config, name, SIZES["vocab_size"] - 1 - _TOKEN_IDS.index(name))
        elif name in _TOKEN_IDS and isinstance(value, list):
            setattr(config, name, [v if v < SIZES["vocab_size"] else SIZES["vocab_size"] - 1 for v in value])
    spec = fields.get("_heterogeneity_spec")
    if keep and spec is not None:  # per-layer overrides (per_layer_config), keyed by layer index
        overrides = {new: dict(spec.per_layer_overrides[old]) for new, old in enumerate(keep) if old in spec.per_layer_overrides}
        for override in overrides.values():
            override.update({k: SIZES[k] for k in override if k in SIZES and isinstance(override[k], int)})
        config.per_layer_config = None
        config.per_layer_config = overrides
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
        _shrink(sub, each_kind)
    for name in ("vision_config", "audio_config"):  # encoders a text forward never runs: only fewer layers
        encoder = getattr(config, name, None)
        for depth in ("num_hidden_layers", "num_blocks"):
            if encoder is not None and isinstance(vars(encoder).get(depth), int) and vars(encoder)[depth] > 2:
                setattr(encoder, depth, 2)


def tiny_config(model_type: str):
    """The default config of `model_type`, shrunk. Raises what transformers raises."""
    config = _tiny(model_type, each_kind=False)
    try:  # the checks save_pretrained makes (strict dataclass validators), failing here
        config.validate()
    except Exception:  # whatever transformers' validator raises: once more keeping each kind of layer
        config = _tiny(model_type, each_kind=True)  # (OLMo hybrid wants an attention layer)
        config.validate()
    return config


def _tiny(model_type: str, each_kind: bool):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config, each_kind)
    for name, value in FAMILIES.get(model_type, {}).items():
        setattr(config, name, value)
    config._attn_implementation = "eager"  # every family has it; sdpa/flex are not universal
    return config


def build(model_type: str):
    """The tiny *ForCausalLM of `model_type` (under the caller's torch.device)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(model_type))


def __getattr__(name: str):
    # `--model tpplan.models.hf_any:gemma`: a factory per model type, made on first use
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
