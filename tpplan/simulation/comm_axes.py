"""Which mesh axis a collective runs over: the process group it was issued on,
named by the device mesh's dims, so that one step's TP traffic (inside a node) and
its data-parallel traffic (across nodes) are counted apart (SPEC §7 `comms_by_axis`).

A collective names its group in its arguments: functional collectives (DTensor's) by
the group's name, c10d ops (FSDP2's coalesced all-gather and reduce-scatter, HSDP's
all-reduce) by the ProcessGroup object itself. Each dim of the mesh has one group per
slice, and every mesh FSDP2 or DTensor derives from it (a submesh, FSDP2's mesh joined
with TP's) reuses those groups; a group that is no dim's (none was seen) is named by
the axes its ranks span.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# An axis name for a collective's group: what `counting` files it under.
AxisOf = Callable[[tuple], str]
UNKNOWN = "group"  # no group in the arguments (none of torch's collectives today)


def group_name(args: tuple) -> str | None:
    """The name of the process group a collective's arguments name, or None."""
    import torch
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg).group_name
    # functional collectives take (tensor(s), [reduce op,] group name[, ...]): the name is
    # the last string that names a registered group (a reduce op is a string too)
    for arg in reversed(args):
        if isinstance(arg, str) and _registered(arg):
            return arg
    return None


def _registered(name: str) -> bool:
    from torch.distributed.distributed_c10d import _world

    return name in _world.pg_names.values()


def mesh_axes(mesh: "DeviceMesh") -> AxisOf:
    """`axis(args)`: the dim of `mesh` whose group a collective ran on (its name, e.g.
    "tp", "dp_shard"); for a group that is no dim's, the dims its ranks span joined by
    "+" (e.g. "dp_replicate+dp_shard" for a flattened data-parallel group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    by_group = {mesh.get_group(dim).group_name: name for dim, name in enumerate(names)}
    coordinates = {}  # global rank -> its coordinate on the mesh
    layout = mesh.mesh.tolist()
    for coordinate in itertools.product(*(range(size) for size in mesh.shape)):
        held: Any = layout
        for index in coordinate:
            held = held[index]
        coordinates[int(held)] = coordinate

    def spanned(group: str) -> str:
        ranks = dist.get_process_group_ranks(_resolve_process_group(group))
        varying = [name for dim, name in enumerate(names) if len({coordinates[r][dim] for r in ranks if r in coordinates}) > 1]
        return "+".join(varying) or f"{UNKNOWN} of {len(ranks)}"

    def axis(args: tuple) -> str:
        group = group_name(args)
        if group is None:
            return UNKNOWN
        if group not in by_group:
            by_group[group] = spanned(group)
        return by_group[group]

    return axis
