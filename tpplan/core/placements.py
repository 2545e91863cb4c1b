"""The placement grammar of plan files, without importing torch.

`replicate`, `shard(D)` (D may be negative), `packed_shard(D, N)` (dim D holds N
equal blocks, e.g. a fused gate/up projection, and each block is sharded, so every
rank holds matching slices of all N: torch's `_StridedShard(D, split_factor=N)`),
`partial` or `partial(sum|avg|max|min)`, case-insensitive. Parsed into `PlacementSpec`, turned into torch placements only
when a plan is compiled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

REDUCE_OPS = ("sum", "avg", "max", "min")
GRAMMAR = "replicate, shard(DIM), partial or partial(sum|avg|max|min)"
PACKED_GRAMMAR = "packed_shard(DIM, BLOCKS)"  # parameters only (expert_tp and local_params 'params')


def _anycase(word: str) -> str:
    # JSON Schema regexes have no case-insensitive flag.
    return "".join(f"[{c.upper()}{c}]" for c in word)


# ASCII only, spelled out: `\s` and `\d` mean more in Python (Unicode digits and
# spaces) than in the ECMA-262 regexes of JSON Schema, and the schema must accept
# exactly what parse_placement accepts.
_SPACE = r"[ \t\n\r\f\v]"
_WHITESPACE = " \t\n\r\f\v"

# For the JSON Schema, so that editors flag a bad placement as it is typed.
PATTERN = (
    rf"^{_SPACE}*({_anycase('replicate')}|{_anycase('shard')}\({_SPACE}*-?[0-9]+{_SPACE}*\)"
    rf"|{_anycase('packed_shard')}\({_SPACE}*-?[0-9]+{_SPACE}*,{_SPACE}*0*[1-9][0-9]*{_SPACE}*\)"  # >= 1 block
    rf"|{_anycase('partial')}(\({_SPACE}*({'|'.join(map(_anycase, REDUCE_OPS))}){_SPACE}*\))?){_SPACE}*$"
)

def _number(value: int) -> str:
    """Any spelling of the integer `value` the grammar reads: leading zeros, -0."""
    if value == 0:
        return "-?0+"
    return f"{'-' if value < 0 else ''}0*{abs(value)}"


def placement_pattern(placement: PlacementSpec) -> str:
    """A JSON Schema regex for every spelling `parse_placement` reads as `placement`
    (any case, blanks, leading zeros; a shard also as packed_shard(D, 1))."""
    body = {"replicate": _anycase("replicate")}.get(placement.kind)
    if placement.kind == "shard":
        dim = rf"{_SPACE}*{_number(placement.dim)}{_SPACE}*"
        packed = rf"{_anycase('packed_shard')}\({dim},{_SPACE}*{_number(placement.blocks)}{_SPACE}*\)"
        body = packed if placement.blocks > 1 else rf"{_anycase('shard')}\({dim}\)|{packed}"
    elif placement.kind == "partial":
        op = rf"\({_SPACE}*{_anycase(placement.reduce_op)}{_SPACE}*\)"
        body = _anycase("partial") + (f"({op})?" if placement.reduce_op == "sum" else op)
    return rf"^{_SPACE}*({body}){_SPACE}*$"


_SHARD = re.compile(rf"shard\({_SPACE}*(-?[0-9]+){_SPACE}*\)")
_PACKED = re.compile(rf"packed_shard\({_SPACE}*(-?[0-9]+){_SPACE}*,{_SPACE}*([0-9]+){_SPACE}*\)")
_PARTIAL = re.compile(rf"partial(?:\({_SPACE}*([a-z0-9_]+){_SPACE}*\))?")


@dataclass(frozen=True)
class PlacementSpec:
    kind: Literal["replicate", "shard", "partial"]
    dim: int | None = None
    reduce_op: str = "sum"
    blocks: int = 1  # shard only: > 1 for packed_shard(dim, blocks)

    def __str__(self) -> str:
        if self.kind == "shard" and self.blocks > 1:
            return f"packed_shard({self.dim}, {self.blocks})"
        if self.kind == "shard":
            return f"shard({self.dim})"
        if self.kind == "partial" and self.reduce_op != "sum":
            return f"partial({self.reduce_op})"
        return self.kind

    def to_torch(self):
        from torch.distributed.tensor import Partial, Replicate, Shard

        if self.kind == "shard" and self.blocks > 1:
            from torch.distributed.tensor.placement_types import _StridedShard

            return _StridedShard(self.dim, split_factor=self.blocks)
        if self.kind == "shard":
            return Shard(self.dim)
        if self.kind == "partial":
            return Partial(self.reduce_op)
        return Replicate()


def parse_placement(value: object) -> PlacementSpec:
    """Parse one placement; raises ValueError with the grammar on bad input."""
    if isinstance(value, PlacementSpec):
        return value
    if not isinstance(value, str):
        raise ValueError(f"a placement is a string ({GRAMMAR}), not {type(value).__name__} {value!r}")
    # isascii: str.lower() would turn e.g. the Kelvin sign into 'k'
    text = value.strip(_WHITESPACE).lower() if value.isascii() else ""
    if text == "replicate":
        return PlacementSpec("replicate")
    if m := _SHARD.fullmatch(text):
        return PlacementSpec("shard", int(m.group(1)))
    if m := _PACKED.fullmatch(text):
        if int(m.group(2)) < 1:
            raise ValueError(f"packed_shard needs at least 1 block, not {m.group(2)} in {value!r}")
        return PlacementSpec("shard", int(m.group(1)), blocks=int(m.group(2)))
    if m := _PARTIAL.fullmatch(text):
        op = m.group(1) or "sum"
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r} in {value!r}: use one of {', '.join(REDUCE_OPS)}")
        return PlacementSpec("partial", reduce_op=op)
    if text.startswith("packed_shard"):
        raise ValueError(f"{value!r} is not a placement: write {PACKED_GRAMMAR}, e.g. packed_shard(1, 2) for a fused [gate; up] dim")
    raise ValueError(f"{value!r} is not a placement: use {GRAMMAR}")


def placement_text(placement: object) -> str:
    """A placement in the plan's own spelling (shard(0), replicate, partial(max)):
    a `PlacementSpec`, or a torch placement read through its `is_shard()` /
    `is_replicate()` / `is_partial()` methods (this module never imports torch)."""
    if isinstance(placement, PlacementSpec):
        return str(placement)
    if getattr(placement, "split_factor", 1) > 1:  # torch's _StridedShard: a packed shard
        return str(PlacementSpec("shard", placement.dim, blocks=placement.split_factor))  # type: ignore[attr-defined]
    if placement.is_shard():  # type: ignore[attr-defined]
        return str(PlacementSpec("shard", placement.dim))  # type: ignore[attr-defined]
    if placement.is_replicate():  # type: ignore[attr-defined]
        return str(PlacementSpec("replicate"))
    if placement.is_partial():  # type: ignore[attr-defined]
        return str(PlacementSpec("partial", reduce_op=str(placement.reduce_op)))  # type: ignore[attr-defined]
    return str(placement)


def placements_text(placements: object) -> str:
    """Several placements (a DTensor's, one per mesh dim), comma separated."""
    return ", ".join(map(placement_text, placements))  # type: ignore[call-overload]
