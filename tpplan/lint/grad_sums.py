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


class GradSums:
    def __init__(self) -> None:
        self.found: list[GradSum] = []
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

    def op(self, inputs, values: "list[Lay]", outputs, results: "list[Lay]") -> None:
        marks = self._marks(inputs)
        if not marks:
            return
        if any(v.dt is not False for v in values) or any(r.kind == "?" for r in results):
            for found in marks:
                found.unknown = True
            return
        marked_whole = any(v.kind == "R" and n in self.marks for n, v in zip(inputs, values))
        if marked_whole and any(v.kind in ("S", "P") for v in values):
            for found in marks:
                found.shared = True
        for node in outputs:
            self.marks[node] = marks

    def _marks(self, nodes) -> tuple[GradSum, ...]:
        seen: dict[int, GradSum] = {}
        for node in nodes:
            for found in self.marks.get(node, ()) if node is not None else ():
                seen[id(found)] = found
        return tuple(seen.values())
