"""The expert view of a version 2 plan's mesh (SPEC §7): (dp_replicate, efsdp, ep), as
torchtitan's ParallelDims builds its sparse mesh.

Expert parallelism has no ranks of its own: `ep` borrows them from dp_shard·cp·tp,
and what is left of those, efsdp = dp_shard·cp·tp / ep, is the FSDP degree of the
experts' parameters (the rest of the model is sharded over dp_shard). Both views are
unflattened from the one world mesh (`DeviceMesh._flatten` / `_unflatten`, private in
torch 2.13), so they share its root: FSDP2 can join the efsdp dim with the ep dim of
the experts' DTensors as it joins dp_shard with tp. With ep the fastest dim, an ep
group is made of tp ranks first, then of cp and dp_shard ranks (torchtitan's order).

The view is built once per mesh (`expert_view` remembers it): building it creates
process groups, which every rank must do, in the same order.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPLICATE = "dp_replicate"
BORROWED = ("dp_shard", "cp", "tp")  # the axes ep takes its ranks from, outermost first
EXPERT_DIMS = ("efsdp", "ep")

# id(dense mesh) -> (a weak reference to it, ep, its expert view)
_VIEWS: dict[int, tuple[weakref.ref, int, "DeviceMesh"]] = {}


def expert_degree(plan: Any) -> int | None:
    """The ep degree whose view the plan needs: its `mesh.ep` where it has `experts`
    rules (a version 1 plan, or one without experts, needs none)."""
    if plan.version != 2 or not plan.spec.experts:
        return None
    return plan.mesh.sizes["ep"]


def expert_view(plan: Any, mesh: "DeviceMesh") -> "DeviceMesh | None":
    """(dp_replicate, efsdp, ep) over the ranks of `mesh` (dp_replicate only where `mesh`
    has it), built on the first call for this mesh; None where the plan has no experts
    rules. ValueError where `mesh` has dims other than the plan's axes, out of order,
    or ep does not divide the ranks it borrows."""
    ep = expert_degree(plan)
    if ep is None:
        return None
    known = _VIEWS.get(id(mesh))
    if known is not None and known[0]() is mesh and known[1] == ep:
        return known[2]
    view = _unflatten(mesh, ep)
    key = id(mesh)
    _VIEWS[key] = (weakref.ref(mesh, lambda _: _VIEWS.pop(key, None)), ep, view)
    return view


def _unflatten(mesh: "DeviceMesh", ep: int) -> "DeviceMesh":
    names = tuple(mesh.mesh_dim_names or ())
    order = (REPLICATE, *BORROWED)
    if not names or any(name not in order for name in names) or list(names) != sorted(names, key=order.index):
        raise ValueError(
            f"expert parallelism borrows its ranks from the mesh dims dp_shard, cp and tp, but the mesh has dims "
            f"{names or 'without names'}: build it with plan.build_mesh(world), or name its dims from "
            f"{', '.join(order)}, in that order")
    sizes = dict(zip(names, mesh.shape))
    borrowed = math.prod(sizes.get(name, 1) for name in BORROWED)
    if borrowed % ep:
        shown = "·".join(str(sizes.get(name, 1)) for name in BORROWED)
        raise ValueError(f"mesh.ep: {ep} does not divide dp_shard·cp·tp = {shown} = {borrowed}: expert parallelism "
                         "borrows its ranks from these axes")
    lead = (REPLICATE,) if REPLICATE in sizes else ()
    view_sizes = (*(sizes[name] for name in lead), borrowed // ep, ep)
    world = mesh if mesh.ndim == 1 else mesh._flatten("_".join(names))
    return world._unflatten(0, view_sizes, (*lead, *EXPERT_DIMS))


def expert_data_parallel_mesh(view: "DeviceMesh") -> "DeviceMesh":
    """The mesh FSDP2 shards the experts' parameters over: (dp_replicate, efsdp), or efsdp."""
    names = view.mesh_dim_names or ()
    return view[REPLICATE, "efsdp"] if REPLICATE in names else view["efsdp"]
