"""The style table: each style a plan can name, as one spec class. No torch here.

Each style is one spec class below: its options (pydantic fields, named and
defaulted as torch's constructor) and a `semantics` class attribute, a
`StyleSemantics`, that says what the style does. Everything else reads it:
`sharding.compile` (the torch class), the lint's layout flow (`lint/flow.py`)
and facts (`lint/facts.py`), and the rules (parameter placements, which modules a
style applies to, which inputs it takes). For example, colwise:

    class ColwiseSpec(_LinearOptions):
        style: Literal["colwise"]
        semantics = StyleSemantics(
            torch_class="torch.distributed.tensor.parallel:ColwiseParallel",
            params={  # module kind -> {parameter name, or "*" for any other: placement}
                "Linear": {"weight": "shard(0)", "bias": "shard(0)", "*": "shard(0)"},
                "Embedding": {"weight": "shard(1)", "*": "shard(1)"},
            },
            runs_module=True, inputs="first", outputs="first", replicated_input=True,
        )
        def declared_input(self): ...   # (layout of a plain first input, torch's default?)
        def natural_output(self): ...   # the layout the module's output gets

The fields of `StyleSemantics`:

- `torch_class`: "module:Class" of the ParallelStyle (resolved by compile, so
  core never imports torch); the spec's fields are its keyword arguments.
- `params`: module kind (a key of `MODULE_KINDS`) -> placement of each
  parameter, as placement text. A style with `params` applies to those kinds
  only (torch raises NotImplementedError on any other module: TP300). The text
  is open: a packed or 3-D (expert) layout is a new placement string here and
  in the code that reads it, not a new table.
- `replicates`: every parameter and buffer of the module and of its submodules
  becomes a replicated DTensor (sequence_parallel, no_parallel).
- `flat_params`: the style refuses a module whose submodules hold parameters
  (sequence_parallel re-registers them under dotted names: TP301).
- `runs_module`: the style hands the module DTensors; what happens inside is
  torch's business (the lint does not follow layouts in there). False: the
  style only lays out inputs and/or outputs (prepare_module_*).
- `inputs`: "first" (only the first positional input is handed on, torch drops
  the rest), "first_tensor" (the first positional input must be a tensor, the
  others pass), "layouts" (one layout per input, from the options), or "none"
  (inputs pass untouched).
- `outputs`: "first" (the output gets `natural_output()`), "layouts" (one
  layout per output, from the options), or "none".
- `replicated_input`: the module computes on its input replicated, so siblings
  that share one input each pay for it (TP340).
- `input_option`: the option that declares the first input's layout, for
  messages that say what to change (None: the options say per input).

Adding a style is one spec class here (plus its tests): add it to
`STYLE_SPECS` below, and if it shards a new kind of module, an entry in
`MODULE_KINDS` (a class, or a predicate for modules recognised by their
parameters). The styles the next issues add fit the entry as it is, e.g.

    expert_parallel: params={"Experts": {"*": "shard(0)"}}   # 3-D [experts, out, in]: whole experts per rank
    expert_tp:       params={"Experts": {"w1": "shard(1)", "w3": "shard(1)", "w2": "shard(2)", "*": "shard(1)"}}
    colwise, KV heads replicated: params={"Linear": {"weight": "<packed placement text>", ...}}

with an "Experts" kind whose `torch_class` names a predicate; a placement the
lint does not know (not replicate/shard(d)/partial) is left to the new style's
own checks (`lint.facts.sharded_weight_dim` reads only shard(d)).

Option names and defaults are those of torch's style constructors; the
constructors' cross-field asserts are `cross_field_problems()`, reported at the
offending key like any other schema error. No `from __future__ import annotations`
here: pydantic would compile every field's annotation string at start-up.

Option names and defaults are those of torch's style constructors; the
constructors' cross-field asserts are `cross_field_problems()`, reported at the
offending key like any other schema error. No `from __future__ import annotations`
here: pydantic would compile every field's annotation string at start-up.
"""


from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Mapping, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
)

from .placements import GRAMMAR, PACKED_GRAMMAR, PATTERN, PlacementSpec, parse_placement

PLACEMENT_SCHEMA = {"type": "string", "pattern": PATTERN, "description": f"A placement: {GRAMMAR} (a parameter's also {PACKED_GRAMMAR})."}
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


@dataclass(frozen=True)
class ModuleKind:
    """A kind of module a style shards: its torch class (or a predicate), and what
    the dims of its `weight` are called (as the module's attributes)."""

    torch_class: str  # "module:Class", or "module:function" (module -> bool); resolved by sharding/styles.py
    weight_dims: tuple[str, ...]


# Matched in this order (isinstance: subclasses count).
MODULE_KINDS: dict[str, ModuleKind] = {
    "Linear": ModuleKind("torch.nn:Linear", ("out_features", "in_features")),
    "Embedding": ModuleKind("torch.nn:Embedding", ("num_embeddings", "embedding_dim")),
}


@dataclass(frozen=True)
class StyleSemantics:
    """What a style does (see the module docstring)."""

    torch_class: str
    params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    replicates: bool = False
    flat_params: bool = False
    runs_module: bool = False
    inputs: Literal["first", "first_tensor", "layouts", "none"] = "none"
    outputs: Literal["first", "layouts", "none"] = "none"
    replicated_input: bool = False
    input_option: str | None = None  # the option that declares the first input's layout

    def placement(self, kind: str | None, param: str) -> str | None:
        """The placement text parameter `param` of a `kind` module gets; None when
        the style does not shard that kind."""
        table = self.params.get(kind) if kind is not None else None
        if table is None:
            return None
        return table.get(param, table["*"])

    @property
    def kinds(self) -> tuple[str, ...]:
        """The module kinds the style applies to; () for any module."""
        return tuple(self.params)


class _Strict(BaseModel):
    # strict: "yes" is not a boolean and "1" is not a dimension.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)


class StyleSpec(_Strict):
    style: str
    semantics: ClassVar[StyleSemantics]

    def declared_input(self) -> "tuple[PlacementSpec | None, bool] | None":
        """For a style that runs the module: the layout it declares a plain first
        input to have, and whether that is torch's default rather than the plan's
        word. None for the prepare_module_* styles (their options say)."""
        return None

    def natural_output(self) -> "PlacementSpec | None":
        """For a style that runs the module: the layout its (first) output gets."""
        return None

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        """(path within the rule, message) for each constructor rule this spec breaks."""
        return []

    def torch_class(self) -> str:
        """The "module:Class" this rule compiles to: the table's, unless an option picks another."""
        return self.semantics.torch_class

    def torch_options(self) -> dict[str, Any]:
        """The constructor's keyword arguments: every option (a spec may drop some)."""
        return {name: getattr(self, name) for name in type(self).model_fields if name != "style"}


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

    def inputs_local(self) -> bool:
        """Whether the laid-out inputs are handed on as local tensors (torch calls the
        option use_local_output on PrepareModuleInput, use_local_input on the other)."""
        return self.use_local_output

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


# -- the styles: torch's six, and no_parallel --------------------------------------

_TORCH_TP = "torch.distributed.tensor.parallel"
_REPLICATE = PlacementSpec("replicate")
_LAST_DIM = PlacementSpec("shard", -1)


class ColwiseSpec(_LinearOptions):
    """Shard a Linear's weight by output features (an Embedding's by embedding dim)."""

    style: Literal["colwise"]
    heads: Union[Annotated[int, Field(ge=1)], Literal["auto"], None] = Field(
        None,
        description="The output is whole heads (a GQA k_proj/v_proj): their count, or auto (out_features / the parent's "
        "head_dim). When the TP degree is a multiple of the count above it, rank r holds head r // (tp / heads), "
        "replicated, with summed gradients, and the attention's KV-group count becomes the local ratio.",
    )
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:ColwiseParallel",
        params={
            "Linear": {"weight": "shard(0)", "bias": "shard(0)", "*": "shard(0)"},
            "Embedding": {"weight": "shard(1)", "*": "shard(1)"},
        },
        runs_module=True,
        inputs="first",
        outputs="first",
        replicated_input=True,
        input_option="input_layouts",
    )

    def declared_input(self):
        return (self.input_layouts, False) if self.input_layouts is not None else (_REPLICATE, True)

    def natural_output(self):
        return self.output_layouts or _LAST_DIM

    def torch_class(self) -> str:
        # whole heads, replicated above their count (tpplan/sharding/kv_heads.py)
        return "tpplan.sharding.kv_heads:HeadsColwiseParallel" if self.heads is not None else self.semantics.torch_class

    def torch_options(self) -> dict[str, Any]:
        options = super().torch_options()
        heads = options.pop("heads")
        if heads is not None:
            options.pop("output_layouts")
            options["heads"] = None if heads == "auto" else heads
        return options

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        problems = super().cross_field_problems()
        if self.heads is not None and self.output_layouts is not None and str(self.output_layouts) != "shard(-1)":
            problems.append((("output_layouts",), "colwise with 'heads' hands on local head slices: drop output_layouts (or use shard(-1))"))
        return problems


class RowwiseSpec(_LinearOptions):
    """Shard a Linear's weight by input features (an Embedding's by vocabulary)."""

    style: Literal["rowwise"]
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:RowwiseParallel",
        params={
            "Linear": {"weight": "shard(1)", "bias": "replicate", "*": "shard(1)"},
            "Embedding": {"weight": "shard(0)", "*": "shard(0)"},
        },
        runs_module=True,
        inputs="first",
        outputs="first",
        input_option="input_layouts",
    )

    def declared_input(self):
        # torch's default is shard(-1), even on an Embedding
        return (self.input_layouts, False) if self.input_layouts is not None else (_LAST_DIM, True)

    def natural_output(self):
        return self.output_layouts or _REPLICATE


class SequenceParallelSpec(StyleSpec):
    """Replicate the module's parameters and run it on a sequence-sharded input."""

    style: Literal["sequence_parallel"]
    sequence_dim: int = 1
    use_local_output: bool = False
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:SequenceParallel",
        replicates=True,
        flat_params=True,
        runs_module=True,
        inputs="first",
        outputs="first",
        input_option="sequence_dim",
    )

    def declared_input(self):
        return PlacementSpec("shard", self.sequence_dim), False

    def natural_output(self):
        return PlacementSpec("shard", self.sequence_dim)


class PrepareModuleInputSpec(_InputOptions):
    """Annotate and redistribute the module's inputs."""

    style: Literal["prepare_module_input"]
    use_local_output: bool = False
    semantics = StyleSemantics(torch_class=f"{_TORCH_TP}:PrepareModuleInput", inputs="layouts")


class PrepareModuleOutputSpec(_OutputOptions):
    """Annotate and redistribute the module's outputs."""

    style: Literal["prepare_module_output"]
    use_local_output: bool = True
    semantics = StyleSemantics(torch_class=f"{_TORCH_TP}:PrepareModuleOutput", outputs="layouts")


class PrepareModuleInputOutputSpec(_InputOptions, _OutputOptions):
    """Both of the above on one module."""

    style: Literal["prepare_module_input_output"]
    use_local_input: bool = False
    use_local_output: bool = True
    semantics = StyleSemantics(torch_class=f"{_TORCH_TP}:PrepareModuleInputOutput", inputs="layouts", outputs="layouts")

    def inputs_local(self) -> bool:
        return self.use_local_input


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
    semantics = StyleSemantics(
        torch_class="tpplan.sharding.styles:NoParallel",
        replicates=True,
        runs_module=True,
        inputs="first_tensor",
        outputs="first",
        input_option="input_layout",
    )

    def declared_input(self):
        return self.input_layout, False

    def natural_output(self):
        return self.output_layout


# -- styles beyond torch's (SPEC §2a) ---------------------------------------------


class _ExpertOptions(StyleSpec):
    input_layouts: Layout | None = Field(None, description="Layout of the hidden states; default replicate.")
    output_layouts: Layout | None = Field(
        None, description="The partial output is reduced to it: replicate (all-reduce, default) or shard(D) (reduce-scatter)."
    )
    use_local_output: bool = True

    def declared_input(self):
        return (self.input_layouts, False) if self.input_layouts is not None else (_REPLICATE, True)

    def natural_output(self):
        return self.output_layouts or _REPLICATE


# The experts' hidden states, token indices and routing weights are all handed on
# (first_tensor); parameter placements depend on the module's layout and the
# options: tpplan.sharding.experts.expert_placements, read by lint/facts.py.
_EXPERT_SEMANTICS = dict(runs_module=True, inputs="first_tensor", outputs="first", input_option="input_layouts")


class ExpertTPSpec(_ExpertOptions):
    """Shard every expert of a fused 3-D expert module (transformers' `experts`) on its
    intermediate dim; the partial output is reduced to `output_layouts`."""

    style: Literal["expert_tp"]
    params: dict[str, Layout] | None = Field(
        None,
        description="Placement per own parameter, over the defaults: gate_up_proj packed_shard(1, 2) "
        "([E, 2I, H]; shard(2) for gpt-oss's interleaved [E, H, 2I]), down_proj shard(2) ([E, H, I]; "
        "shard(1) transposed), gate_up_proj_bias like its gate/up dim, down_proj_bias replicate.",
    )
    semantics = StyleSemantics(torch_class="tpplan.sharding.experts:ExpertTensorParallel", **_EXPERT_SEMANTICS)


class ExpertParallelSpec(_ExpertOptions):
    """Whole experts per rank: shard(0) of the expert dim of every fused expert parameter."""

    style: Literal["expert_parallel"]
    dispatch: Literal["all_reduce"] = Field(
        "all_reduce",
        description="all_reduce: tokens replicated, each rank runs its experts on every token "
        "(weight 0 where not routed), one all-reduce sums the ranks' outputs.",
    )
    semantics = StyleSemantics(torch_class="tpplan.sharding.experts:ExpertParallel", **_EXPERT_SEMANTICS)


class LocalParamsSpec(_InputOptions):
    """A module inside a sharded region that computes on local tensors: its own parameters
    laid out by `params` (default replicate, the gradient summed over the mesh, as
    transformers' replicated_with_grad_allreduce); input layouts as prepare_module_input."""

    style: Literal["local_params"]
    params: dict[str, Layout] | None = Field(
        None, description="Placement per own parameter (default replicate, gradient summed over the mesh)."
    )
    use_local_output: bool = False
    # Its module's ops are followed by the lint (runs_module False), on local tensors.
    semantics = StyleSemantics(torch_class="tpplan.sharding.params:LocalParams", inputs="layouts")


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
        ExpertTPSpec,
        ExpertParallelSpec,
        LocalParamsSpec,
    )
}
STYLE_NAMES = tuple(STYLE_SPECS)
