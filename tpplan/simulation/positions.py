"""The ranks of a simulated mesh, and which of them a dry run must simulate: one
rank per distinct position (SPEC §7), the others equal to it by construction.

A rank's step depends on its coordinate only through the shapes it holds: every rank
runs the same program (the model, the plan, FSDP2) on the same batch shape, and the
fake process group makes every collective a no-op, so two ranks whose tensors all have
the same shapes allocate, free and communicate the same bytes in the same order. Which
shapes depend on the coordinate:

- each parameter's local shard (`layouts`: after the TP rules and FSDP2, as torch cuts
  it at that coordinate, uneven shards included): the optimizer state follows it;
- each parameter as FSDP2 all-gathers it for the forward and backward (its TP shard
  alone): the activations a sharded weight makes (a vocabulary-sharded head's logits)
  and the unsharded gradients follow it, and it differs along tp where dp_shard's
  shard does not (251 rows: tp ranks hold 126 and 125, each cut in 63 and 63 or 62);
- the rank's chunk of the sequence on tp (sequence parallelism shards activations on
  the sequence dim, so an uneven chunk gives uneven activations);
- its index on cp: context parallelism's ring attention runs a different program on
  each cp rank (the chunks it holds, which of the ring's steps are causal-masked), so
  every cp index is its own position.

Hence the positions: dp_replicate ranks hold exactly what replica 0 holds (HSDP
replicates, it never shards on that axis), and along dp_shard and tp ranks differ only
where a dim does not divide evenly. Ranks whose shapes are all equal are one position,
simulated once at its lowest rank; tests/test_dry_world.py checks against simulating
every rank that the positions give exactly the same memory and collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshDims:
    """A device mesh's dims, outermost first, the TP axis last (core/axes.py's `mesh_dims`)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def tp(self) -> int:
        return self.shape[-1]

    @property
    def dp(self) -> int:
        """The data-parallel ranks (every dim but TP's)."""
        return math.prod(self.shape[:-1])

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.shape))

    def position(self, rank: int) -> dict[str, int]:
        """{dim: index} of a global rank (row-major, as init_device_mesh lays ranks out)."""
        found, rest = {}, rank
        for name, size in reversed(list(zip(self.names, self.shape))):
            rest, found[name] = divmod(rest, size)
        return {name: found[name] for name in self.names}

    def build(self, device_type: str = "cpu") -> "DeviceMesh":
        """The mesh over this (simulated) world; outside fake mode, as every mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)


@dataclass(frozen=True)
class Layout:
    """One parameter as the simulated rank holds it: its global shape cut by
    `placements` over a mesh of `mesh_shape` whose dims are named `dims` and whose
    global ranks are `ranks` (row-major); a plain tensor has no dims. The mesh may be
    a view of the world's dims under names of its own (a plan's (kv_heads, kv_replicas)
    view of tp): where another rank stands on it is read from the ranks, not the names."""

    global_shape: tuple[int, ...]
    dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple
    ranks: tuple[int, ...]

    def shapes(self, gathered: bool) -> tuple[tuple[int, ...], ...]:
        """The shape at each coordinate of the mesh (row-major); `gathered`: once FSDP2
        all-gathers it over the data dims (what the forward and backward compute with)."""
        from torch.distributed.tensor import Replicate

        from ..core.local_shapes import shapes_on_mesh
        from ..sharding.data_parallel import FSDP_DIMS

        placements = self.placements
        if gathered:
            placements = tuple(Replicate() if name in FSDP_DIMS else p for name, p in zip(self.dims, placements))
        return shapes_on_mesh(self.global_shape, self.mesh_shape, placements)


def layouts(model: "nn.Module") -> tuple[Layout, ...]:
    """Every parameter's layout, as the plan and FSDP2 left it (fake tensors welcome:
    the mesh's ranks are read with fake mode suspended, as every mesh is built)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor

    found = []
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            with unset_fake_temporarily():
                ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
            found.append(Layout(tuple(param.shape), tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape), tuple(param.placements), ranks))
        else:
            found.append(Layout(tuple(param.shape), (), (), (), ()))
    return tuple(found)


@dataclass(frozen=True)
class Position:
    """One distinct position: the rank simulated for it (the lowest), and every global rank it stands for."""

    rank: int
    ranks: tuple[int, ...]


def distinct_positions(dims: MeshDims, found: Sequence[Layout], seq: int, tp_axis: str) -> list[Position]:
    """The world's ranks grouped by what they hold (module docstring), in rank order.
    `found`: the layouts simulated on one rank, whose meshes hold its groups; any other
    rank holds what the rank of those meshes at its own index on the axes they span holds."""
    held = [_held_by_position(dims, layout) for layout in dict.fromkeys(found) if layout.dims]
    chunks = _chunks(seq, dims.sizes.get(tp_axis, 1)) if seq else None
    groups: dict[Any, list[int]] = {}
    for rank in range(dims.world):
        position = dims.position(rank)
        # a cp rank runs its own part of torch's ring (which chunks it holds, which steps it masks)
        key = (chunks[position.get(tp_axis, 0)] if chunks else 0, position.get("cp", 0), *(shapes[tuple(position[a] for a in spanned)] for spanned, shapes in held))
        groups.setdefault(key, []).append(rank)
    return [Position(ranks[0], tuple(ranks)) for ranks in groups.values()]


def _held_by_position(dims: MeshDims, layout: Layout) -> tuple[tuple[str, ...], dict[tuple[int, ...], tuple]]:
    """The world axes `layout`'s mesh spans, and {indices on them: (shard shape, gathered shape)}."""
    where = [dims.position(rank) for rank in layout.ranks]
    spanned = tuple(axis for axis in dims.names if len({p[axis] for p in where}) > 1)
    shards, gathered = layout.shapes(False), layout.shapes(True)
    return spanned, {tuple(p[a] for a in spanned): (shards[i], gathered[i]) for i, p in enumerate(where)}


def ring_ranks(dims: MeshDims) -> list[int]:
    """The ranks known to stand for positions before any rank is simulated: each cp
    index's lowest (its other coordinates 0), as the ring runs a program of its own on
    every cp index. What else tells ranks apart is read from a simulated rank's layouts."""
    if dims.sizes.get("cp", 1) == 1:
        return []
    stride = math.prod(dims.shape[dims.names.index("cp") + 1:])
    return [index * stride for index in range(1, dims.sizes["cp"])]


def every_rank(dims: MeshDims) -> list[Position]:
    """Each rank its own position: what `distinct_positions` is checked against."""
    return [Position(rank, (rank,)) for rank in range(dims.world)]


def _chunks(size: int, parts: int) -> list[int]:
    """torch.chunk's sizes of `size` elements in `parts` (trailing empty chunks included)."""
    step = -(-size // parts)
    return [max(0, min(step, size - i * step)) for i in range(parts)]


def ranks_text(ranks: Sequence[int]) -> str:
    """0-3, 8-11: runs of consecutive ranks."""
    runs: list[tuple[int, int]] = []
    for rank in ranks:
        if runs and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
