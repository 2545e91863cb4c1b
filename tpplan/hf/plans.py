"""transformers' plans of a model class, keys relative to the model: its TP plan
(`base_model_tp_plan` under the base model, then the class's `_tp_plan`), its
expert-parallel plan (`base_model_ep_plan`), and the experts planned by the latter alone.
No torch, no transformers import: the config and class are given."""

from __future__ import annotations

from collections.abc import Mapping

# transformers' styles of a whole experts module (TP up to 5.24, EP)
EXPERT_MODULE_STYLES = ("moe_tp_experts", "ep_dispatch_experts")


def _prefixed(plan: Mapping[str, str] | None, prefix: str) -> dict[str, str]:
    return {f"{prefix}.{key}" if prefix else key: style for key, style in (plan or {}).items()}


def _class_prefix(model_cls, prefix: str | None) -> str:
    return (getattr(model_cls, "base_model_prefix", "") or "") if prefix is None else prefix


def _on_or_under(key: str, owners: list[str]) -> bool:
    return any(key == owner or key.startswith(owner + ".") for owner in owners)


def hf_tp_plan(config, model_cls, prefix: str | None = None) -> dict[str, str]:
    """transformers' TP plan for `model_cls` with keys relative to the model:
    the config's base-model plan under the base model's attribute (`model.`; `prefix`,
    else the class's base_model_prefix), then the class's own `_tp_plan` (`lm_head`)."""
    plan = _prefixed(getattr(config, "base_model_tp_plan", None), _class_prefix(model_cls, prefix))
    plan.update(getattr(model_cls, "_tp_plan", None) or {})
    return plan


def ep_experts(config, model_cls, prefix: str | None = None) -> list[str]:
    """The experts modules of transformers' expert-parallel plan (`base_model_ep_plan`), keys relative to the model."""
    ep = _prefixed(getattr(config, "base_model_ep_plan", None), _class_prefix(model_cls, prefix))
    return [key for key, style in ep.items() if style in EXPERT_MODULE_STYLES]


def hf_ep_plan(config, model_cls, prefix: str | None = None) -> dict[str, str]:
    """transformers' expert-parallel plan (`base_model_ep_plan`) over its TP plan: the
    TP plan for the rest of the model, the EP entries for the experts."""
    ep = _prefixed(getattr(config, "base_model_ep_plan", None), _class_prefix(model_cls, prefix))
    experts = ep_experts(config, model_cls, prefix)
    # The TP entries of modules that EP now owns (the experts and their parameters) give way.
    plan = {key: style for key, style in hf_tp_plan(config, model_cls, prefix).items() if not _on_or_under(key, experts)}
    plan.update(ep)
    return plan


def experts_only_in_ep_plan(config, model_cls, prefix: str | None = None) -> list[str]:
    """The experts modules that transformers plans for expert parallelism only: no entry of its
    TP plan is on them or under them. Since transformers 5.25 every MoE family's experts are there
    (pure expert TP, `moe_tp_experts`, is deprecated in its TP plans); gpt-oss's always were."""
    tp = hf_tp_plan(config, model_cls, prefix)
    return [owner for owner in ep_experts(config, model_cls, prefix) if not any(_on_or_under(key, [owner]) for key in tp)]
