"""What each rank of a DTensor's mesh holds of it: torch's own answer
(`compute_local_shape_and_global_offset`), asked for every coordinate of the mesh.
torch is imported only when it is called (core imports without torch)."""

from __future__ import annotations

import functools
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
    laid out by torch `placements` on a mesh of `mesh_shape`, without building it.
    Remembered per (shape, mesh, placements): torch cuts a packed shard (`_StridedShard`)
    with tensor ops, ~20 ms under fake tensors, and every layer asks it again (an MoE's
    48 gate_up_proj, each apply and report)."""
    return _shapes_on_mesh(tuple(global_shape), tuple(mesh_shape), tuple(placements))


@functools.lru_cache(maxsize=4096)
def _shapes_on_mesh(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[tuple[int, ...], ...]:
    # The public compute_local_shape_and_global_offset answers for this process's rank
    # only; it delegates to this one, which takes any coordinate.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return tuple(
        tuple(_compute_local_shape_and_global_offset(tuple(global_shape), mesh_shape, list(coord), list(placements), skip_offset=True)[0])
        for coord in itertools.product(*(range(extent) for extent in mesh_shape))
    )
