"""Where the output of a module whose style sums its output's gradient over the mesh
(`sum_output_grad`) goes: the sum is right only where each rank's gradient of that
output is its share, i.e. somewhere a rank computes with it on its own slice (the
whole tensor meeting a local shard: MLA's rotary key against the rank's heads). An
output used only whole on every rank (by replicated ops, the model's output, or a
style that runs its module in DTensor land, which sums its input's gradient itself)
already has the full gradient on every rank, and the sum makes it `tp` times too large.

Followed alongside the layout flow (flow.py): every tensor derived from such an output
is marked with it; a mark that meets a DTensor, or whose layout the flow loses, is
`unknown` (no verdict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.plan import Rule
    from .layouts import Lay


@dataclass
class GradSum:
    fqn: str  # the module whose output's gradient is summed
    rule: "Rule"
    shared: bool = False  # some rank computes with it on its own slice: the sum is needed
    unknown: bool = False  # the flow lost it (an unmodelled op, DTensor land): no verdict


@dataclass(frozen=True)
class SharedOperand:
    """A replicated tensor computed from trainable parameters meets a local shard in an op:
    each rank's gradient of it is its share, and nothing sums it (TP325)."""

    value: "Lay"  # the shard it meets, with its source
    op: str
    fqn: str  # the module the op runs in
    producer: str | None  # the innermost module that returned the replicated tensor
    shape: tuple  # the shard's full shape


class GradSums:
    def __init__(self) -> None:
        self.found: list[GradSum] = []
        self.shared_operands: list[SharedOperand] = []
        self.marks: dict[int, tuple[GradSum, ...]] = {}  # node -> the sums it derives from

    def returned(self, fqn: str, rule: "Rule", nodes) -> None:
        """The module `fqn` styled by `rule` (a style that sums its output's gradient) returned `nodes`."""
        found = GradSum(fqn, rule)
        self.found.append(found)
        for node in nodes:
            self.marks[node] = self.marks.get(node, ()) + (found,)

    def passed(self, inputs, outputs) -> None:
        """A module run by its style (its inside unseen) took `inputs` and returned `outputs`:
        they derive from what it took (a use of the whole tensor, not a share)."""
        marks = self._marks(inputs)
        for node in outputs if marks else ():
            self.marks[node] = marks

    def operands(self, inputs, values: "list[Lay]", results: "list[Lay]", trace, where: str, op: str, producers: dict) -> None:
        """Record a replicated activation computed from parameters (not a parameter: those are
        TP325's at their module's door, or local_params'; not one whose gradient is summed)
        that meets a plain local shard in an op the flow follows to a shard."""
        if not results or not all(r.kind == "S" and r.dt is False for r in results):
            return
        shards = [(n, v) for n, v in zip(inputs, values) if v.kind == "S" and v.dt is False and v.src is not None]
        for node, value in zip(inputs, values) if shards else ():
            if (value.kind == "R" and value.dt is False and trace.needs_grad[node] and node not in trace.params
                    and node not in self.marks and math.prod(trace.shapes[node]) > 1):
                shard_node, shard = shards[0]
                self.shared_operands.append(SharedOperand(shard, op, where, producers.get(node), trace.shapes[shard_node]))
                return

    def op(self, inputs, values: "list[Lay]", outputs, results: "list[Lay]") -> None:
        marks = self._marks(inputs)
        if not marks:
            return
        marked_whole = any(v.kind == "R" and v.dt is False and n in self.marks for n, v in zip(inputs, values))
        if marked_whole and any(v.kind in ("S", "P") and v.dt is False for v in values):
            for found in marks:
                found.shared = True  # whatever the flow makes of the op: a rank computes with it on its slice
        if any(v.dt is not False for v in values) or any(r.kind == "?" for r in results):
            for found in marks:
                found.unknown = True
            return
        for node in outputs:
            self.marks[node] = marks

    def _marks(self, nodes) -> tuple[GradSum, ...]:
        seen: dict[int, GradSum] = {}
        for node in nodes:
            for found in self.marks.get(node, ()) if node is not None else ():
                seen[id(found)] = found
        return tuple(seen.values())
