"""Styles a plan names by their class: `style: PKG.MOD:Class` (torchao's
`Float8ColwiseParallel`, a user's own `ParallelStyle` subclass). No torch here,
and nothing is imported: plan-only `validate` never imports the class;
`sharding/compile.py` does, when the plan meets a model.

The rule's other keys are the constructor's keyword arguments, placements
spelled as in the plan. `like: STYLE` says which built-in style's semantics the
lint may assume: the rule is then validated as that style's options (the keys
that style knows keep their types and checks; others pass to the constructor
as they are) and reads that style's table entry. Without `like:` the module is
derived from the layouts the rule gives explicitly, spelled as torch's styles
name them (`input_layouts`, `desired_input_layouts`, `output_layouts`, and
`params:`, a placement per own parameter): the lint follows the module as they
say (`derived_contract`); with none of them the module is opaque to the lint
(`OPAQUE`), which says so once per rule (TP307).

    layers.*.attention.wq: {style: torchao.float8:Float8ColwiseParallel, like: colwise}
    layers.*.attention.wo:
      style: torchao.float8:Float8RowwiseParallel
      like: rowwise
      output_layouts: shard(1)
    layers.*.feed_forward.w1:   # the lint takes its layouts from these keys
      style: my_styles:ShardedLinear
      input_layouts: replicate
      output_layouts: shard(-1)
      params: {weight: shard(0)}

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

import dataclasses
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from .contract import Port, tp
from .expert_styles import unknown_params
from .placements import PlacementSpec, parse_placement
from .style_model import PLACEMENT_SCHEMA, Layout, StyleSemantics, StyleSpec

# dotted module path, a colon, a dotted attribute path (a nested class is fine)
_NAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
EXTERNAL_PATTERN = f"^{_NAME}:{_NAME}$"
ExternalName = Annotated[str, Field(pattern=EXTERNAL_PATTERN, description="PKG.MOD:Class of a ParallelStyle subclass.")]

# The lint follows nothing through an opaque module: inputs pass as they are, its
# outputs' layouts are unknown.
OPAQUE = StyleSemantics(torch_class="", contract=tp(body="unknown"))


def _layouts(value: Any) -> Any:
    """One placement, or a list of them (null entries leave that argument alone)."""
    if isinstance(value, list):
        return [None if v is None else parse_placement(v) for v in value]
    return parse_placement(value)


def _layouts_text(value: Any) -> Any:
    return [None if v is None else str(v) for v in value] if isinstance(value, list) else str(value)


# A layout key of a class named without `like:`: one placement, or one per positional
# argument (null leaves that one alone), handed to the constructor as the plan writes it.
LayoutArgument = Annotated[
    Any, PlainValidator(_layouts), PlainSerializer(_layouts_text),
    WithJsonSchema({"anyOf": [PLACEMENT_SCHEMA, {"type": "array", "items": {"anyOf": [PLACEMENT_SCHEMA, {"type": "null"}]}}]}),
]
# The keys a class named without `like:` states its layouts by (torch's styles' names).
LAYOUT_KEYS = ("input_layouts", "desired_input_layouts", "output_layouts", "params")
_REPLICATE = PlacementSpec("replicate")


def _each(value: Any) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def derived_contract(inputs: Any, desired: Any, outputs: Any, params: "dict[str, PlacementSpec] | None") -> StyleSemantics:
    """The table entry of a class named without `like:` whose rule gives its layouts: each
    input arrives as `inputs` says and is computed on as `desired` says (else as it
    arrives), each output is handed on as `outputs` says; the class runs the module
    (the lint follows no op inside it; an output it does not lay out is unknown). An
    input computed on whole by a module with a sharded parameter (`params`) has its
    gradient summed, as colwise's: every rank's share of it adds up (spmd R). Without
    any of them, OPAQUE."""
    if inputs is None and desired is None and outputs is None and params is None:
        return OPAQUE
    arrive, want = _each(inputs), _each(desired)
    sharded = any(placement.kind == "shard" for placement in (params or {}).values())
    ports = []
    for i in range(max(len(arrive), len(want))):
        src = arrive[i] if i < len(arrive) else None
        dst = want[i] if i < len(want) and want[i] is not None else src
        ports.append(Port(src=src, dst=dst, grad="sum" if sharded and dst == _REPLICATE else "reverse"))
    contract = tp(inputs=tuple(ports), rest="passed", outputs=tuple(Port(dst=layout) for layout in _each(outputs)), body="sharded")
    return StyleSemantics(torch_class="", contract=contract)


def is_external(style: Any) -> bool:
    """Whether a rule's `style:` value names a class (it has a colon; built-in names have none)."""
    return isinstance(style, str) and ":" in style


def _plan_value(value: Any) -> Any:
    """A constructor argument as the plan writes it: placement text becomes a placement
    (to_torch'd by compile), lists and mappings of them too; anything else as it is."""
    if isinstance(value, str):
        try:
            return parse_placement(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_plan_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _plan_value(v) for k, v in value.items()}
    return value


class _Derived:
    """A class named without `like:`: its table entry derived from the layouts the rule
    gives (`derived_contract`), its own parameters placed as `params` says."""

    @property
    def semantics(self) -> StyleSemantics:
        derived = derived_contract(self.input_layouts, self.desired_input_layouts, self.output_layouts, self.params)
        return dataclasses.replace(derived, torch_class=self.style) if derived is not OPAQUE else OPAQUE

    @property
    def use_local_output(self) -> bool:
        """Whether the class hands on local tensors: as the rule says, else torch's styles' default."""
        return (self.model_extra or {}).get("use_local_output", True)

    def param_placements(self, module: Any) -> "dict[str, PlacementSpec] | None":
        if self.params is None:
            return None
        own = [name for name, param in module._parameters.items() if param is not None]
        unknown = set(self.params) - set(own)
        if unknown:
            raise unknown_params(module, unknown, own)
        return dict(self.params)


class _External:
    """What every external spec does: its class is its `style`, its arguments the keys
    the rule wrote (not the like-style's defaults, which the class may not take)."""

    style: str

    def torch_class(self, kind: str | None = None) -> str:
        return self.style

    def torch_options(self) -> dict[str, Any]:
        written = {name: getattr(self, name) for name in self.model_fields_set if name not in ("style", "like")}
        return {**written, **{k: _plan_value(v) for k, v in (self.model_extra or {}).items()}}


_ALLOW_EXTRA = ConfigDict(extra="allow", strict=True, frozen=True, defer_build=True)


def like_names(specs: dict[str, type]) -> tuple[str, ...]:
    """The styles `like:` may name (the loader's union and the JSON Schema both ask here):
    those whose contract says what they do to layouts from their options alone, that
    is, it lays out some input or output and places no parameter by the module (torch's
    six and no_parallel). The expert styles and local_params place parameters by the
    module and their `params`; sum_output_grad lays out nothing."""
    def by_options(cls: type) -> bool:
        contract = cls.semantics.contract.tp
        ports = (*contract.inputs, *contract.outputs)
        return cls.param_placements is StyleSpec.param_placements and any(p.src is not None or p.dst is not None for p in ports)

    return tuple(name for name, cls in specs.items() if by_options(cls))


def external_specs(specs: dict[str, type]) -> dict[str, type]:
    """{discriminator tag: spec class}: "external" (no `like:`, or one to be refused by
    the literal check) and "external:LIKE" for each style `like:` may name."""
    likes = like_names(specs)
    layout = "One placement, or one per positional argument; the lint follows the module as it says."
    opaque = type("ExternalStyleSpec", (_Derived, _External, StyleSpec), {
        "__module__": __name__,
        "__doc__": "A ParallelStyle subclass named by its class; the lint follows the layouts its rule gives, if any.",
        "__annotations__": {
            "style": ExternalName, "like": Optional[Literal[likes]],
            **{key: Optional[LayoutArgument] for key in LAYOUT_KEYS[:3]}, "params": Optional[dict[str, Layout]],
        },
        "like": Field(None, description="The built-in style whose semantics the lint may assume."),
        "input_layouts": Field(None, description=f"The layout the inputs arrive in. {layout}"),
        "desired_input_layouts": Field(None, description=f"The layout the module computes on (default: as they arrive). {layout}"),
        "output_layouts": Field(None, description=f"The layout the outputs are handed on in. {layout}"),
        "params": Field(None, description="The placement of each own parameter of the module."),
        "model_config": _ALLOW_EXTRA,
    })
    out = {"external": opaque}
    for name in likes:
        base = specs[name]
        out[f"external:{name}"] = type(f"External{base.__name__}", (_External, base), {
            "__module__": __name__,
            "__doc__": f"A ParallelStyle subclass named by its class, checked as {name}.",
            "__annotations__": {"style": ExternalName, "like": Literal[name]},
            "model_config": _ALLOW_EXTRA,
            # the like-style's table entry, but this rule's class
            "semantics": property(lambda self, s=base.semantics: dataclasses.replace(s, torch_class=self.style)),
        })
    return out


def external_tag(value: Any, likes: tuple[str, ...]) -> Optional[str]:
    """The union tag of a rule value whose style names a class."""
    like = value.get("like") if isinstance(value, dict) else getattr(value, "like", None)
    return f"external:{like}" if like in likes else "external"
