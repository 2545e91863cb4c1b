"""What each rank of the TP mesh holds of each parameter (shapes as torch chunks
shards, placements in the plan's spelling)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.local_shapes import local_shapes as mesh_local_shapes
from ..core.placements import placements_text

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: its full shape and what each TP rank holds of it."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    local_shapes: tuple[tuple[int, ...], ...]  # one per TP rank
    placements: str  # in the plan's spelling: "shard(0)", "replicate"; "-" for a plain (unsharded) tensor
    element_size: int

    @property
    def global_bytes(self) -> int:
        return math.prod(self.global_shape) * self.element_size

    def rank_bytes(self, rank: int) -> int:
        return math.prod(self.local_shapes[rank]) * self.element_size

    @property
    def uneven(self) -> bool:
        return len(set(self.local_shapes)) > 1

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "local_shapes": [list(s) for s in self.local_shapes],
            "placements": self.placements,
        }


def local_shapes(param: "torch.Tensor", tp: int) -> tuple[tuple[int, ...], ...]:
    """What each rank of the TP mesh holds of `param`: a plain tensor whole on each of
    the `tp` ranks; a DTensor as torch cuts it (its mesh may be a 2-D view of the TP
    mesh, (heads, replicas) for replicated KV heads, whose ranks in order are the TP mesh's;
    or a version 2 plan's ep dim, its experts)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (tuple(param.shape),) * tp
    shapes = mesh_local_shapes(param)
    if param.device_mesh.mesh_dim_names == ("ep",):
        # Experts on their own ep axis (sharding/expert_mesh.py), which is the fastest dim of
        # the expert view: world rank t, the t-th rank of the first TP group, is ep rank t % ep.
        return tuple(shapes[t % len(shapes)] for t in range(tp))
    return shapes


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

