"""What follows the TP rules, in the simulated world as on real ranks: `train_mesh`
(the (dp, tp) mesh memory planning simulates), `after_rules` (activation
checkpointing, then FSDP2), and `shard_data_parallel`, which runs
sharding/data_parallel.py with FSDP2's mesh bookkeeping kept outside fake mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan
    from torch.distributed.device_mesh import DeviceMesh


def train_mesh(device_type: str, dp: int, tp: int, axis: str) -> "DeviceMesh":
    """The 1-D tp mesh (dp 1) or the 2-D (dp, tp) mesh; tp is the fastest-varying dim."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp == 1:
        return init_device_mesh(device_type, (tp,), mesh_dim_names=(axis,))
    if axis == "dp":
        raise ValueError("the plan's mesh.axis is 'dp', the name of the data-parallel dim: rename it (e.g. 'tp')")
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", axis))


def blocks(model: "nn.Module") -> list[str]:
    """FSDP2's default units (sharding/data_parallel.py): memory's block reuse reads them here."""
    from ..sharding.data_parallel import blocks as default_units

    return default_units(model)


def after_rules(plan: "Plan", model: "nn.Module", mesh: "DeviceMesh", data_parallel: bool) -> list[str]:
    """What follows the TP rules (and the experts over ep), in torchtitan's order: activation
    checkpointing (a version 2 plan's `checkpointing`), then FSDP2/HSDP (`data_parallel`:
    the data axes, or --fsdp's dp; the experts over efsdp). Returns the report's notes of
    what was done."""
    from ..sharding.activation_checkpoint import apply_activation_checkpointing
    from ..sharding.data_parallel import data_parallel_mesh, data_parallel_of
    from ..sharding.expert_mesh import expert_view

    notes = []
    if checkpointed := apply_activation_checkpointing(plan, model):
        mode = plan.spec.checkpointing.mode
        notes.append(f"activation checkpointing ({mode}) on {len(checkpointed)} module(s) ({', '.join(plan.spec.checkpointing.modules)})")
    wrapped = shard_data_parallel(model, mesh, plan) if data_parallel else []
    if (view := expert_view(plan, mesh)) is not None:  # the experts were placed with the TP rules (locate.py)
        experts = plan.match_experts(model)
        over = f", sharded by FSDP2 over efsdp {view['efsdp'].size()}" if set(experts) & set(wrapped) else ""
        notes.insert(0, f"expert_parallel (all_to_all) over ep {view['ep'].size()}, borrowed from dp_shard·cp·tp, on "
                        f"{len(experts)} module(s){over}")
    if data_parallel and data_parallel_mesh(mesh) is not None:
        notes.append(data_parallel_of(plan).describe(dict(zip(mesh.mesh_dim_names or (), mesh.shape))))
    return notes


def shard_data_parallel(model: "nn.Module", mesh: "DeviceMesh", plan: "Plan | None" = None, wrap: list[str] | None = None) -> list[str]:
    """FSDP2 after the plan (sharding/data_parallel.py), on fake tensors as on real ones;
    returns the wrapped fqns (root: "")."""
    from ..sharding.data_parallel import apply_data_parallel

    with _meshes_outside_fake_mode():
        return apply_data_parallel(plan, model, mesh, wrap)


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
