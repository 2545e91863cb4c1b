"""Loading at TP N in one process, as N ranks would: rank by rank under a fake
process group of that rank (each builds the meta model, applies the plan and
reads only its own slices with `load_checkpoint`), then the N ranks' shards
become one model of `LocalTensorMode`, which holds one real tensor per rank
and runs the collectives on them, so its outputs can be compared with a
single-device model.

    with simulated_load(build, plan, 2, "llama/") as loaded:
        logits = loaded.run(ids)          # one tensor per rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from .load import LoadResult, load_checkpoint
from .meta import meta_parameters


@contextlib.contextmanager
def _fake_rank(rank: int, world: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; the simulation needs its own")
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding propagation by spec, and specs compare meshes by their
    layout, not by this rank's coordinate: without a clear, rank 1 would get the
    cached outputs of rank 0, on rank 0's mesh, and read rank 0's slices."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy


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


def _axis(plan: Any) -> str:
    return getattr(plan, "mesh_axis", None) or "tp"


@contextlib.contextmanager
def simulated_load(
    build: Callable[[], nn.Module], plan: Any, tp: int, path: str, *, dtype: torch.dtype | None = None, allow_missing=()
) -> Iterator[SimulatedLoad]:
    """Load `path` at TP `tp` rank by rank (see the module docstring); the body runs
    inside the simulated world (fake process group and LocalTensorMode)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    per_rank: list[dict[str, torch.Tensor]] = []
    results = []
    for rank in range(tp):
        with _fake_rank(rank, tp):
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=(_axis(plan),))
            with meta_parameters():
                model = build()
            plan.apply(model, mesh)
            results.append(load_checkpoint(model, path, dtype=dtype, allow_missing=allow_missing, device="cpu"))
            per_rank.append(_locals(model))

    with _fake_rank(0, tp), LocalTensorMode(tp):
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=(_axis(plan),))
        with torch.device("meta"):  # every tensor is replaced by the ranks' loaded ones below
            model = build()
        plan.apply(model, mesh)
        replaced: dict[int, Any] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            for slots in (module._parameters, module._buffers):
                for key, t in list(slots.items()):
                    if t is None:
                        continue
                    if id(t) not in replaced:
                        name = prefix + key
                        values = {r: per_rank[r][name] for r in range(tp)}
                        if isinstance(t, DTensor):
                            local = LocalTensor(values)
                            new = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
                        else:
                            new = values[0]  # replicated: every rank read the same full tensor
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                        replaced[id(t)] = new
                    slots[key] = replaced[id(t)]
        yield SimulatedLoad(model, results, tp)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of this rank by every name (tied ones too): its local shard."""
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for slots in (module._parameters, module._buffers):
            for key, t in slots.items():
                if t is not None:
                    out[prefix + key] = (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
    return out
