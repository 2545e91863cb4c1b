"""An attention module's head counts and head size, read from the module and its
`config` (transformers): the one reader behind the lint's head checks (TP311,
lint/facts.py) and `{style: colwise, heads: auto}` (sharding/kv_heads.py), so the
lint approves exactly the modules the style can plan.

Models name these facts differently (torchtitan `n_heads`/`n_kv_heads`,
transformers `num_attention_heads`/`num_key_value_heads`, GPT-2 `n_head`,
ChatGLM `multi_query_group_num`); the tables below list every spelling read, in
order of preference. Plain attribute reads: no torch needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HEAD_ATTRS", "HEAD_DIM_ATTRS", "HIDDEN_ATTRS", "KV_HEAD_ATTRS", "HeadCounts", "head_counts", "head_dim_of", "is_kv_count"]

HEAD_ATTRS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
KV_HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "multi_query_group_num")
HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size")
HIDDEN_ATTRS = ("dim", "hidden_size", "n_embd", "embed_dim", "d_model")


@dataclass(frozen=True)
class HeadCounts:
    counts: tuple  # ((attribute, value), ...): the query heads, then the KV heads, those found
    head_dim: int | None  # None: neither given nor derivable (hidden size / query heads)

    @property
    def query(self) -> int | None:
        """The query-head count, where one is given."""
        return next((count for name, count in self.counts if not is_kv_count(name)), None)

    @property
    def kv(self) -> int | None:
        """The KV-head count, where one is given."""
        return next((count for name, count in self.counts if is_kv_count(name)), None)


def is_kv_count(name: str) -> bool:
    """Whether the attribute `name` (one of the tables above) counts KV heads."""
    return name in KV_HEAD_ATTRS


def _int_attr(holder: Any, names: tuple) -> tuple[str, int] | None:
    """The first of `names` that `holder` (an object or a dict) has as a positive int."""
    for name in names:
        try:
            value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
        except (AttributeError, RuntimeError):
            # transformers' heterogeneous configs refuse a global value for a per-layer attribute
            # (AmbiguousGlobalPerLayerAttributeError, a RuntimeError): not given for the whole model
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def head_counts(module: Any) -> HeadCounts | None:
    """The head counts `module` gives: on itself, else on its `config` (the first of the
    two that names any count); None when neither does. The head size: the same holder's
    head_dim, else the module's own (the attention's `self.head_dim` beside a config's
    counts), else the holder's hidden size over its query heads when that divides."""
    own_dim = _int_attr(module, HEAD_DIM_ATTRS)
    for holder in (module, getattr(module, "config", None)):
        if holder is None:
            continue
        counts = tuple(found for found in (_int_attr(holder, HEAD_ATTRS), _int_attr(holder, KV_HEAD_ATTRS)) if found)
        if not counts:
            continue
        head_dim = _int_attr(holder, HEAD_DIM_ATTRS) or own_dim
        if head_dim is not None:
            return HeadCounts(counts, head_dim[1])
        query, hidden = _int_attr(holder, HEAD_ATTRS), _int_attr(holder, HIDDEN_ATTRS)
        derived = query is not None and hidden is not None and hidden[1] % query[1] == 0
        return HeadCounts(counts, hidden[1] // query[1] if derived else None)
    return None


def head_dim_of(module: Any) -> int | None:
    """The head size of `module` (head_counts'), or its own head_dim attribute where it names
    no head count (an attention that keeps only its head size)."""
    found = head_counts(module)
    if found is not None:
        return found.head_dim
    own = _int_attr(module, HEAD_DIM_ATTRS)
    return own[1] if own else None
