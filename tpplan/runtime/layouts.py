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
    """What each rank of the TP mesh holds of `param`, as torch chunks shards. A parameter
    may live on a 2-D view of the TP mesh (replicated KV heads: (heads, replicas)), whose
    ranks in order are the TP mesh's; a packed shard (`_StridedShard`) chunks each block."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return (tuple(param.shape),) * tp
    mesh_shape = tuple(param.device_mesh.mesh.shape)
    shapes = []
    for rank in range(param.device_mesh.size()):
        shape = list(param.shape)
        coords, rest = [], rank
        for extent in reversed(mesh_shape):
            coords.append(rest % extent)
            rest //= extent
        coords.reverse()
        for placement, extent, coord in zip(param.placements, mesh_shape, coords):
            if isinstance(placement, _StridedShard):
                dim = placement.dim % len(shape)
                block = shape[dim] // placement.split_factor
                shape[dim] = placement.split_factor * Shard.local_shard_size_and_offset(block, extent, coord)[0]
            elif isinstance(placement, Shard):
                dim = placement.dim % len(shape)
                shape[dim] = Shard.local_shard_size_and_offset(shape[dim], extent, coord)[0]
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

