"""What each rank of the TP mesh holds of each parameter (shapes as torch chunks
shards, placements in the plan's spelling)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.placements import placements_text
from .report import ParamLayout

if TYPE_CHECKING:
    import torch
    from torch import nn


def local_shapes(param: "torch.Tensor", tp: int) -> tuple[tuple[int, ...], ...]:
    """What each rank of the (1-D) TP mesh holds of `param`, as torch chunks shards."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return (tuple(param.shape),) * tp
    if param.device_mesh.ndim != 1:
        raise AssertionError("plans shard over one mesh axis; parameters live on the 1-D TP mesh")
    size = param.device_mesh.size()
    shapes = []
    for rank in range(size):
        shape = list(param.shape)
        for placement in param.placements:
            if isinstance(placement, Shard):
                dim = placement.dim % len(shape)
                shape[dim] = Shard.local_shard_size_and_offset(shape[dim], size, rank)[0]
        shapes.append(tuple(shape))
    return tuple(shapes)



def param_layouts(model: "nn.Module", tp: int) -> list[ParamLayout]:
    from torch.distributed.tensor import DTensor

    layouts = []
    for name, param in model.named_parameters():
        placements = placements_text(param.placements) if isinstance(param, DTensor) else "-"
        layouts.append(ParamLayout(
            name=name,
            dtype=str(param.dtype).removeprefix("torch."),
            global_shape=tuple(param.shape),
            local_shapes=local_shapes(param, tp),
            placements=placements,
            element_size=param.element_size(),
        ))
    return layouts

