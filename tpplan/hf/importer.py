"""HuggingFace transformers: import its TP plans as tpplan YAML, keep tied weights tied.

transformers ships a TP plan per model family: `base_model_tp_plan` on the config
class (keys relative to the base model, `layers.*.self_attn.q_proj`) and
`_tp_plan` on the task model class (`lm_head`). Its style strings name
transformers' own runtime classes; `import_hf` maps each one with a sound
equivalent among tpplan's styles (torch's six and `no_parallel`) and reports
every other one with its key and the reason, never dropping a rule silently.

    >>> imported = import_hf("llama")
    >>> print(imported.text)  # tpplan YAML  # doctest: +ELLIPSIS
    # yaml-language-server: $schema=...
    rules:
      model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise
    ...
    >>> imported.skipped, imported.added  # nothing left out, nothing added for llama
    ([], [])

Input that names no readable config raises `HfConfigError` (hf.config, the reader
`--model hf:` shares), one with no usable plan its subclass `HfImportError` (both
`ValueError`s, with the reason); anything else that escapes is a bug.
Needs `transformers` (`pip install tpplan[hf]`); torch only when a model is
checked (`check_model=True`, the default) or a plan is applied.
The YAML is written by `core.yamltext.plan_yaml`, as every plan tpplan writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.aliases import TRANSFORMERS_FROM_CONFIG, TRANSFORMERS_STYLES, TRANSFORMERS_NO_RULE, TRANSFORMERS_WITHOUT_EQUIVALENT
from .config import HfConfigError, load_config
from .local_params import NAMES_A_PARAMETER, local_params_rules
from ..core.yamltext import group_siblings, plan_fields, plan_yaml
from .plans import EXPERT_MODULE_STYLES, experts_only_in_ep_plan, hf_ep_plan, hf_tp_plan

if TYPE_CHECKING:
    from torch import nn

# transformers style string -> tpplan rule value. transformers' styles with these
# names do what torch's do with these options (checked by tests/test_hf.py).
# core.aliases holds the one table (the "did you mean" and interop's export read it too).
SOUND_STYLES: dict[str, Any] = TRANSFORMERS_STYLES

# Parameter entries of an experts module (EXPERT_MODULE_STYLES) that its module rule above already
# lays out (expert_tp's and expert_parallel's defaults are these): folded in, not skipped.
EXPERT_PARAM_STYLES = {
    "packed_colwise": "packed_shard of its gate/up dim (expert_tp's default)",
    "rowwise": "shard of its input dim (expert_tp's default)",
    "colwise": "shard of its output dim (expert_tp's default)",
    "packed_rowwise": "packed shard of its input dim (expert_tp's default for a packed down projection)",
    "grouped_gemm": "shard(0) of the expert dim (expert_parallel's default)",
}

# Every other string is left out, with the reason in core.aliases: TRANSFORMERS_NO_RULE
# (what tpplan does anyway), TRANSFORMERS_WITHOUT_EQUIVALENT (no sound tpplan style).


class HfImportError(HfConfigError):
    """The config names nothing tpplan can import a plan from: no causal-LM class or TP
    plan, a model that cannot be built. (A source that names no readable config at all
    raises its base, HfConfigError, as `--model hf:` does: hf.config.)"""


class Skipped(NamedTuple):
    """A transformers plan entry that has no tpplan rule in the import."""

    key: str  # the key as it would be in the tpplan plan (prefixed, e.g. "model.layers.*.mlp.experts")
    hf_style: str
    reason: str


class ImportedPlan(NamedTuple):
    text: str  # tpplan YAML
    skipped: list[Skipped]  # transformers entries with no rule in `text`
    added: list[tuple[str, str]]  # (key, why) for rules `text` has beyond transformers' plan


def causal_lm_class(config):
    """The *ForCausalLM class of a config, as AutoModelForCausalLM picks it."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise HfImportError(f"transformers has no causal-LM model for model type {config.model_type!r}") from None


def causal_lm_config(config, model_cls):
    """The config `model_cls` is built from: a composite config's text part when the causal
    LM takes that (Llama4Config -> Llama4TextConfig), as AutoModelForCausalLM.from_config picks it."""
    text_config_class = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text_config_class is not None and getattr(model_cls, "config_class", None) is text_config_class:
        return config.get_text_config()
    return config


def base_model_attr(model) -> str:
    """The attribute of a built causal LM that holds its base model, under which transformers
    merges the base model's plan (a child's plan under the child's name): the class's
    base_model_prefix, unless the instance has no such child (Llama4ForCausalLM names
    'language_model', the prefix of its composite checkpoints, and keeps its model at 'model')."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    children = dict(model.named_children())
    if not prefix or prefix in children:
        return prefix
    bases = [name for name, child in children.items() if getattr(child, "config", None) is model.config and getattr(child, "base_model", None) is child]
    return bases[0] if len(bases) == 1 else prefix


def _tp_sizes(config) -> list[int]:
    """The mesh.sizes of the imported plan (core/degrees.py's default, as validate checks): of
    DEFAULT_TP_SIZES those dividing the head counts (read as the lint reads them) and the
    FFN width, so the plan promises only degrees that can work; [1] when none does."""
    from ..core.degrees import DEFAULT_TP_SIZES, dividing
    from ..core.head_counts import head_counts

    heads = head_counts(config)
    try:
        intermediate = getattr(config, "intermediate_size", None)
    except (AttributeError, RuntimeError):  # a per-layer attribute of a heterogeneous config (core/head_counts.py)
        intermediate = None
    return dividing(DEFAULT_TP_SIZES, [*(count for _, count in (heads.counts if heads else ())), intermediate]) or [1]


def _meta_model(config, model_cls):
    import torch

    with torch.device("meta"):
        return model_cls(config)


def import_hf(
    model_type_or_config_path: str | os.PathLike,
    *,
    minimal: bool = False,
    ep: bool = False,
    check_model: bool = True,
    output: str | os.PathLike | None = None,
    lint_fixes: "Callable[[str, nn.Module, Sequence[str]], dict[str, Any]] | None" = None,
) -> ImportedPlan:
    """transformers' TP plan for a causal LM, as tpplan YAML, and what it leaves out.

    `model_type_or_config_path`: a model type (`"llama"`, default config) or a
    local config directory / config.json. With `check_model`, the model is built
    on the meta device and every key must name a module: keys naming a parameter
    (transformers shards those directly) or nothing in this config (transformers
    only warns; tpplan's strict matching would reject the plan) are skipped and
    reported. `minimal` adds the rules the lint's fixes add to the plan on the model
    (`lint_fixes`, required then: `tpplan.lint.fixes.added_rules`, which the CLI passes;
    this layer does not import the lint): TP340's `prepare_module_input` on each parent
    whose colwise children share one plain input, so backward costs one all-reduce per
    parent instead of one per child, then TP325's `local_params` on each module whose
    parameters compute on sharded activations. `ep` imports
    `base_model_ep_plan` (experts whole per rank) over the TP plan.
    `output`: where the plan will be written (None: standard output, i.e. the
    current directory), so that its `$schema` pointer resolves from there.
    """
    from ..core.schema_file import schema_comment

    import transformers

    outer = load_config(model_type_or_config_path)
    model_cls = causal_lm_class(outer)
    config = causal_lm_config(outer, model_cls)
    hf_plan = hf_ep_plan(config, model_cls) if ep else hf_tp_plan(config, model_cls)
    if ep and not getattr(config, "base_model_ep_plan", None):
        raise HfImportError(
            f"transformers {transformers.__version__} defines no expert-parallel plan (base_model_ep_plan) "
            f"for {type(config).__name__}: import without --ep"
        )
    if not hf_plan and not experts_only_in_ep_plan(config, model_cls):  # an EP plan alone still plans its experts
        raise HfImportError(
            f"transformers {transformers.__version__} defines no TP plan for {model_cls.__name__} "
            f"(model type {outer.model_type!r}): nothing to import; write the plan by hand"
        )
    if minimal and lint_fixes is None:
        raise ValueError("import_hf(minimal=True) adds the lint's fixes: pass lint_fixes=tpplan.lint.fixes.added_rules")
    model, prefix = None, None
    if check_model or minimal:
        try:
            model = _meta_model(config, model_cls)
        except Exception as exc:  # transformers' own constructor failing on this config
            raise HfImportError(
                f"cannot build {model_cls.__name__} from this config to check the plan against it "
                f"({type(exc).__name__}: {exc}); pass a complete config, or check_model=False"
            ) from exc
        prefix = base_model_attr(model)
        if prefix != (getattr(model_cls, "base_model_prefix", "") or ""):
            hf_plan = hf_ep_plan(config, model_cls, prefix) if ep else hf_tp_plan(config, model_cls, prefix)
    rules: dict[str, Any] = {}
    skipped: list[Skipped] = []
    added: list[tuple[str, str]] = []
    # Experts transformers plans for expert parallelism only get tensor parallelism here, as its
    # moe_tp_experts gave them (expert_tp); --ep imports its expert-parallel plan instead.
    ep_only = [] if ep else experts_only_in_ep_plan(config, model_cls, prefix)
    own = getattr(model_cls, "_tp_plan", None) or {}  # after the base model's entries, as transformers lists them
    hf_styles = {key: style for key, style in hf_plan.items() if key not in own}
    hf_styles.update({**dict.fromkeys(ep_only, "ep_dispatch_experts"), **{key: hf_plan[key] for key in own if key in hf_plan}})
    expert_owners = {key for key, style in hf_plan.items() if style in EXPERT_MODULE_STYLES}
    for key, hf_style in hf_styles.items():
        owner = key.rpartition(".")[0]
        if key in ep_only:
            rules[key] = SOUND_STYLES["moe_tp_experts"]
        elif owner in expert_owners and hf_style in EXPERT_PARAM_STYLES:
            added.append((owner, f"lays out {key.rpartition('.')[2]} ({hf_style}) as {EXPERT_PARAM_STYLES[hf_style]}"))
        elif hf_style in SOUND_STYLES:
            rules[key] = SOUND_STYLES[hf_style]
        elif hf_style in TRANSFORMERS_FROM_CONFIG and _from_config(config, hf_style) is not None:
            rules[key] = _from_config(config, hf_style)
        elif hf_style in TRANSFORMERS_NO_RULE:
            skipped.append(Skipped(key, hf_style, f"{TRANSFORMERS_NO_RULE[hf_style][0]}: no rule needed"))
        else:
            unknown = f"unknown transformers style {hf_style!r}: no mapping to a tpplan style"
            reason = TRANSFORMERS_WITHOUT_EQUIVALENT.get(hf_style, unknown)
            skipped.append(Skipped(key, hf_style, reason))

    if model is not None:
        rules = _keep_module_rules(rules, hf_styles, model, skipped)
        rules = local_params_rules(rules, skipped, added, model)
        added += [(key, _expert_tp_instead_of_ep()) for key in ep_only if key in rules]
        rules = _per_head_norms(rules, hf_plan, model, config, model_cls)
        for key, value in _tied_embedding_rules(rules, model).items():
            rules = {key: value, **rules}
            added.append((key, "vocab-parallel, as the lm_head it is tied to (tie_word_embeddings): both shard(0)"))
        if minimal:
            # the shared inputs first, before the rules they feed; then the partial gradients
            # the plan so far leaves (each from the lint's findings on the model: one truth)
            sharing = lint_fixes(plan_yaml(plan_fields("probe", "", [2]), rules), model, ["TP340"])
            rules = {**sharing, **rules}
            added += [(key, "one shared replicated input for its column-parallel children") for key in sharing]
            summed = lint_fixes(plan_yaml(plan_fields("probe", "", [2]), rules), model, ["TP325"])
            rules = {**rules, **summed}
            added += [
                (key, "local_params: its parameters compute on sharded activations, their gradients are summed (TP325)")
                for key in summed
            ]

    if model is None:
        added += [(key, _expert_tp_instead_of_ep()) for key in ep_only]
    header = [
        schema_comment(output),
        f"# Imported by tpplan.hf.importer.import_hf from transformers {transformers.__version__}:",
        f"# {type(config).__name__}.base_model_tp_plan + {model_cls.__name__}._tp_plan.",
    ]
    if config is not outer:
        header.append(f"# ({type(config).__name__}: the text_config of {type(outer).__name__}, which {model_cls.__name__} is built from.)")
    if added:
        header.append("# Added (not in transformers' plan):")
        header += [f"#   {key}: {why}" for key, why in added]
    if skipped:
        header.append("# Left out (no rule here; the modules stay whole on every rank):")
        header += [f"#   {s.key}: {s.hf_style} -- {s.reason}" for s in skipped]
    name = f"{outer.model_type.replace('_', '-')}-hf-{'ep' if ep else 'tp'}" + ("-minimal" if minimal else "")
    description = (
        f"transformers' own TP plan for {model_cls.__name__}"
        + (", plus one shared replicated input per column-parallel parent" if minimal else "")
        + "."
    )
    text = plan_yaml(plan_fields(name, description, _tp_sizes(config)), group_siblings(rules), header=header)
    return ImportedPlan(text, skipped, added)


def _expert_tp_instead_of_ep() -> str:
    import transformers

    return (
        f"expert_tp (every expert sharded on its intermediate dim): transformers {transformers.__version__} "
        "plans these experts only in base_model_ep_plan (whole experts per rank), which --ep imports"
    )


def _per_head_norms(rules: dict[str, Any], hf_plan: Mapping[str, str], model, config, model_cls) -> dict[str, Any]:
    """The per-head norm rules (replicated_with_grad_allreduce) with the dim the heads are
    really on (hf.head_norms): the mapping's shard(-2) fits [batch, seq, heads, head_dim] only."""
    from ..core.globs import ModuleTree, compile_glob
    from .head_norms import heads_dims, with_heads_dim

    keys = [key for key in rules if hf_plan.get(key) == "replicated_with_grad_allreduce"]
    if not keys:
        return rules
    tree = ModuleTree(name for name, _ in model.named_modules())
    matched = {key: tree.match(compile_glob(key)) for key in keys}
    try:
        dims = heads_dims(config, model_cls, [names[0] for names in matched.values() if names])
    except Exception:  # the model's forward on fake tensors: keep the mapping; validate --model checks it (TP320)
        return rules
    out = dict(rules)
    for key, names in matched.items():
        if names and names[0] in dims:
            out[key] = with_heads_dim(rules[key], dims[names[0]])
    return out


def _keep_module_rules(
    rules: dict[str, Any], hf_plan: Mapping[str, str], model, skipped: list[Skipped]
) -> dict[str, Any]:
    from ..core.globs import ModuleTree, compile_glob

    modules = ModuleTree(name for name, _ in model.named_modules())
    params = ModuleTree(name for name, _ in model.named_parameters())
    kept = {}
    for key, value in rules.items():
        glob = compile_glob(key)
        if modules.match(glob):
            kept[key] = value
        elif params.match(glob):
            skipped.append(Skipped(key, hf_plan[key], NAMES_A_PARAMETER))
        else:
            reason = f"matches no module of {type(model).__name__} built from this config"
            skipped.append(Skipped(key, hf_plan[key], reason))
    return kept


def _from_config(config, hf_style: str) -> dict[str, Any] | None:
    """The rule for a transformers string whose option comes from the config (mla_kv_a_proj:
    sum_output_grad with last: qk_rope_head_dim); None when the config lacks it."""
    style, option, attribute = TRANSFORMERS_FROM_CONFIG[hf_style]
    value = getattr(config.get_text_config(), attribute, None)
    return {"style": style, option: value} if isinstance(value, int) and value > 0 else None


def _tied_embedding_rules(rules: Mapping[str, Any], model) -> dict[str, Any]:
    """A vocab-parallel rule for each Embedding whose weight is tied to a planned
    colwise Linear but is itself unplanned: transformers' plans shard lm_head and
    leave embed_tokens whole, which `Plan.apply` rejects (tied parameters laid out differently)."""
    from torch import nn

    from ..core.globs import ModuleTree, compile_glob, generalize
    from ..core.placements import PlacementSpec
    from ..core.schema import rule_spec
    from ..sharding.tied import shared_parameters

    vocab_parallel = PlacementSpec("shard", 0)  # of a Linear's weight: its output features, the vocabulary
    tree = ModuleTree(name for name, _ in model.named_modules())
    planned = {name: value for pattern, value in rules.items() for name in tree.match(compile_glob(pattern))}
    added = {}
    for group in shared_parameters(model):
        owners = [fqn for fqn, pname in group if pname == "weight"]
        sharded_as_vocab = any(
            isinstance(model.get_submodule(f), nn.Linear)
            and planned.get(f) is not None
            and rule_spec(planned[f]).semantics.contract.tp.placement("Linear", "weight") == vocab_parallel
            for f in owners
        )
        for fqn in owners:
            if sharded_as_vocab and fqn not in planned and isinstance(model.get_submodule(fqn), nn.Embedding):
                added[generalize(fqn)] = SOUND_STYLES["embedding_rowwise"]
    return added
