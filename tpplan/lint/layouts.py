"""The layouts the layout flow (flow.py) gives tensors, and what it finds.

Every tensor gets a layout under the plan, as torch would give it at run time:

- plain `R`: a local tensor holding the full value (what the model starts with);
- plain `S(d)`: a local tensor holding one rank's shard of dim `d` of the full
  shape (what a style returns with `use_local_output: true` and a shard layout);
- plain `P`: a local tensor holding a partial sum;
- a DTensor (`dt`): torch knows its placement and redistributes it as needed;
- unknown (`?`): we lost track (an op we do not model); nothing downstream is judged.

What can go wrong is recorded as findings that the TP32x rules turn into problems:

- `Mismatch`: a style annotates a plain tensor (`DTensor.from_local`) with a
  layout it does not have (a shard declared replicated, or the reverse);
- `Leak`: a plain shard or partial reaches what needs the full tensor: a module
  the plan leaves alone that has parameters, an op that mixes it with full
  tensors or reduces over the sharded dim, or the model's output (`OwnParam`
  when the full tensor is a view of a running module's own parameter, such as
  per-head sinks, that sharded like the activation would fit it);
- `Mixed`: a DTensor meets a plain tensor (torch raises);
- `Stop`: a plain shard or partial meets an op the flow does not model (or not
  with these arguments): its layout is unknown from there on, nothing it
  reaches is judged (TP328 says so);
- `Handoff`: a plain shard correctly annotated by the next style (TP324 checks
  that each degree divides it evenly);
- `Fused`: a fused projection's plain shard split into kinds (q, k, v) along its
  sharded dim, or a packed one (colwise `packed`) used as a plain shard (TP326);
- `ColwiseInput`, `CallSite`, `OutputSite`: facts for the arity and
  communication rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.placements import PlacementSpec
from .text import shard_text

if TYPE_CHECKING:
    from ..core.plan import Rule

@dataclass(frozen=True, slots=True)
class Source:
    """The module (and the plan rule that styles it) a layout comes from."""

    fqn: str
    rule: "Rule"


@dataclass(frozen=True, slots=True)
class Lay:
    kind: str  # 'R', 'S', 'P' or '?'
    dt: bool | None = False  # DTensor; None: unknown after a reported problem (judge nothing)
    dim: int | None = None  # S: the sharded dim of the full shape
    src: Source | None = None
    blocks: tuple | None = None  # S of a packed colwise: the full sizes of the blocks along `dim`
    # S: > 1 for a strided shard: `dim` read as (split, rest), each rank holding its block of
    # `rest` in every one of the `split` groups (DTensor's _StridedShard(dim, split_factor=split)),
    # what a view merging the dims in front of a local shard's dim into it makes of the shard
    split: int = 1

    def text(self, ndim: int) -> str:
        base = shard_text(self.dim, ndim) if self.kind == "S" else {"R": "replicated", "P": "partial", "?": "unknown"}[self.kind]
        base = f"strided {base} ({self.split} groups)" if self.kind == "S" and self.split > 1 else base
        return f"{base} DTensor" if self.dt else base


REPLICATED = Lay("R")
DEAD = Lay("?", None)


def placement_lay(placement: PlacementSpec | None, ndim: int, dt: bool, src: Source | None) -> Lay | None:
    """The layout a placement gives a tensor of `ndim` dims; None for a shard dim out of range."""
    if placement is None or placement.kind == "replicate":
        return Lay("R", dt, None, src)
    if placement.kind == "partial":
        return Lay("P", dt, None, src)
    if not -ndim <= placement.dim < ndim:
        return None
    return Lay("S", dt, placement.dim % ndim, src)


# -- findings ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    fqn: str  # the module whose style annotates
    rule: "Rule"
    what: str  # "input 0", "input 'mask'", "output 0"
    declared: PlacementSpec  # as the plan (or torch's default) says
    declared_default: bool  # the declaration is torch's default, not written in the plan
    actual: Lay
    shape: tuple
    impossible: bool = False  # the declared shard dim is out of range for the tensor


@dataclass(frozen=True)
class OwnParam:
    """A replicated parameter of a module running around the op (per-head attention
    sinks) that meets a local shard along a dim exactly the shard's full size: laid out
    the same way (local_params `params: {name: shard(dim)}`), the shapes agree."""

    fqn: str  # the module that holds it
    name: str
    dim: int  # the parameter's dim facing the sharded one


@dataclass(frozen=True)
class Leak:
    value: Lay  # plain S or P, with its source
    where: str  # 'module', 'output', 'op', 'reduce'
    fqn: str  # the module reached (where='module'), or the module the op runs in
    detail: str  # module class, op name
    shape: tuple
    against: tuple | None = None  # where='op': (node, dim) of the full tensor facing the sharded dim
    param: OwnParam | None = None  # that full tensor is a parameter's view which sharding would fit

    @property
    def sequence(self) -> bool:
        """A shard of a non-feature dim (sequence parallelism), not of the last dim."""
        return self.value.kind == "S" and self.value.dim != len(self.shape) - 1


@dataclass(frozen=True)
class Mixed:
    value: Lay  # the DTensor
    shape: tuple  # its full shape
    fqn: str
    detail: str  # "op 'add'" or "module 'norm' (RMSNorm) whose parameters are plain tensors"


@dataclass(frozen=True)
class Stop:
    value: Lay  # plain S or P, with its source
    op: str  # the op's name
    fqn: str  # the module the op runs in
    shape: tuple  # the full shape of the value


@dataclass(frozen=True)
class Handoff:
    value: Lay  # plain S, correctly declared by the consumer
    consumer: str
    rule: "Rule"
    size: int  # full size of the sharded dim
    ndim: int


@dataclass(frozen=True)
class Fused:
    value: Lay  # the plain shard (packed or not), with its source
    fqn: str  # the module the op runs in, or the consumer (where='handoff')
    detail: str  # the op ('chunk', 'unbind', 'getitem', 'view'), or the consumer's rule pattern
    shape: tuple  # the full shape of the value
    where: str  # 'split': a plain shard split into kinds; 'slice', 'view', 'handoff': a packed shard misused
    pieces: tuple | None = None  # the sizes the split cuts the sharded dim into, when it says


@dataclass(frozen=True)
class ColwiseInput:
    fqn: str
    rule: "Rule"
    node: int
    value: Lay
    needs_grad: bool
    enclosing: tuple  # (fqn, Call) of the modules running around this call, innermost last


@dataclass(frozen=True)
class CallSite:
    fqn: str
    rule: "Rule"
    positional: int
    keywords: tuple
    first_is_tensor: bool


@dataclass(frozen=True)
class OutputSite:
    fqn: str
    rule: "Rule"
    count: int


@dataclass
class FlowReport:
    mismatches: list = field(default_factory=list)
    leaks: list = field(default_factory=list)
    mixed: list = field(default_factory=list)
    handoffs: list = field(default_factory=list)
    fused: list = field(default_factory=list)
    stops: list = field(default_factory=list)
    grad_sums: list = field(default_factory=list)  # grad_sums.GradSum: where a summed output's gradient goes
    shared_operands: list = field(default_factory=list)  # grad_sums.SharedOperand: partial gradients of activations
    colwise_inputs: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
