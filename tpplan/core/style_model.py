"""What a style entry is: `StyleSemantics` (what a style does), `StyleSpec` (the
pydantic base of every style's options), the option groups styles share, the
layout types of options, and the module kinds styles apply to. No torch here.
The entries themselves are in style_table.py (torch's styles and no_parallel)
and expert_styles.py (tpplan's styles beyond torch's).

The fields of `StyleSemantics`:

- `torch_class`: "module:Class" of the ParallelStyle (resolved by compile, so
  core never imports torch); the spec's fields are its keyword arguments.
- `params`: module kind (a key of `MODULE_KINDS`) -> placement of each
  parameter (a `PlacementSpec`). A style with `params` applies to those kinds
  only (torch raises NotImplementedError on any other module: TP300). Styles
  whose placements depend on the module and the options say so through
  `StyleSpec.param_placements(module)` instead (the expert styles, local_params).
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
- `sequence_shards`: the style runs the module on one sequence shard per rank
  (sequence_parallel): right only for position-wise modules (TP302), and its
  input must arrive sharded on the dim its `input_option` names (TP320).
- `feature_sharded_output`: the module's output features are split over the
  ranks (colwise), so its local output is a feature shard (heads, a vocabulary),
  not a sequence shard (TP325, TP370).
- `experts`: how the style splits a fused 3-D experts module: "whole" experts
  per rank (the expert dim), or "each" expert on its intermediate dim; None for
  a style that is no expert style (TP305 checks the module and the degree).
- `kind_classes`: module kind -> the ParallelStyle class that shards that kind,
  where `torch_class` (torch's) shards only the others (colwise and rowwise on
  transformers' Conv1D and stacked expert Linears: sharding/kinds.py).
- `opaque`: the lint knows nothing of what the style does (a class the plan
  names without `like:`, external_styles.py): it follows no layout through
  the module and judges none of its inputs or outputs.

Option names and defaults are those of torch's style constructors; the
constructors' cross-field asserts (and tpplan's own, between its options) are
each spec's `cross_field` rules (cross_field.py), reported at the offending key
like any other schema error and stated in the JSON Schema from the same data. No `from __future__ import annotations`
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

from .cross_field import Fills, Requires, Rule, SameKeys, SameLength
from .cross_field import problems as broken_rules
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
    label: str  # the class, as messages name it
    # the styles that shard it hand on its positional inputs after the first untouched (stacked Linears' expert_size)
    more_inputs: bool = False


# Matched in this order (isinstance: subclasses count).
MODULE_KINDS: dict[str, ModuleKind] = {
    # an nn.Linear, or a peft LoRA-wrapped one (its base layer sharded, its adapters derived: sharding/lora.py)
    "Linear": ModuleKind("tpplan.sharding.lora:is_linear", ("out_features", "in_features"), "nn.Linear"),
    "Embedding": ModuleKind("torch.nn:Embedding", ("num_embeddings", "embedding_dim"), "nn.Embedding"),
    # transformers' Conv1D (GPT-2, openai-gpt): a Linear whose weight is stored [in, out]
    "Conv1D": ModuleKind("tpplan.sharding.kinds:is_conv1d", ("nx", "nf"), "transformers' Conv1D"),
    # one Linear per expert in one weight [E, out, in] (JetMoE's JetMoeParallelExperts), called (inputs, expert_size)
    "StackedLinears": ModuleKind("tpplan.sharding.kinds:is_stacked_linears", ("num_experts", "output_size", "input_size"),
                                 "stacked expert Linears", more_inputs=True),
}


@dataclass(frozen=True)
class StyleSemantics:
    """What a style does (see the module docstring)."""

    torch_class: str
    params: Mapping[str, Mapping[str, PlacementSpec]] = field(default_factory=dict)
    replicates: bool = False
    flat_params: bool = False
    runs_module: bool = False
    inputs: Literal["first", "first_tensor", "layouts", "none"] = "none"
    outputs: Literal["first", "layouts", "none"] = "none"
    replicated_input: bool = False
    input_option: str | None = None  # the option that declares the first input's layout
    sequence_shards: bool = False
    feature_sharded_output: bool = False
    experts: Literal["whole", "each"] | None = None
    opaque: bool = False
    sums_output_grad: bool = False  # backward all-reduces the gradient of the module's output
    # module kind -> "module:Class" for that kind, where `torch_class` shards only the others
    kind_classes: Mapping[str, str] = field(default_factory=dict)

    def placement(self, kind: str | None, param: str) -> PlacementSpec | None:
        """The placement parameter `param` of a `kind` module gets; None when the
        style does not shard that kind."""
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
    # The constructor's cross-field rules, as data (cross_field.py): the loader's TP105
    # problems and the JSON Schema's conditions are both read from it.
    cross_field: ClassVar[tuple[Rule, ...]] = ()

    def declared_input(self) -> "tuple[PlacementSpec | None, bool] | None":
        """For a style that runs the module: the layout it declares a plain first
        input to have, and whether that is torch's default rather than the plan's
        word. None for the prepare_module_* styles (their options say)."""
        return None

    def output_follows_input(self) -> bool:
        """For a style that runs the module: whether its (local) output is laid out
        as its first input (each rank gets back its own tokens), not `natural_output`."""
        return False

    def natural_output(self) -> "PlacementSpec | None":
        """For a style that runs the module: the layout its (first) output gets."""
        return None

    def packed_blocks(self, size: int) -> "tuple[int, ...] | None":
        """For a style whose local output packs several kinds (colwise with `packed`): the
        sizes of the blocks of the output's `size` features; None for a plain shard."""
        return None

    @classmethod
    def cross_field_rules(cls) -> tuple[Rule, ...]:
        """The style's cross-field rules: those of its option groups first, then its own."""
        return tuple(rule for klass in reversed(cls.__mro__) for rule in vars(klass).get("cross_field", ()))

    def cross_field_problems(self) -> list[tuple[tuple, str]]:
        """(path within the rule, message) for each cross-field rule this spec breaks."""
        return broken_rules(self, self.cross_field_rules())

    def param_placements(self, module: Any) -> "dict[str, PlacementSpec] | None":
        """For a style whose placements depend on the module and the options: the
        placement of each own parameter of `module` (ValueError when the style cannot
        shard it). None: `semantics.params` says, by module kind (or nothing is placed)."""
        return None

    def local_param_placements(self) -> "dict[str, PlacementSpec]":
        """The own parameters the module's forward computes on as local shards, when the
        style leaves its ops to it (local_params' `params`): the lint follows them there."""
        return {}

    def needs_parent(self) -> bool:
        """Whether the compiled style must be bound to the module's parent before it is
        applied (`bind_parent`: colwise with heads adjusts its attention module)."""
        return False

    def local_option(self) -> str:
        """The option that makes the style hand on local tensors rather than DTensors."""
        return "use_local_output"

    def torch_class(self, kind: str | None = None) -> str:
        """The "module:Class" this rule compiles to for a module of `kind` (a key of
        MODULE_KINDS): the table's, unless an option or the kind picks another."""
        return self.semantics.kind_classes.get(kind, self.semantics.torch_class)

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

    cross_field = (
        Requires("desired_input_layouts", "input_layouts",
                 "'{a}' has no effect without '{b}': add '{b}' (the layouts the arguments arrive in)"),
        Requires("input_layouts", "desired_input_layouts", "'{a}' needs '{b}' (one entry per entry of '{a}')"),
        SameLength("input_layouts", "desired_input_layouts", "'{b}' has {len_b} entries but '{a}' has {len_a}: give one per argument"),
        Requires("desired_input_kwarg_layouts", "input_kwarg_layouts", "'{a}' has no effect without '{b}'"),
        SameKeys("input_kwarg_layouts", "desired_input_kwarg_layouts"),
    )


class _OutputOptions(StyleSpec):
    output_layouts: LayoutList
    desired_output_layouts: LayoutList

    # both required: given, as a list of one null when written as null
    cross_field = (
        SameLength("output_layouts", "desired_output_layouts", "'{b}' has {len_b} entries but '{a}' has {len_a}: give one per argument"),
        Fills("output_layouts", "desired_output_layouts",
              "'{b}' entry {i} is null but '{a}' entry {i} is {layout}: give the layout to redistribute to"),
    )


_TORCH_TP = "torch.distributed.tensor.parallel"
_REPLICATE = PlacementSpec("replicate")
_SHARD0 = PlacementSpec("shard", 0)
_SHARD1 = PlacementSpec("shard", 1)
_LAST_DIM = PlacementSpec("shard", -1)
