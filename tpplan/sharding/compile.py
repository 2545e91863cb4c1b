"""Turn a style spec from a plan into a fresh torch ParallelStyle object: the class
its style table entry names (core/style_table.py), called with the spec's options."""

from __future__ import annotations

from typing import Any

from ..core.placements import PlacementSpec
from ..core.style_table import StyleSpec
from .styles import ParallelStyle, resolve


def _to_torch(value: Any) -> Any:
    if isinstance(value, PlacementSpec):
        return value.to_torch()
    if isinstance(value, list):  # torch takes layout sequences as tuples
        return tuple(_to_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    return value


def compile_style(spec: StyleSpec, src_data_rank: int | None = 0) -> ParallelStyle:
    """A new style object for one module: styles hold per-module state, so never share one."""
    options = {name: _to_torch(value) for name, value in spec.torch_options().items()}
    style = resolve(spec.torch_class())(**options)
    style.src_data_rank = src_data_rank
    return style
