"""What a style entry is: `StyleSemantics` (what a style does), `StyleSpec` (the
pydantic base of every style's options), the option groups styles share, the
layout types of options, and the module kinds styles apply to. No torch here.
The entries themselves are in style_table.py (torch's styles and no_parallel)
and expert_styles.py (tpplan's styles beyond torch's).

A style's table entry is a `StyleSemantics`: its torch class and its layout
contract (contract.py: per mesh axis, its parameters' placements, each input's and
output's source and destination layouts, what backward does to each gradient, who
runs the module's body). What the lint and the tools ask of a style (does it
replicate every parameter, does it sum its input's gradient, ...) is derived from
the contract by the entry's properties, never stated beside it. Besides the
contract an entry holds:

- `torch_class`: "module:Class" of the ParallelStyle (resolved by compile, so
  core never imports torch); the spec's fields are its keyword arguments.
- `kind_classes`: module kind -> the ParallelStyle class that shards that kind,
  where `torch_class` (torch's) shards only the others (colwise and rowwise on
  transformers' Conv1D and stacked expert Linears: sharding/kinds.py).
- `flat_params`: the torch class refuses a module whose submodules hold
  parameters (sequence_parallel re-registers them under dotted names: TP301).
- `experts`: how the style splits a fused 3-D experts module: "whole" experts
  per rank (the expert dim), or "each" expert on its intermediate dim; None for
  a style that is no expert style (TP305 checks the module and the degree).
  (Their placements depend on the module: `StyleSpec.param_placements`.)

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

from .contract import TP, AxisContract, Contract, LayoutRef, Option, Port, tp
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
    """A style's table entry: its torch class and its contract (see the module docstring)."""

    torch_class: str
    contract: Contract = field(default_factory=lambda: tp())
    flat_params: bool = False
    experts: Literal["whole", "each"] | None = None
    # module kind -> "module:Class" for that kind, where `torch_class` shards only the others
    kind_classes: Mapping[str, str] = field(default_factory=dict)

    # -- derived from the contract's tp axis (one truth: the contract) --

    @property
    def inputs(self) -> Literal["first", "first_tensor", "layouts", "none"]:
        """"first": only the first positional input is handed on (torch drops the rest);
        "first_tensor": the first is laid out, the others pass; "layouts": one layout per
        input, from the options; "none": inputs pass untouched."""
        ports = self.contract.tp.inputs
        if not ports:
            return "none"
        if ports[0].each:
            return "layouts"
        return "first" if self.contract.tp.rest == "dropped" else "first_tensor"

    @property
    def input_option(self) -> str | None:
        """The option that declares the first input's layout, for messages that say what to
        change (None: the options say per input, or no option does)."""
        ports = self.contract.tp.inputs
        return ports[0].option if ports and not ports[0].each else None

    @property
    def sequence_shards(self) -> bool:
        """The style runs the module, its parameters replicated, on one shard of its input
        per rank (sequence_parallel): right only for position-wise modules (TP302), and its
        input must arrive sharded on the dim its `input_option` names (TP320)."""
        ports = self.contract.tp.inputs
        first = _default(ports[0].dst) if ports and not ports[0].each else None
        return self.contract.tp.subtree == _REPLICATE and first is not None and first.kind == "shard"

    @property
    def feature_sharded_output(self) -> bool:
        """The module's output features are split over the ranks (colwise): its local output
        is a feature shard (heads, a vocabulary), not a sequence shard (TP325, TP370)."""
        ports = self.contract.tp.outputs
        return bool(ports) and not ports[0].each and _default(ports[0].dst) == _LAST_DIM


def _default(layout: LayoutRef) -> PlacementSpec | None:
    """A template's layout where the rule leaves its option out."""
    return layout.default if isinstance(layout, Option) else layout


class _Strict(BaseModel):
    # strict: "yes" is not a boolean and "1" is not a dimension.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)


class StyleSpec(_Strict):
    style: str
    semantics: ClassVar[StyleSemantics]
    # The constructor's cross-field rules, as data (cross_field.py): the loader's TP105
    # problems and the JSON Schema's conditions are both read from it.
    cross_field: ClassVar[tuple[Rule, ...]] = ()

    def contract(self, axis: str = TP) -> AxisContract:
        """This rule's contract on `axis`: the table's, each option-given layout resolved
        to the rule's option or its default (a spec whose options change more than one
        layout says so here)."""
        return self.semantics.contract[axis].filled(lambda name: getattr(self, name, None))

    def declared_input(self) -> "tuple[PlacementSpec | None, bool] | None":
        """For a style that runs the module: the layout it declares a plain first
        input to have, and whether that is torch's default rather than the plan's
        word. None for the prepare_module_* styles (their options say)."""
        template = self.semantics.contract.tp.inputs
        if self.semantics.contract.tp.body != "sharded" or not template or template[0].each:
            return None
        option = template[0].option
        return self.contract().inputs[0].src, option is not None and getattr(self, option, None) is None

    def output_follows_input(self) -> bool:
        """For a style that runs the module: whether its (local) output is laid out
        as its first input (each rank gets back its own tokens), not `natural_output`."""
        return False

    def natural_output(self) -> "PlacementSpec | None":
        """For a style that runs the module: the layout its (first) output gets."""
        outputs = self.contract().outputs
        return outputs[0].dst if self.semantics.contract.tp.body == "sharded" and outputs else None

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
        shard it). None: the contract's `state` says, by module kind (or nothing is placed)."""
        return None

    def own_placements(self, module: Any, kind: "str | None") -> "dict[str, PlacementSpec]":
        """The placement of each own parameter of `module` (of `kind`, a key of
        MODULE_KINDS, or None) under this rule: the one answer that the compiled styles
        place parameters by, the lint's flow follows, and the memory and checkpoint shard
        math see (as the DTensors the styles make). From the contract's `state` (the
        whole subtree's placement, or by module kind), or, for a style whose placements
        depend on the module and the options, `param_placements` (a StyleInputError
        when it cannot shard the module). Empty: the rule places none of them."""
        placed = self.param_placements(module)
        if placed is not None:
            return placed
        state = self.contract()
        own = [name for name, param in module._parameters.items() if param is not None]
        if state.subtree is not None:
            return {name: state.subtree for name in own}
        if kind is None or kind not in state.state:
            return {}
        return {name: state.placement(kind, name) for name in own}

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
        """The constructor's keyword arguments: every option (a spec may drop some), a
        layout the rule leaves out given as the contract's default, so that the torch
        class lays out what the contract (and so the lint) says."""
        options = {name: getattr(self, name) for name in type(self).model_fields if name != "style"}
        template, filled = self.semantics.contract.tp, self.contract()
        for group, ports in ((template.inputs, filled.inputs), (template.outputs, filled.outputs)):
            for port, resolved in zip(group, ports):
                for layout, value in ((port.src, resolved.src), (port.dst, resolved.dst)):
                    if isinstance(layout, Option) and not layout.each and not layout.as_dim and options.get(layout.name, 0) is None:
                        options[layout.name] = value
        return options


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
_PARTIAL = PlacementSpec("partial")

# prepare_module_input's and _output's ports: one per entry of their options' lists
INPUT_PORTS = (
    Port(src=Option("input_layouts", each=True), dst=Option("desired_input_layouts", each=True)),
    Port(src=Option("input_kwarg_layouts", each=True), dst=Option("desired_input_kwarg_layouts", each=True)),
)
OUTPUT_PORTS = (Port(src=Option("output_layouts", each=True), dst=Option("desired_output_layouts", each=True)),)
