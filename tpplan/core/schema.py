"""Pydantic models of plan version 1 (SPEC §2). No torch here: plan-only
validation must stay fast, so specs are turned into torch styles in compile.py.

Option names and defaults are those of torch's style constructors; the
constructors' cross-field asserts are `cross_field_problems()`, reported at the
offending key like any other schema error. No `from __future__ import annotations`
here: pydantic would compile every field's annotation string at start-up.
"""

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
)

from .placements import GRAMMAR, PATTERN, PlacementSpec, parse_placement

PLACEMENT_SCHEMA = {"type": "string", "pattern": PATTERN, "description": f"A placement: {GRAMMAR}."}
Layout = Annotated[
    PlacementSpec,
    PlainValidator(parse_placement),
    PlainSerializer(str),
    WithJsonSchema(PLACEMENT_SCHEMA),
]


def _single_as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


# One entry per positional argument (or output); null leaves that one alone.
# A single placement (or a single null) stands for a list of one, in the schema too.
LayoutList = Annotated[
    list[Union[Layout, None]],
    BeforeValidator(_single_as_list),
    WithJsonSchema({
        "anyOf": [
            PLACEMENT_SCHEMA,
            {"type": "null"},
            {"type": "array", "items": {"anyOf": [PLACEMENT_SCHEMA, {"type": "null"}]}},
        ],
        "description": "One layout per positional argument (null leaves that one alone); a single layout is a list of one.",
    }),
]
KwargLayouts = dict[str, Layout]


class _Strict(BaseModel):
    # strict: "yes" is not a boolean and "1" is not a dimension.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)


class StyleSpec(_Strict):
    style: str

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        """(path within the rule, message) for each constructor rule this spec breaks."""
        return []


# -- shared option groups -------------------------------------------------------


class _LinearOptions(StyleSpec):
    input_layouts: Layout | None = Field(None, description="Layout of the input; torch's default when omitted.")
    output_layouts: Layout | None = Field(None, description="Layout of the output; torch's default when omitted.")
    use_local_output: bool = True


class _InputOptions(StyleSpec):
    input_layouts: LayoutList | None = None
    desired_input_layouts: LayoutList | None = None
    input_kwarg_layouts: KwargLayouts | None = None
    desired_input_kwarg_layouts: KwargLayouts | None = None

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        return [
            *super().cross_field_problems(),
            *_paired_lists(self, "input_layouts", "desired_input_layouts", desired_required=False),
            *_paired_kwargs(self),
        ]


class _OutputOptions(StyleSpec):
    output_layouts: LayoutList
    desired_output_layouts: LayoutList

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        return [
            *super().cross_field_problems(),
            *_paired_lists(self, "output_layouts", "desired_output_layouts", desired_required=True),
        ]


def _paired_lists(spec: StyleSpec, given: str, desired: str, *, desired_required: bool):
    layouts, wanted = getattr(spec, given), getattr(spec, desired)
    if layouts is None and wanted is not None:
        return [((desired,), f"'{desired}' has no effect without '{given}': add '{given}' (the layouts the arguments arrive in)")]
    if layouts is None:
        return []
    if wanted is None:
        return [((given,), f"'{given}' needs '{desired}' (one entry per entry of '{given}')")]
    if len(layouts) != len(wanted):
        return [((desired,), f"'{desired}' has {len(wanted)} entries but '{given}' has {len(layouts)}: give one per argument")]
    if desired_required:
        return [
            ((desired, i), f"'{desired}' entry {i} is null but '{given}' entry {i} is {layout}: give the layout to redistribute to")
            for i, (layout, target) in enumerate(zip(layouts, wanted))
            if layout is not None and target is None
        ]
    return []


def _paired_kwargs(spec: _InputOptions):
    given, wanted = spec.input_kwarg_layouts, spec.desired_input_kwarg_layouts
    if given is None and wanted is not None:
        return [(("desired_input_kwarg_layouts",), "'desired_input_kwarg_layouts' has no effect without 'input_kwarg_layouts'")]
    if given is None:
        return []
    wanted = wanted or {}
    return [
        (("input_kwarg_layouts", name), f"keyword argument {name!r} has a layout but no desired layout in 'desired_input_kwarg_layouts'")
        for name in given
        if name not in wanted
    ] + [
        (("desired_input_kwarg_layouts", name), f"keyword argument {name!r} has a desired layout but no layout in 'input_kwarg_layouts'")
        for name in wanted
        if name not in given
    ]


# -- the seven styles -------------------------------------------------------------


class ColwiseSpec(_LinearOptions):
    """Shard a Linear's weight by output features (an Embedding's by embedding dim)."""

    style: Literal["colwise"]


class RowwiseSpec(_LinearOptions):
    """Shard a Linear's weight by input features (an Embedding's by vocabulary)."""

    style: Literal["rowwise"]


class SequenceParallelSpec(StyleSpec):
    """Replicate the module's parameters and run it on a sequence-sharded input."""

    style: Literal["sequence_parallel"]
    sequence_dim: int = 1
    use_local_output: bool = False


class PrepareModuleInputSpec(_InputOptions):
    """Annotate and redistribute the module's inputs."""

    style: Literal["prepare_module_input"]
    use_local_output: bool = False


class PrepareModuleOutputSpec(_OutputOptions):
    """Annotate and redistribute the module's outputs."""

    style: Literal["prepare_module_output"]
    use_local_output: bool = True


class PrepareModuleInputOutputSpec(_InputOptions, _OutputOptions):
    """Both of the above on one module."""

    style: Literal["prepare_module_input_output"]
    use_local_input: bool = False
    use_local_output: bool = True


def _layout_default(text: str) -> Any:
    # The JSON Schema shows the default as the plan would spell it (pydantic alone
    # would dump the PlacementSpec dataclass as an object).
    return Field(parse_placement(text), json_schema_extra={"default": text})


class NoParallelSpec(StyleSpec):
    """Replicate the module's parameters and buffers; redistribute its first input and output."""

    style: Literal["no_parallel"]
    input_layout: Layout = _layout_default("replicate")
    output_layout: Layout = _layout_default("replicate")
    desired_input_layout: Layout = _layout_default("replicate")
    use_local_output: bool = True


STYLE_SPECS: dict[str, type[StyleSpec]] = {
    cls.model_fields["style"].annotation.__args__[0]: cls
    for cls in (
        ColwiseSpec,
        RowwiseSpec,
        SequenceParallelSpec,
        PrepareModuleInputSpec,
        PrepareModuleOutputSpec,
        PrepareModuleInputOutputSpec,
        NoParallelSpec,
    )
}
STYLE_NAMES = tuple(STYLE_SPECS)


def _expand_shorthand(value: Any) -> Any:
    return {"style": value} if isinstance(value, str) else value


AnyStyleSpec = Annotated[
    Union[tuple(STYLE_SPECS.values())],
    Field(discriminator="style"),
]
RuleValue = Annotated[AnyStyleSpec, BeforeValidator(_expand_shorthand)]


class MeshSpec(_Strict):
    axis: str = Field("tp", description="Mesh axis (dim name) the plan shards over.")
    sizes: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="TP degrees the plan promises to work at.")


def _exact_int(value: Any) -> Any:
    # Literal[1] alone takes True and 1.0 (they hash equal to 1); a version is an integer.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"version must be the integer 1, not {value!r}")
    return value


class PlanSpec(_Strict):
    version: Annotated[Literal[1], BeforeValidator(_exact_int)]
    name: str | None = None
    description: str | None = None
    # model_construct: the defaults need no validation, and building MeshSpec's own
    # validator at import would cost start-up (PlanSpec's validator covers mesh).
    mesh: MeshSpec = MeshSpec.model_construct()
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


def plan_json_schema() -> dict:
    """JSON Schema of the plan format (built in json_schema.py)."""
    from .json_schema import plan_json_schema as build

    return build()
