"""Which mesh axis a collective runs over: the process group it was issued on,
named by the device mesh's dims, so that one step's TP traffic (inside a node) and
its data-parallel traffic (across nodes) are counted apart (SPEC §7 `comms_by_axis`).

A collective names its group in its arguments: functional collectives (DTensor's) by
the group's name, c10d ops (FSDP2's coalesced all-gather and reduce-scatter, HSDP's
all-reduce) by the ProcessGroup object itself. Each dim of the mesh has one group per
slice, and every mesh FSDP2 or DTensor derives from it (a submesh, FSDP2's mesh joined
with TP's) reuses those groups; a group that is no dim's (none was seen) is named by
the axes its ranks span. `counting` files each collective of a body under (axis, op)
with its bytes: what the memory plan and the CP simulation report.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
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


def mesh_axes(mesh: "DeviceMesh", plan: Any = None) -> AxisOf:
    """`axis(args)`: the dim of `mesh` whose group a collective ran on (its name, e.g.
    "tp", "dp_shard"), or of the plan's expert view ("ep", "efsdp": its ranks borrowed
    from the mesh's, its groups its own; built here, outside fake mode, and found again
    when the experts are applied); for a group that is no dim's, the dims its ranks
    span joined by "+" (e.g. "dp_replicate+dp_shard" for a flattened data-parallel group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..sharding.expert_mesh import expert_view

    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    view = expert_view(plan, mesh) if plan is not None and plan.version == 2 else None
    by_group = {view.get_group(dim).group_name: name for dim, name in enumerate(view.mesh_dim_names)} if view is not None else {}
    by_group.update({mesh.get_group(dim).group_name: name for dim, name in enumerate(names)})  # a dim the view shares: the mesh's name
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


# -- collectives counted with their bytes ---------------------------------------------


def _tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of a list of tensors (one buffer per rank of a c10d op)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def collective_bytes(args: tuple, result: Any) -> int:
    """The larger of a collective's buffers: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor. c10d ops take output and
    input as separate arguments (and return them with a Work); functional ones
    return the output."""
    results = result if isinstance(result, tuple) else (result,)
    return max(_tensor_bytes(v) for v in (*args, *results))


@contextlib.contextmanager
def counting(counts: Counter, sizes: Counter, axis_of=None) -> Iterator[None]:
    """Collectives of the body, counted and their bytes summed per (axis, op): the
    mesh axis whose group each ran on (`axis_of(args)`, e.g. `mesh_axes(mesh)`;
    without one, every collective is filed under "" (no mesh to name it by)) and its
    SPEC name. Not CommDebugMode: its module tracker and per-op log cost more than
    the model at 126 layers; the counts are the same (tests compare them)."""
    from .simulate import _COLLECTIVE_NAMES, collective_counter

    spec_names = set(_COLLECTIVE_NAMES.values())

    def counted(name: str, args: tuple, out: Any) -> None:
        if name in spec_names:
            key = (axis_of(args) if axis_of is not None else "", name)
            counts[key] += 1
            sizes[key] += collective_bytes(args, out)

    with collective_counter(counted):
        yield


def per_op(by_axis: dict[tuple[str, str], int]) -> dict[str, int]:
    """{(axis, op): n} summed over the axes: {op: n}, sorted."""
    found: Counter = Counter()
    for (_, op), n in by_axis.items():
        found[op] += n
    return dict(sorted(found.items()))
