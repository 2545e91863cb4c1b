"""What tensor ops do to a partial sum: the layout flow's (flow.py) typing of `P`.

Each rank holds its share of a sum (a rowwise output with `output_layouts: partial`, a
MoE's experts sharded on their hidden dim). The ops linear in it keep it one: the ranks'
results add up to the op of the sum. `P + P`, `P * R`, `R @ P`, `P / R`, views,
indexing, sums, a cat of partial sums, and a scatter into zeros (`torch.zeros`, then
`z[index] = P`: the rest stays 0 on every rank). A replicated factor is fine in forward,
but its gradient is partial then (grad_sums.py follows that). Anything else (`P + R`
adds R tp times, `P * P`, a nonlinear op, a partial sum meeting a shard) is not
modelled: the flow stops there (TP328).
"""

from __future__ import annotations

from .layouts import Lay
from .ops import CATS, EXPANDS, SPLITS, VIEWS, _arg
from .trace import TENSOR, Op

# Ops of one tensor (the others replicated indices at most) linear in it. Reductions
# that sum are too (`PartialSums.layouts`); max, norm and the like are not.
_LINEAR = VIEWS | EXPANDS | SPLITS | frozenset("""
neg negative to float half bfloat16 double type_as contiguous clone getitem gather index_select take_along_dim
transpose swapaxes swapdims t T mT permute movedim repeat repeat_interleave flip roll narrow select
""".split())
# A product with one partial factor and replicated others is the partial sum of the products.
_FACTOR = frozenset({"mul", "matmul", "bmm", "mm", "einsum"})


class PartialSums:
    def __init__(self) -> None:
        self.zeros: set[int] = set()  # nodes holding zeros only: torch.zeros, not touched by any op yet

    def seen(self, op: Op) -> None:
        """After the flow interpreted `op`. A zeros tensor counts as zeros only until the first
        op that touches it: trusting it after a view of it (written through) would not be sound."""
        self.zeros.difference_update((*op.inputs, *op.outputs))
        if op.name == "zeros":
            self.zeros.update(op.outputs)

    def layouts(self, op: Op, values: list[Lay], count: int) -> "list[Lay] | None":
        """The layouts of the `count` outputs of `op` on plain inputs, some of them partial
        sums (the others replicated); None when not modelled."""
        name, first = op.name, values[0]
        parts = [i for i, v in enumerate(values) if v.kind == "P"]
        if any(v.kind not in ("R", "P") for v in values):
            return None  # a partial sum meeting a shard
        lay = values[parts[0]]
        if name in ("add", "sub") or name in CATS:
            return [lay] * count if len(parts) == len(values) else None  # P + P; cat of partial sums
        if name == "setitem":  # x[index] = P: into a partial sum, or into zeros
            into = first.kind == "P" or op.inputs[0] in self.zeros
            written = _arg(op, 2, "value") == TENSOR and parts[-1] == len(values) - 1  # the value written is the P
            return [lay] * count if into and written and set(parts) <= {0, len(values) - 1} else None
        if len(parts) != 1:
            return None  # P * P, P @ P: not the product of the sums
        if name in _FACTOR:
            return [lay] * count
        if name in ("div", "truediv"):
            return [lay] * count if parts == [0] else None  # P / R; R / P is not
        if parts != [0]:
            return None
        if name == "masked_fill":
            return [lay] * count if _arg(op, 2, "value") == 0 else None
        if name in _LINEAR or (name in ("sum", "mean", "nansum") and len(op.inputs) == 1):
            return [lay] * count
        return None
