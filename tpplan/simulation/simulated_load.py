"""Loading at TP N in one process, as N ranks would, from one model: the plan is
applied once under `LocalTensorMode` (one real tensor per simulated rank, the
collectives run on them); then, rank by rank, `load_checkpoint` reads that rank's
own slices into a view of the sharded model whose DTensors sit on the rank's
coordinate of the mesh (local shapes as torch computes them,
`compute_local_shape_and_global_offset`), and the N ranks' values become the
per-rank values of the model's LocalTensors. Its outputs can then be compared
with a single-device model (`verify.check_parity(..., checkpoint=...)`).

    with simulated_load(build, plan, 2, "llama/") as loaded:
        logits = loaded.run(ids)          # one tensor per rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint.load import LoadResult, load_checkpoint
from ..checkpoint.meta import meta_parameters
from .simulate import forget_sharding_cache, local_ranks, simulated_world


@dataclass
class SimulatedLoad:
    model: nn.Module  # parallelized, its DTensors holding LocalTensors (one real tensor per rank)
    results: list[LoadResult]  # what each rank's load_checkpoint did
    tp: int

    def run(self, *inputs: Any) -> list[torch.Tensor]:
        """The model's output (logits for a causal LM) on each rank, as full plain tensors."""
        from torch.distributed._local_tensor import LocalTensor

        out = self.model(*inputs)
        out = getattr(out, "logits", out)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        if isinstance(out, LocalTensor):
            return [out._local_tensors[r] for r in sorted(out._local_tensors)]
        return [out] * self.tp


def _slots(model: nn.Module) -> Iterator[tuple[str, dict, str, torch.Tensor]]:
    """(name, slot dict, key, tensor) of every parameter and buffer, by every name (tied ones too)."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for slots in (module._parameters, module._buffers):
            for key, t in list(slots.items()):
                if t is not None:
                    yield prefix + key, slots, key, t


def _on_rank(t: torch.Tensor, rank: int, meshes: dict) -> torch.Tensor:
    """An empty meta stand-in for `t` on simulated rank `rank` (a real plain tensor stays itself): a DTensor's local shard
    of that rank, on a copy of its mesh that has that rank's coordinate (no process
    group: the fake group's collectives do nothing, and loading needs none)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        if t.device.type != "meta":  # a buffer the constructor computed (meta_parameters): every rank's already
            return t
        new = torch.empty_like(t, device="meta")
    else:
        mesh = t.device_mesh
        key = (id(mesh), rank)
        if key not in meshes:
            meshes[key] = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False, _rank=rank)
        local_shape, _ = compute_local_shape_and_global_offset(t.shape, meshes[key], t.placements)
        local = torch.empty(local_shape, dtype=t.dtype, device="meta")
        new = DTensor.from_local(local, meshes[key], t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def load_ranks(model: nn.Module, path: str, tp: int, *, dtype: torch.dtype | None = None, allow_missing: Iterable[str] = ()) -> list[LoadResult]:
    """Fill `model` (on the meta device, parallelized under LocalTensorMode(tp)) from
    `path`, every simulated rank reading its own slices; each rank's LoadResult.
    Called inside that LocalTensorMode."""
    from torch.distributed._local_tensor import LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is None:
        raise RuntimeError("load_ranks runs inside LocalTensorMode")
    original = list(_slots(model))
    per_rank: list[dict[str, torch.Tensor]] = []
    results = []
    with mode.disable():  # each rank's load is plain code on that rank's shards
        meshes: dict = {}
        for rank in range(tp):
            forget_sharding_cache()
            views: dict[int, torch.Tensor] = {}
            for _, slots, key, t in original:
                slots[key] = views.setdefault(id(t), _on_rank(t, rank, meshes))
            results.append(load_checkpoint(model, path, dtype=dtype, allow_missing=tuple(allow_missing), device="cpu"))
            per_rank.append({name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone() for name, _, _, t in _slots(model)})
        forget_sharding_cache()
    replaced: dict[int, Any] = {}
    for name, slots, key, t in original:
        if id(t) not in replaced:
            values = {r: per_rank[r][name] for r in range(tp)}
            if isinstance(t, DTensor):
                new = DTensor.from_local(LocalTensor(values), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
            else:
                new = values[0]  # replicated: every rank read the same full tensor
            replaced[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        slots[key] = replaced[id(t)]
    return results


@contextlib.contextmanager
def simulated_load(
    build: Callable[[], nn.Module], plan: Any, tp: int, path: str, *, dtype: torch.dtype | None = None, allow_missing=()
) -> Iterator[SimulatedLoad]:
    """Build the model once (parameters on the meta device), apply `plan` at TP `tp` and load `path`
    rank by rank (see the module docstring); the body runs inside the simulated world
    (fake process group and LocalTensorMode)."""
    from torch.distributed.device_mesh import init_device_mesh

    with meta_parameters():  # parameters on meta, buffers as the constructor computes them
        model = build()
    with simulated_world(tp), local_ranks(tp):
        plan.apply(model, init_device_mesh("cpu", (tp,), mesh_dim_names=(getattr(plan, "mesh_axis", None) or "tp",)))
        results = load_ranks(model, path, tp, dtype=dtype, allow_missing=allow_missing)
        yield SimulatedLoad(model, results, tp)
