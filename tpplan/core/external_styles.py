"""Styles a plan names by their class: `style: PKG.MOD:Class` (torchao's
`Float8ColwiseParallel`, a user's own `ParallelStyle` subclass). No torch here,
and nothing is imported: plan-only `validate` never imports the class;
`sharding/compile.py` does, when the plan meets a model.

The rule's other keys are the constructor's keyword arguments, placements
spelled as in the plan. `like: STYLE` says which built-in style's semantics the
lint may assume: the rule is then validated as that style's options (the keys
that style knows keep their types and checks; others pass to the constructor
as they are) and reads that style's table entry. Without `like:` the module is
opaque to the lint (`OPAQUE`), which says so once per rule (TP306).

    layers.*.attention.wq: {style: torchao.float8:Float8ColwiseParallel, like: colwise}
    layers.*.attention.wo:
      style: torchao.float8:Float8RowwiseParallel
      like: rowwise
      output_layouts: shard(1)

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

import dataclasses
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field

from .placements import parse_placement
from .contract import tp
from .style_model import StyleSemantics, StyleSpec

# dotted module path, a colon, a dotted attribute path (a nested class is fine)
_NAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
EXTERNAL_PATTERN = f"^{_NAME}:{_NAME}$"
ExternalName = Annotated[str, Field(pattern=EXTERNAL_PATTERN, description="PKG.MOD:Class of a ParallelStyle subclass.")]

# The lint follows nothing through an opaque module: inputs pass as they are, its
# outputs' layouts are unknown.
OPAQUE = StyleSemantics(torch_class="", contract=tp(body="unknown"))


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
    """The styles `like:` may name: those that lay out a module's inputs and outputs
    by their options alone (torch's six and no_parallel, style_table.py); the
    expert styles and local_params (expert_styles.py) read parameters from their
    own options."""
    return tuple(name for name, cls in specs.items() if cls.__module__ != f"{__package__}.expert_styles")


def external_specs(specs: dict[str, type]) -> dict[str, type]:
    """{discriminator tag: spec class}: "external" (no `like:`, or one to be refused by
    the literal check) and "external:LIKE" for each style `like:` may name."""
    likes = like_names(specs)
    opaque = type("ExternalStyleSpec", (_External, StyleSpec), {
        "__module__": __name__,
        "__doc__": "A ParallelStyle subclass named by its class; opaque to the lint.",
        "__annotations__": {"style": ExternalName, "like": Optional[Literal[likes]]},
        "like": Field(None, description="The built-in style whose semantics the lint may assume."),
        "model_config": _ALLOW_EXTRA,
        "semantics": OPAQUE,
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
