"""Pydantic models of plan versions 1 (SPEC §2) and 2 (§7; its sections are axes_spec.py's). No torch here: plan-only
validation must stay fast, so specs are turned into torch styles in
sharding/compile.py. The styles, and what each does, are the style table
(style_table.py); this module puts them into rules and the plan.

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag

from .external_styles import external_specs, external_tag, is_external, like_names
from .style_model import MODULE_KINDS, ModuleKind, StyleSemantics, StyleSpec, _Strict  # noqa: F401  (re-exported)
from .style_table import STYLE_NAMES, STYLE_SPECS  # noqa: F401  (re-exported: the plan format's names)
from .axes_spec import EXPERT_STYLES, CheckpointingSpec, ContextParallelSpec, FSDPSpec, NamedMeshSpec, PipelineSpec, TrainingSpec

# `style: PKG.MOD:Class` (external_styles.py), one spec class per `like:`
EXTERNAL_SPECS = external_specs(STYLE_SPECS)
LIKE_NAMES = like_names(STYLE_SPECS)


def _expand_shorthand(value: Any) -> Any:
    return {"style": value} if isinstance(value, str) else value


def rule_spec(value: Any) -> StyleSpec:
    """A rule value as a plan writes it (a style name, or a mapping with `style:` and
    options) as its entry of the style table, for tools that write plans (import-hf)
    and ask what a rule does. ValueError (pydantic's) for a value no plan accepts."""
    data = _expand_shorthand(value)
    if not isinstance(data, dict) or data.get("style") not in STYLE_SPECS:
        raise ValueError(f"{value!r} names no style of the table ({', '.join(STYLE_NAMES)})")
    return STYLE_SPECS[data["style"]].model_validate(data)


def _style_tag(value: Any) -> Any:
    style = value.get("style") if isinstance(value, dict) else getattr(value, "style", None)
    return external_tag(value, LIKE_NAMES) if is_external(style) else style


AnyStyleSpec = Annotated[
    Union[tuple(Annotated[cls, Tag(tag)] for tag, cls in (*STYLE_SPECS.items(), *EXTERNAL_SPECS.items()))],
    Discriminator(_style_tag),
]
RuleValue = Annotated[AnyStyleSpec, BeforeValidator(_expand_shorthand)]


class MeshSpec(_Strict):
    axis: str = Field("tp", description="Mesh axis (dim name) the plan shards over.")
    sizes: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="TP degrees the plan promises to work at.")


def _exact_int(value: Any) -> Any:
    # Literal[1] alone takes True and 1.0 (they hash equal to 1); a version is an integer.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"version must be the integer 1 or 2, not {value!r}")
    return value


class _PlanFields(_Strict):
    """What both versions say the same way: the TP rules and the settings around them."""

    name: str | None = None
    description: str | None = None
    src_data_rank: Annotated[int, Field(ge=0)] | None = Field(
        0, description="Rank whose weights are scattered, as in parallelize_module; null keeps each rank's local data."
    )
    loss_parallel: bool = Field(False, description="Hint for trainers: wrap the loss in torch's loss_parallel().")
    extends: str | None = Field(
        None,
        description="A parent plan, as a path relative to this file: its rules and settings are inherited; "
        "a rule here replaces the parent's rule with the same key, and a null rule deletes it.",
    )
    # null: delete the parent's rule of that key (only in a plan with 'extends', checked by the loader)
    rules: dict[str, RuleValue | None] = Field(
        description="Module-path glob -> style name or {style: ..., options}; null deletes an inherited rule."
    )


class PlanSpec(_PlanFields):
    """Plan version 1 (SPEC §2): the TP axis."""

    version: Annotated[Literal[1], BeforeValidator(_exact_int)]
    # model_construct: the defaults need no validation, and building MeshSpec's own
    # validator at import would cost start-up (PlanSpec's validator covers mesh).
    mesh: MeshSpec = MeshSpec.model_construct()


class PlanV2Spec(_PlanFields):
    """Plan version 2 (SPEC §7): every axis in one file. Every section is optional."""

    version: Annotated[Literal[2], BeforeValidator(_exact_int)]
    mesh: NamedMeshSpec = Field(
        NamedMeshSpec.model_construct(), description="Named axes, outermost first; -1 = world / (product of the others)."
    )
    pipeline: PipelineSpec | None = Field(None, description="Stages over the pp axis, the schedule and the microbatches (SPEC §8).")
    experts: dict[str, RuleValue] | None = Field(
        None, description=f"Module-path glob -> a rule over the ep axis ({' or '.join(EXPERT_STYLES)})."
    )
    context_parallel: ContextParallelSpec | None = None
    fsdp: FSDPSpec | None = None
    checkpointing: CheckpointingSpec | None = None
    training: TrainingSpec | None = Field(None, description="The step the dry run and fit plan for (flags override).")


PLAN_SPECS = {1: PlanSpec, 2: PlanV2Spec}  # version -> its model


def plan_spec_for(data: Any) -> type[_PlanFields]:
    """The model of the version `data` declares (version 1's, whose error says so, for any other)."""
    version = data.get("version") if isinstance(data, dict) else None
    return PLAN_SPECS[2] if _is_two(version) else PLAN_SPECS[1]


def _is_two(version: Any) -> bool:
    return isinstance(version, int) and not isinstance(version, bool) and version == 2


def plan_json_schema() -> dict:
    """JSON Schema of the plan format (built in json_schema.py)."""
    from .json_schema import plan_json_schema as build

    return build(PlanSpec, MeshSpec, PlanV2Spec, NamedMeshSpec)
