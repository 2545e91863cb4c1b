"""What each rank of a DTensor's mesh holds of it: torch's own answer
(`compute_local_shape_and_global_offset`), asked for every coordinate of the mesh.
torch is imported only when it is called (core imports without torch)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def local_shapes(t: "torch.Tensor") -> tuple[tuple[int, ...], ...]:
    """The local shape of `t` on each rank of its mesh, in rank order (the mesh's
    coordinates row-major: a 2-D view (heads, replicas) of a TP mesh lists the TP
    ranks in order); a plain tensor is one entry, its own shape. Uneven shards and
    packed shards (`_StridedShard`) are cut as torch cuts them."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (tuple(t.shape),)
    # .shape, not .mesh: a submesh computes that tensor with nonzero, which fake tensors cannot
    return shapes_on_mesh(tuple(t.shape), tuple(t.device_mesh.shape), t.placements)


def shapes_on_mesh(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements) -> tuple[tuple[int, ...], ...]:
    """The local shape on each rank (row-major coordinates) of a tensor of `global_shape`
    laid out by torch `placements` on a mesh of `mesh_shape`, without building it."""
    # The public compute_local_shape_and_global_offset answers for this process's rank
    # only; it delegates to this one, which takes any coordinate.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return tuple(
        tuple(_compute_local_shape_and_global_offset(tuple(global_shape), mesh_shape, list(coord), placements, skip_offset=True)[0])
        for coord in itertools.product(*(range(extent) for extent in mesh_shape))
    )
