"""Turn a style spec from a plan into a fresh torch ParallelStyle object."""

from __future__ import annotations

from typing import Any

from ..core.placements import PlacementSpec
from ..core.schema import StyleSpec
from .experts import ExpertParallel, ExpertTensorParallel
from .kv_heads import HeadsColwiseParallel
from .params import LocalParams
from .styles import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

STYLE_CLASSES: dict[str, type[ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
    "prepare_module_input": PrepareModuleInput,
    "prepare_module_output": PrepareModuleOutput,
    "prepare_module_input_output": PrepareModuleInputOutput,
    "no_parallel": NoParallel,
    "expert_tp": ExpertTensorParallel,
    "expert_parallel": ExpertParallel,
    "local_params": LocalParams,
}


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
    options = {name: _to_torch(getattr(spec, name)) for name in type(spec).model_fields if name != "style"}
    if spec.style == "colwise":
        heads = options.pop("heads")
        if heads is not None:  # whole heads, replicated above their count
            options.pop("output_layouts")
            style = HeadsColwiseParallel(heads=None if heads == "auto" else heads, **options)
            style.src_data_rank = src_data_rank
            return style
    style = STYLE_CLASSES[spec.style](**options)
    style.src_data_rank = src_data_rank
    return style
