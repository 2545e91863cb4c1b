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
    # torch's _compute_local_shape_and_global_offset (the public compute_local_shape_and_global_offset
    # answers for this process's rank only) cuts left to right over the mesh dims, each cut by the
    # placement's own _local_shard_size_and_offset; asked per coordinate it redoes every cut, and a
    # packed shard's cut is linear in the dim's chunks: FSDP over dp_shard 2048 x tp 8 asked it 16384
    # times for minutes. The same loop here, each placement's cut asked once per (size, chunks, index).
    cuts = [(mesh_dim, placement) for mesh_dim, placement in enumerate(placements) if hasattr(placement, "dim")]
    shapes = []
    for coord in itertools.product(*(range(extent) for extent in mesh_shape)):
        shape = list(global_shape)
        for mesh_dim, placement in cuts:
            shape[placement.dim] = _cut(placement, shape[placement.dim], mesh_shape[mesh_dim], coord[mesh_dim])
        shapes.append(tuple(shape))
    return tuple(shapes)


@functools.lru_cache(maxsize=None)
def _cut(placement, size: int, chunks: int, index: int) -> int:
    """What `placement` leaves of a dim of `size` on the `index`th of `chunks` ranks: torch's own
    answer (a packed shard's, `_StridedShard`, from its one split of the dim into every rank's share:
    asked rank by rank, torch splits the whole dim again for each)."""
    from torch.distributed.tensor._utils import _StridedShard

    if isinstance(placement, _StridedShard):
        return _strided_sizes(placement, size, chunks)[index]
    return placement._local_shard_size_and_offset(curr_local_size=size, num_chunks=chunks, rank=index)[0]


@functools.lru_cache(maxsize=None)
def _strided_sizes(placement, size: int, chunks: int) -> tuple[int, ...]:
    import torch

    indices = torch.arange(size).view([1] * placement.dim + [size])
    shards, _ = placement._split_tensor(indices, chunks, with_padding=False, contiguous=False)
    return tuple(shard.size(placement.dim) for shard in shards)
