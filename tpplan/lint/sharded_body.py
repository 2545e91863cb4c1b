"""Inside an experts module whose style returns a partial sum: what its body does to it.

expert_tp (and expert_parallel's all_gather dispatch) run the module's own forward on
each rank's slices of its parameters and reduce its output as a partial sum only when
the module returns (core/expert_styles.py: the output port's src is partial). The
layout flow (flow.py) leaves the body to the style, but the style is only right where
everything between the second projection and the return is linear in that partial
sum: the routing weights' product, the scatter of each token's rows, the sum over its
experts. A norm (Ergo's per-expert `post_expert_norm`) or another nonlinear op there
computes on each rank's share: the sum of the ranks' results is not the result.

This follows the body just far enough to see that: values computed from a sharded
parameter carry its split intermediate dim; a contraction of two of them (the second
projection of the first's output) makes a partial sum, followed through the ops linear
in it (partial.py). A known nonlinear op on it is a `Leak` (TP321); anything else not
linear in it ends the watch silently (the style's business, as before: no TP328).
"""

from __future__ import annotations

from .layouts import REPLICATED, Lay, Leak, Source
from .partial import PartialSums
from .trace import Op

# Products that contract their operands' last/inner dims: of two values both carrying the
# split intermediate dim, each rank's result is its share of the sum
CONTRACTIONS = frozenset({"matmul", "mm", "bmm", "einsum", "linear", "grouped_mm", "_grouped_mm", "baddbmm", "addmm", "addbmm"})
# Ops whose result of a sum is not the sum of their results: a partial sum must not reach them
NONLINEAR = frozenset("""
rms_norm layer_norm group_norm batch_norm instance_norm normalize norm softmax log_softmax pow square sqrt rsqrt exp log
sigmoid silu gelu relu tanh softplus
""".split())


class PartialBody:
    """Watches the ops of one module run by a style that reduces its partial output."""

    def __init__(self, fqn: str, rule, sharded: set[int], partials: PartialSums, shape):
        self.src = Source(fqn, rule)
        self.fqn = fqn
        self.inner = [fqn]  # the modules running inside it, innermost last
        self.split = set(sharded)  # nodes carrying a split intermediate dim: the sharded parameters and what they make
        self.partial: dict[int, Lay] = {}
        self.partials = partials
        self.shape = shape
        self.leak: Leak | None = None  # the first partial sum that reaches a nonlinear op (one per module)

    def enter(self, fqn: str) -> None:
        self.inner.append(fqn)

    def leave(self) -> None:
        self.inner.pop()

    def op(self, op: Op) -> None:
        if self.leak is not None:
            return
        split = [n for n in op.inputs if n in self.split]
        if any(n in self.partial for n in op.inputs):
            if split:
                return  # a partial sum meeting a split value: not followed
            values = [self.partial.get(n, REPLICATED) for n in op.inputs]
            outs = self.partials.layouts(op, values, len(op.outputs))
            if outs is not None:
                self.partial.update((node, lay) for node, lay in zip(op.outputs, outs) if lay.kind == "P")
            elif op.name in NONLINEAR:
                first = next(n for n in op.inputs if n in self.partial)
                self.leak = Leak(self.partial[first], "partial", self.inner[-1], op.name, self.shape(first))
            return
        if op.name in CONTRACTIONS and len(split) >= 2:
            self.partial.update((node, Lay("P", False, None, self.src)) for node in op.outputs)
        elif split:
            self.split.update(op.outputs)
