"""Style names of other tools, and what a tpplan plan writes instead: the
"did you mean" of an unknown style (TP103) for a user coming from torch's
`parallelize_module` (class names) or from transformers' `tp_plan` (strings).

The transformers entries are the one table of transformers' style strings:
tpplan.hf.importer maps (or leaves out, with these reasons) each string by
them, and tpplan.interop's export writes a rule back as the string whose
entry it equals; kept here because the plan core cannot import the hf layer.
"""

from __future__ import annotations

from typing import Any

# torch.distributed.tensor.parallel's classes (and tpplan's NoParallel) -> tpplan style name
TORCH_CLASSES = {
    "ColwiseParallel": "colwise",
    "RowwiseParallel": "rowwise",
    "SequenceParallel": "sequence_parallel",
    "PrepareModuleInput": "prepare_module_input",
    "PrepareModuleOutput": "prepare_module_output",
    "PrepareModuleInputOutput": "prepare_module_input_output",
    "NoParallel": "no_parallel",
}

# transformers' tp_plan strings that name a tpplan style of the same name -> the rule value to write
# (transformers' sequence_parallel hands on local tensors: use_local_output)
TRANSFORMERS_SAME_NAME: dict[str, Any] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "sequence_parallel": {"style": "sequence_parallel", "use_local_output": True},
}

# transformers' tp_plan strings with a tpplan equivalent of another name -> the rule value to write
TRANSFORMERS_EQUIVALENTS: dict[str, Any] = {
    "colwise_rep": {"style": "colwise", "output_layouts": "replicate"},
    "colwise_gather_output": {"style": "colwise", "output_layouts": "replicate"},
    "rowwise_rep": {"style": "rowwise", "input_layouts": "replicate"},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": "replicate"},
    # Vocab-parallel: torch's rowwise on an Embedding shards the vocabulary.
    "embedding_rowwise": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "replicate"},
    "embedding_colwise": {"style": "colwise", "output_layouts": "replicate"},
    # Whole heads per rank, replicated when the degree exceeds their count (transformers 5.25's GQA k/v_proj;
    # at a degree that is no multiple of them transformers replicates groups of heads, which the lint reports: TP311).
    "unit_colwise": {"style": "colwise", "heads": "auto"},
    # Sum the ranks' partial outputs forward, identity backward.
    "all_reduce": {"style": "prepare_module_output", "output_layouts": "partial", "desired_output_layouts": "replicate"},
    # a module on head-sharded activations: replicated parameters, their gradients summed
    # (import-hf also declares the dim its heads are on: input_layouts shard(-2) or shard(1))
    "replicated_with_grad_allreduce": "local_params",
    # Fused 3-D experts: every expert sharded on its intermediate dim (the packed
    # gate_up_proj and down_proj parameter entries are expert_tp's defaults).
    "moe_tp_experts": "expert_tp",
    # base_model_ep_plan (--ep): whole experts per rank, tokens replicated.
    "ep_dispatch_experts": {"style": "expert_parallel", "dispatch": "all_reduce"},
}

# Every transformers string with a sound tpplan equivalent, in the order export prefers one
# where several strings mean the same rule (colwise_rep before colwise_gather_output).
TRANSFORMERS_STYLES: dict[str, Any] = {**TRANSFORMERS_SAME_NAME, **TRANSFORMERS_EQUIVALENTS}

# transformers' tp_plan strings whose tpplan equivalent takes an option from the model
# config -> (style, option, config attribute)
TRANSFORMERS_FROM_CONFIG: dict[str, tuple[str, str, str]] = {
    # the gradient of the rotary key slice of an MLA kv_a_proj_with_mqa summed over the mesh
    "mla_kv_a_proj": ("sum_output_grad", "last", "qk_rope_head_dim"),
}

_LOCAL = "it runs the module on local shards outside DTensor, which no torch style does"
_EP = "it is expert parallelism, not tensor parallelism"
# transformers' tp_plan strings without one -> why: the reason import-hf gives for the entry it
# leaves out, and the "did you mean" of a plan that names it (what to do instead follows there)
TRANSFORMERS_WITHOUT_EQUIVALENT = {
    "packed_colwise": "it shards a fused [gate; up] weight with a strided shard, which no torch style expresses "
    "(colwise would shard it contiguously, pairing one rank's gate with another's up; in an experts module, expert_tp does it)",
    "packed_rowwise": "it shards a fused weight with a strided shard, which no torch style expresses "
    "(in an experts module, expert_tp does it)",
    "moe_identity_expert": "it divides an identity expert's input by the TP degree, only to undo moe_tp_experts' sum",
    # import-hf maps it where the config gives the width (TRANSFORMERS_FROM_CONFIG); this is why it cannot otherwise
    "mla_kv_a_proj": "it all-reduces the gradient of only the rotary slice of the output (sum_output_grad), "
    "whose width this config does not give (no qk_rope_head_dim)",
    "local_params": _LOCAL,
    "local_colwise": _LOCAL + " (the closest is colwise: DTensor parameters, a local output)",
    "local_rowwise": _LOCAL + " (the closest is rowwise: DTensor parameters, a local output)",
    "local": _LOCAL,
    "local_packed_rowwise": _LOCAL,
    "replicated_with_grad_allreduce_local": _LOCAL,
    "gather": "it gathers a local output outside DTensor (the closest is a colwise rule with output_layouts: replicate)",
    "unit_rowwise": "it shards an output projection by whole query heads, replicated above their count, which "
    "no torch style expresses (rowwise is the same when the degree divides the query heads)",
    "grouped_gemm": "it shards one expert parameter by expert index: write expert_parallel on the experts module",
    "isolated": _EP,
}


# transformers' strings for what tpplan does to a module no rule names -> (what that is, what a plan
# that names the string writes instead); import-hf leaves these entries out: no rule needed
TRANSFORMERS_NO_RULE = {
    "replicate": ("full parameters on every rank, which every module no rule names keeps",
                  "delete this rule (or write no_parallel for replicated DTensor parameters)"),
    "ep_router": ("a router left whole on every rank (expert_parallel's all_reduce dispatch routes the "
                  "replicated tokens on every rank), as every module no rule names keeps", "delete this rule"),
}


# Other words for a style, as people write them (Megatron's ColumnParallelLinear and
# RowParallelLinear, torch's Replicate placement): the name normalised (lower case,
# no '_' or '-'; `*` any ending) -> the style. Looked up after the exact names above,
# so `colwise_rep` and transformers' `replicate` keep their own answers.
SYNONYMS = {
    "col*": "colwise",  # column, column_parallel, col_parallel, ColumnParallelLinear
    "row*": "rowwise",  # row, row_parallel, RowParallelLinear
    "replicate": "no_parallel",  # Replicate
    "replicated": "no_parallel",
}


def flow(value: Any) -> str:
    """A rule value as YAML flow text: `colwise`, `{style: colwise, output_layouts: replicate}`."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {flow(item)}" for key, item in value.items()) + "}"
    return str(value)


def _normal(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


_TORCH_BY_NORMAL = {_normal(name): (name, style) for name, style in TORCH_CLASSES.items()}


def suggestion(style: str) -> str | None:
    """What to write instead of the unknown style `style`, when another tool names it so."""
    torch_name = _TORCH_BY_NORMAL.get(_normal(style))
    if torch_name is not None:
        name, ours = torch_name
        return f"did you mean '{ours}'? ('{name}' is torch's class name for it)"
    if style in TRANSFORMERS_EQUIVALENTS:
        value = TRANSFORMERS_EQUIVALENTS[style]
        if isinstance(value, str):
            return f"'{style}' is transformers' name for tpplan's {value}: write {value}"
        options = ", ".join(f"{key}: {flow(item)}" for key, item in value.items() if key != "style")
        return f"'{style}' is transformers' name for {value['style']} with {options}: write {flow(value)}"
    if style in TRANSFORMERS_FROM_CONFIG:
        ours, option, attribute = TRANSFORMERS_FROM_CONFIG[style]
        return (f"'{style}' is transformers' name for {ours} with {option}: the model config's {attribute}: "
                f"write {{style: {ours}, {option}: N}}")
    if style in TRANSFORMERS_NO_RULE:
        what, instead = TRANSFORMERS_NO_RULE[style]
        return f"'{style}' is transformers' style for {what}: {instead}"
    if style in TRANSFORMERS_WITHOUT_EQUIVALENT:
        return f"'{style}' is a transformers style with no tpplan equivalent: {TRANSFORMERS_WITHOUT_EQUIVALENT[style]}"
    synonym = synonym_of(style)
    if synonym is not None:
        return f"did you mean '{synonym}'?"
    return None


def synonym_of(word: str) -> str | None:
    """The style `word` is another name for (SYNONYMS), or None."""
    from fnmatch import fnmatchcase  # error path only

    normal = _normal(word)
    return next((style for pattern, style in SYNONYMS.items() if fnmatchcase(normal, pattern)), None)
