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

The converse, a gradient left pending: a whole tensor computed from parameters, with no
summed gradient, that meets a local shard or a partial sum (`R * S -> S`, `R @ P -> P`)
gets each rank's share of its gradient (`SharedOperand`, TP325), and `summing_module`
finds where `sum_output_grad` would sum it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

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
    """A replicated tensor computed from trainable parameters meets a local shard or a
    partial sum in an op (`gate(x) * up_shard`, `scores @ partial_expert_outputs`): the
    forward is right, but each rank's gradient of it is its share (partial), and nothing
    sums it (TP325). The type rule: R op S -> S, R op P -> P, the R operand's gradient P."""

    value: "Lay"  # the shard or partial sum it meets, with its source
    op: str
    fqn: str  # the module the op runs in
    producer: str | None  # where to sum its gradient: see `summing_module`
    shape: tuple  # the shard's full shape
    returned: bool = True  # `producer` returned the tensor itself, not one it was computed from


class GradSums:
    def __init__(self, modules: "dict[str, nn.Module]") -> None:
        self.modules = modules
        self.found: list[GradSum] = []
        self.shared_operands: list[SharedOperand] = []
        self.marks: dict[int, tuple[GradSum, ...]] = {}  # node -> the sums it derives from
        self.producers: dict[int, str] = {}  # node -> the innermost module that returned it

    def returned_by(self, fqn: str, nodes) -> None:
        """Module `fqn` returned `nodes` (called innermost first)."""
        for node in nodes:
            self.producers.setdefault(node, fqn)

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

    def operands(self, op, values: "list[Lay]", results: "list[Lay]", trace, where: str) -> None:
        """Record a replicated activation computed from parameters (not a parameter: those are
        TP325's at their module's door, or local_params'; not one whose gradient is summed)
        that meets a plain local shard (or partial sum) in an op the flow follows to a shard
        (or partial sum)."""
        kind = results[0].kind if results else None
        if kind not in ("S", "P") or not all(r.kind == kind and r.dt is False for r in results):
            return
        inputs = op.inputs
        met = [(n, v) for n, v in zip(inputs, values) if v.kind == kind and v.dt is False and v.src is not None]
        for node, value in zip(inputs, values) if met else ():
            if (value.kind == "R" and value.dt is False and trace.needs_grad[node] and node not in trace.params
                    and node not in self.marks and node not in op.outputs and math.prod(trace.shapes[node]) > 1):
                met_node, lay = met[0]
                producer, returned = summing_module(trace, node, op, self.producers, self.modules)
                self.shared_operands.append(SharedOperand(lay, op.name, where, producer, trace.shapes[met_node], returned))
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


def summing_module(trace, node: int, use, producers: dict, modules: "dict[str, nn.Module]") -> tuple[str | None, bool]:
    """(the module whose output's gradient to sum for replicated `node`, which op `use`
    reads, and whether that module returned `node` itself). Followed back from `node`
    through the ops that computed it from one tensor with a gradient, to the output of
    a module with parameters of its own (the
    router's `gate` under `top_scores = softmax(gate(x)).gather(...)`): summing there sums
    each rank's share of every gradient before it. Only while each tensor on the way has
    no other use that reaches the model's output, whose gradient would be summed with it
    (tp times too large); else the innermost module that returned `node` (or None)."""
    fallback = (producers.get(node), True)
    made_by, readers, live = _graph(trace)
    current, via = node, use
    while True:
        # (an op whose only output is the tensor itself, `x.to(its dtype)` or an in-place one, is no other use)
        if any(r is not via and any(o in live and o != current for o in r.outputs) for r in readers.get(current, ())):
            return fallback  # another use of it reaches the output: a sum there would count that one too
        owner = producers.get(current)
        module = modules.get(owner) if owner is not None else None
        if module is not None and any(p is not None for p in module._parameters.values()):
            return owner, current == node
        ops = made_by.get(current, [])
        graded = [i for i in ops[-1].inputs if trace.needs_grad[i] and i != current] if len(ops) == 1 else []
        if len(graded) != 1 or graded[0] in trace.params:
            return fallback  # computed from several tensors with gradients, in place, or a parameter itself
        current, via = graded[0], ops[-1]


def _graph(trace) -> tuple[dict, dict, set]:
    """{node: the ops that wrote it}, {node: the ops that read it}, the nodes the output's
    gradient reaches (_live); once per trace."""
    cached = getattr(trace, "_graph", None)
    if cached is None:
        from .trace import Op

        made_by: dict[int, list] = {}
        readers: dict[int, list] = {}
        for event in trace.events:
            if isinstance(event, Op):
                for node in event.outputs:
                    made_by.setdefault(node, []).append(event)
                for node in set(event.inputs):
                    readers.setdefault(node, []).append(event)
        cached = trace.__dict__["_graph"] = (made_by, readers, _live(trace, made_by))
    return cached


def _live(trace, made_by: dict) -> set:
    """The tensors the model output's gradient reaches, through the ops the trace saw (a
    module whose output no op made counts as computing it from all it was given)."""
    from .trace import Call, Return

    grad = trace.needs_grad
    edges = {node: {i for op in ops for i in op.inputs if grad[i]} for node, ops in made_by.items()}
    calls: list = []
    output: tuple = ()
    for event in trace.events:
        if isinstance(event, Call):
            calls.append(event)
        elif isinstance(event, Return):
            call = calls.pop()
            taken = {n for n in (*call.args, *call.kwargs.values()) if n is not None and grad[n]}
            for node in event.flat:
                if node not in made_by:
                    edges.setdefault(node, set()).update(taken)
            output = event.flat
    live, todo = set(), [n for n in output if grad[n]]
    while todo:
        node = todo.pop()
        if node not in live:
            live.add(node)
            todo.extend(edges.get(node, ()))
    return live
