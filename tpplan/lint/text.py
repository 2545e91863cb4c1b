"""Pieces of messages shared by the rules: value, relation and fix, the way
torchtitan words its checks ("tp (3) must divide n_kv_heads (8) ...")."""

from __future__ import annotations

import math

from ..core.degrees import divisors_text
from ..core.globs import generalize  # noqa: F401  the rules import it from here
from ..core.local_shapes import shapes_on_mesh
from ..core.placements import PlacementSpec
from ..core.plan import Rule

# TP degrees worth listing: no real mesh axis goes beyond this.
MAX_DEGREE = 64


def degrees_that_work(*sizes: int) -> str:
    """'1, 2, 4, 8': the degrees up to MAX_DEGREE that divide every size."""
    return divisors_text(math.gcd(*sizes) if sizes else 1, MAX_DEGREE)


def rule_ref(rule: Rule) -> str:
    return f"rule '{rule.pattern}' at {rule.where}"


def styled(fqn: str, rule: Rule) -> str:
    """"colwise 'layers.0.attention.wq' (rule 'layers.*.attention.w{q,k,v}' at plan.yaml:7)"."""
    return f"{rule.spec.style} '{fqn or '<root>'}' ({rule_ref(rule)})"


def chunk_sizes(size: int, tp: int) -> list[int]:
    """What each rank holds of a dim of `size` split `tp` ways, as DTensor chunks it."""
    from torch.distributed.tensor import Shard

    return [shape[0] for shape in shapes_on_mesh((size,), (tp,), [Shard(0)])]


def chunks_text(size: int, tp: int) -> str:
    sizes = chunk_sizes(size, tp)
    if tp <= 8:
        return ", ".join(map(str, sizes))
    return f"{sizes[0]} on rank 0 ... {sizes[-1]} on rank {tp - 1}"


def shard_text(dim: int, ndim: int) -> str:
    """A shard of the last dim reads as torch's shard(-1), others by their index."""
    return str(PlacementSpec("shard", -1 if dim == ndim - 1 and ndim > 1 else dim))


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def article(word: str) -> str:
    """'an Attention', 'a Linear'."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
