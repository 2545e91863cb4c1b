"""A style's layout contract: what it does on each mesh axis, as data (no torch here).

torchtitan 0.3 states a module's parallelism as layouts (`state_shardings`,
`in_src/in_dst_shardings`, `out_src/out_dst_shardings`); a style's contract says
the same facts per mesh axis ("tp" today):

- `state`: module kind (a key of `style_model.MODULE_KINDS`, or `ANY`) -> own
  parameter name (or `OTHER` for any other own one, `SUBTREE` for every parameter
  and buffer of the module and its submodules) -> placement. Styles whose
  placements depend on the module itself (the expert styles, local_params) leave
  it empty and say so through `StyleSpec.param_placements(module)`.
- `inputs`: one `Port` per positional input the style lays out (src: the layout it
  arrives in, dst: the layout the module computes on); `rest` says what happens
  to the positional inputs after them ("dropped": torch hands on the first only,
  "passed": untouched).
- `outputs`: one `Port` per output (src: the layout the module's computation
  leaves it in, dst: the layout it is handed on in).
- each port's `grad`: what backward does to its gradient. "sum": the gradient is
  summed over the axis, as for a replicated forward value whose every rank's use
  contributes (spmd type R: replicate forward, partial backward); "reverse": the
  reverse of the forward redistribution only.
- `body`: who runs the module's own forward: "sharded" (the style hands it
  DTensor parameters; torch's business, so the lint takes the outputs' layouts
  from the contract), "traced" (it runs as written and the lint follows its ops),
  "unknown" (a class named without `like:`: nothing is known of it).

A layout in a port is a `PlacementSpec`, an `Option` (the rule's option of that
name, a default when the rule leaves it out), or None (left as it is). A table
entry holds the contract with its options unresolved; `StyleSpec.contract()`
resolves them for one rule (`AxisContract.filled`). The flags of `StyleSemantics`
(style_model.py) are derived from the entry's contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Union

from .placements import PlacementSpec

ANY = "*"  # state: any module kind
OTHER = "*"  # state: any other own parameter of the kind
SUBTREE = "**"  # state: every parameter and buffer of the module and of its submodules
TP = "tp"  # the mesh axis of plan version 1


@dataclass(frozen=True)
class Option:
    """A layout the rule gives by its option `name`: `default` where the rule leaves it
    None (torch's constructor default); `each`: the option is a list, one port per entry
    (or a mapping, one per keyword argument); `as_dim`: the option is a dim D, the layout shard(D)."""

    name: str
    default: PlacementSpec | None = None
    each: bool = False
    as_dim: bool = False


LayoutRef = Union[PlacementSpec, Option, None]


@dataclass(frozen=True)
class Port:
    """One forward input or output on one mesh axis (see the module docstring)."""

    src: LayoutRef = None
    dst: LayoutRef = None
    grad: Literal["sum", "reverse"] = "reverse"
    keyword: str | None = None  # a keyword argument's name (filled ports of prepare_module_input's kwargs)

    @property
    def each(self) -> bool:
        """Whether the port stands for one port per entry of its options' lists."""
        return any(isinstance(layout, Option) and layout.each for layout in (self.src, self.dst))

    @property
    def option(self) -> str | None:
        """The option that declares the layout the argument arrives in (None: a fixed layout)."""
        return self.src.name if isinstance(self.src, Option) else None


@dataclass(frozen=True)
class AxisContract:
    """What a style does on one mesh axis (see the module docstring)."""

    state: Mapping[str, Mapping[str, PlacementSpec]] = field(default_factory=dict)
    inputs: tuple[Port, ...] = ()
    rest: Literal["dropped", "passed"] = "passed"
    outputs: tuple[Port, ...] = ()
    body: Literal["sharded", "traced", "unknown"] = "traced"

    def placement(self, kind: str | None, param: str) -> PlacementSpec | None:
        """The placement own parameter `param` of a `kind` module gets by kind; None when
        the contract places no parameter of that kind by name."""
        table = self.state.get(kind) if kind is not None else None
        if table is None:
            return None
        return table.get(param, table[OTHER])

    @property
    def kinds(self) -> tuple[str, ...]:
        """The module kinds the style places parameters of (it applies to those only); () for any module."""
        return tuple(kind for kind in self.state if kind != ANY)

    @property
    def subtree(self) -> PlacementSpec | None:
        """The placement of every parameter and buffer of the module and its submodules, if one."""
        return self.state.get(ANY, {}).get(SUBTREE)

    def filled(self, value: Callable[[str], Any]) -> "AxisContract":
        """The contract of one rule: each `Option` replaced by `value(name)` (the rule's
        option), or its default where that is None; a port with list options becomes one
        port per entry (a keyword mapping one per keyword)."""

        def one(layout: LayoutRef) -> LayoutRef:
            if not isinstance(layout, Option):
                return layout
            given = value(layout.name)
            if given is None:
                return layout.default
            return PlacementSpec("shard", given) if layout.as_dim else given

        def ports(group: tuple[Port, ...]) -> tuple[Port, ...]:
            out: list[Port] = []
            for port in group:
                if not port.each:
                    out.append(dataclasses.replace(port, src=one(port.src), dst=one(port.dst)))
                    continue
                src, dst = (value(x.name) if isinstance(x, Option) else None for x in (port.src, port.dst))
                if isinstance(src, Mapping) or isinstance(dst, Mapping):
                    src, dst = src or {}, dst or {}
                    out += [Port(src.get(k), dst.get(k) or src.get(k), port.grad, k) for k in (*src, *(k for k in dst if k not in src))]
                else:
                    src, dst = src or [], dst or []
                    out += [Port(s, d if d is not None else s, port.grad) for s, d in
                            zip(src + [None] * (len(dst) - len(src)), dst + [None] * (len(src) - len(dst)))]
            return tuple(out)

        return dataclasses.replace(self, inputs=ports(self.inputs), outputs=ports(self.outputs))


@dataclass(frozen=True)
class Contract:
    """A style's layouts on every mesh axis it acts on: {axis name: AxisContract}."""

    axes: Mapping[str, AxisContract]

    def __getitem__(self, axis: str) -> AxisContract:
        return self.axes[axis]

    @property
    def tp(self) -> AxisContract:
        return self.axes[TP]


def tp(**fields: Any) -> Contract:
    """A contract on the tensor-parallel axis alone (plan version 1)."""
    return Contract({TP: AxisContract(**fields)})
