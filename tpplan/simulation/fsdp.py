"""What follows the TP rules, in the simulated world as on real ranks: `after_rules`
(activation checkpointing, then FSDP2: torchrun's; `apply_after_rules` and
`after_rules_notes`, its two halves, memory planning's), and `shard_data_parallel`,
which runs sharding/data_parallel.py with FSDP2's mesh bookkeeping kept outside
fake mode.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..core.plan import Plan
    from torch.distributed.device_mesh import DeviceMesh


def blocks(model: "nn.Module") -> list[str]:
    """FSDP2's default units (sharding/data_parallel.py): memory's block reuse reads them here."""
    from ..sharding.data_parallel import blocks as default_units

    return default_units(model)


def after_rules(plan: "Plan", model: "nn.Module", mesh: "DeviceMesh", data_parallel: bool) -> list[str]:
    """What follows the TP rules (and the experts over ep), in torchtitan's order:
    activation checkpointing (a version 2 plan's `checkpointing`), then FSDP2/HSDP
    (`data_parallel`: the data axes, or --fsdp's dp; the experts over efsdp). Returns
    the report's notes of what was done."""
    from ..sharding.data_parallel import data_parallel_mesh

    checkpointed, wrapped = apply_after_rules(plan, model, mesh, data_parallel)
    data_mesh = dict(zip(mesh.mesh_dim_names or (), mesh.shape)) if data_parallel and data_parallel_mesh(mesh) is not None else None
    return [*expert_notes(plan, model, mesh, wrapped), *after_rules_notes(plan, checkpointed, data_mesh)]


def expert_notes(plan: "Plan", model: "nn.Module", mesh: "DeviceMesh", wrapped: list[str]) -> list[str]:
    """The report's note of the experts over ep (placed with the TP rules, locate.py), and
    whether FSDP2 shards them over efsdp (`wrapped`: the fqns it wrapped)."""
    return expert_note(plan, list(plan.match_experts(model)), dict(zip(mesh.mesh_dim_names or (), mesh.shape)), wrapped)


def expert_note(plan: "Plan", experts: list[str], sizes: dict[str, int], wrapped: list[str]) -> list[str]:
    """`expert_notes` from the experts' fqns and the mesh's {dim: size} (efsdp: the ranks
    ep leaves of dp_shard·cp·tp), for a report that holds no mesh (memory planning's)."""
    from ..sharding.expert_mesh import BORROWED, expert_degree

    if (ep := expert_degree(plan)) is None:
        return []
    efsdp = math.prod(sizes.get(name, 1) for name in BORROWED) // ep
    over = f", sharded by FSDP2 over efsdp {efsdp}" if set(experts) & set(wrapped) else ""
    return [f"expert_parallel (all_to_all) over ep {ep}, borrowed from dp_shard·cp·tp, on {len(experts)} module(s){over}"]


def apply_after_rules(plan: "Plan", model: "nn.Module", mesh: "DeviceMesh", data_parallel: bool,
                      wrap: list[str] | None = None, units: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Activation checkpointing, then (`data_parallel`) FSDP2 on the plan's units (`wrap`:
    these blocks instead of the default ones, see `shard_data_parallel`; `units`: these,
    a pipeline stage's share); returns the checkpointed fqns and the wrapped ones (root: "")."""
    from ..sharding.activation_checkpoint import apply_activation_checkpointing

    checkpointed = apply_activation_checkpointing(plan, model)
    return checkpointed, shard_data_parallel(model, mesh, plan, wrap, units) if data_parallel else []


def after_rules_notes(plan: "Plan", checkpointed: list[str], data_mesh: dict[str, int] | None) -> list[str]:
    """The report's notes of `apply_after_rules`: the modules checkpointed (of the whole
    model), and FSDP2 over the data dims of `data_mesh` ({dim: size}; None: no FSDP2)."""
    from ..sharding.data_parallel import data_parallel_of

    notes = []
    if checkpointed:
        mode = plan.spec.checkpointing.mode
        notes.append(f"activation checkpointing ({mode}) on {len(checkpointed)} module(s) ({', '.join(plan.spec.checkpointing.modules)})")
    if data_mesh is not None:
        notes.append(data_parallel_of(plan).describe(data_mesh))
    return notes


def shard_data_parallel(model: "nn.Module", mesh: "DeviceMesh", plan: "Plan | None" = None, wrap: list[str] | None = None,
                        units: list[str] | None = None) -> list[str]:
    """FSDP2 after the plan (sharding/data_parallel.py), on fake tensors as on real ones;
    returns the wrapped fqns (root: ""). `wrap`: the blocks to wrap where the plan names
    no units of its own (block reuse's truncated copy, whose largest list may no longer
    be the blocks); a plan's `fsdp.units` are matched on `model` as it is."""
    from ..sharding.data_parallel import apply_data_parallel

    with _meshes_outside_fake_mode(), _chunks_on_demand():
        return apply_data_parallel(plan, model, mesh, wrap, units)


class _Chunks(Sequence):
    """`_chunk_with_empty(tensor, parts, dim)`'s list, each chunk made when it is read:
    the same views torch.chunk makes (`narrow` at multiples of its step), and empty
    tensors past the last."""

    def __init__(self, tensor: "torch.Tensor", parts: int, dim: int):
        self.tensor, self.parts, self.dim = tensor, parts, dim
        self.step = -(-tensor.size(dim) // parts)

    def __len__(self) -> int:
        return self.parts

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.parts))]
        index = index + self.parts if index < 0 else index
        start = index * self.step
        if start >= self.tensor.size(self.dim) and index > 0:
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))


@contextlib.contextmanager
def _chunks_on_demand() -> Iterator[None]:
    """FSDP2 cuts every parameter into one chunk per data-parallel rank and reads one or
    two of them (this rank's, the padded first): on fake tensors each view costs a
    dispatch, 64 per parameter at dp_shard 64, most of a 405B stage's FSDP2 setup. The
    chunks are made when read instead, the same views."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty

    def chunk(tensor, num_chunks: int, dim: int):
        if tensor.size(dim) == 0:  # torch.chunk's own answer for an empty dim
            return original(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


@contextlib.contextmanager
def _meshes_outside_fake_mode() -> Iterator[None]:
    """Let FSDP2 join the dp and tp meshes, and the experts' view be cut from the
    mesh, while FakeTensorMode is active.

    FSDP2 concatenates the dp mesh with the TP parameters' mesh
    (`DeviceMesh._concatenate`), and the expert view (sharding/expert_mesh.py)
    flattens and unflattens the mesh (`_flatten`, `_unflatten`); each finds this
    rank's coordinates with a data-dependent `nonzero` on the (real, tiny) mesh
    tensor, which has no fake result under the dry run's FakeTensorMode. The mesh is
    bookkeeping, not model memory, so it is computed with fake mode suspended.
    Outside fake mode this changes nothing.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    originals = {name: DeviceMesh.__dict__[name] for name in ("_concatenate", "_flatten", "_unflatten")}

    def concatenate(meshes):
        with unset_fake_temporarily():
            return originals["_concatenate"].__func__(meshes)

    def outside(method):
        def run(self, *args, **kwargs):
            with unset_fake_temporarily():
                return method(self, *args, **kwargs)
        return run

    DeviceMesh._concatenate = staticmethod(concatenate)
    DeviceMesh._flatten = outside(originals["_flatten"])
    DeviceMesh._unflatten = outside(originals["_unflatten"])
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(DeviceMesh, name, original)


@contextlib.contextmanager
def fake_friendly_meshes() -> Iterator[None]:
    """`_meshes_outside_fake_mode` for a whole training step (FSDP2 joins meshes
    in its forward too, when it redistributes a 2-D parameter)."""
    with _meshes_outside_fake_mode():
        yield
