"""FSDP2 on the data-parallel dim of a (dp, tp) mesh, after the plan.

As torchtitan's `apply_fsdp`: `fully_shard` on each block (the children of the
model's largest `nn.ModuleList`, e.g. `layers.N`) and then on the root, over
the `dp` mesh dim. The plan's DTensor parameters (on the `tp` dim) become
2-D DTensors, sharded on dp as well; FSDP all-gathers a block's parameters
before its forward (and again before its backward) and reduce-scatters its
gradients after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def blocks(model: "nn.Module") -> list[str]:
    """The repeated blocks FSDP wraps one by one: the children of the largest ModuleList."""
    from torch import nn

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, largest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{child}" if name else child for child, _ in largest.named_children()]


def train_mesh(device_type: str, dp: int, tp: int, axis: str) -> "DeviceMesh":
    """The 1-D tp mesh (dp 1) or the 2-D (dp, tp) mesh; tp is the fastest-varying dim."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp == 1:
        return init_device_mesh(device_type, (tp,), mesh_dim_names=(axis,))
    if axis == "dp":
        raise ValueError("the plan's mesh.axis is 'dp', the name of the data-parallel dim: rename it (e.g. 'tp')")
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", axis))


def shard_data_parallel(model: "nn.Module", mesh: "DeviceMesh", reshard_after_forward: bool = True, wrap: list[str] | None = None) -> list[str]:
    """`fully_shard` each block (`wrap`, default `blocks(model)`) and the root over
    `mesh["dp"]`; returns the wrapped fqns (root: "")."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp"]
    wrapped = blocks(model) if wrap is None else wrap
    with _meshes_outside_fake_mode():
        for fqn in wrapped:
            fully_shard(model.get_submodule(fqn), mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return [*wrapped, ""]


@contextlib.contextmanager
def _meshes_outside_fake_mode() -> Iterator[None]:
    """Let FSDP2 join the dp and tp meshes while FakeTensorMode is active.

    FSDP2 concatenates the dp mesh with the TP parameters' mesh
    (`DeviceMesh._concatenate`), which finds this rank's coordinates with a
    data-dependent `nonzero` on the (real, tiny) mesh tensor; under the dry run's
    FakeTensorMode that op has no fake result. The mesh is bookkeeping, not model
    memory, so it is computed with fake mode suspended. Outside fake mode this
    changes nothing.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


@contextlib.contextmanager
def fake_friendly_meshes() -> Iterator[None]:
    """`_meshes_outside_fake_mode` for a whole training step (FSDP2 joins meshes
    in its forward too, when it redistributes a 2-D parameter)."""
    with _meshes_outside_fake_mode():
        yield
