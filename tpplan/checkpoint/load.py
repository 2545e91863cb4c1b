"""`load_checkpoint`: fill a (sharded, possibly meta-device) model from a
HuggingFace safetensors or DCP checkpoint, each rank reading only its slices.

    with tpplan.meta_parameters():  # parameters on meta, buffers as the constructor makes them
        model = build()
    plan.apply(model, tp_mesh)
    load_checkpoint(model, "llama/")

Order, so that a bad checkpoint leaves the model as it was: read the metadata
(headers only) and compare it with the model (`inspect.match`); allocate each
tensor's local shard on the target device (a DTensor keeps its mesh and
placements); initialise the keys `allow_missing` lets be missing; then
`torch.distributed.checkpoint.load`, whose planner turns each rank's shards into
byte-range reads (`HuggingFaceStorageReader` slices safetensors files,
`FileSystemReader` reads DCP items); last, recompute the non-persistent
buffers (rotary tables) that were on the meta device, which no checkpoint
holds. Real buffers (built under `meta_parameters()`) move to the target
device as they are; meta ones are recomputed by the model's own init:
torchtitan's `init_weights(buffer_device=)` (before the read, since it also
initialises the parameters the read then overwrites), transformers'
`_init_weights`, or a module's `reset_parameters()`.

From a safetensors file, a tensor allocated here that the rank holds whole or
by rows, in the checkpoint's dtype, on the CPU, is not copied: its local tensor
becomes a view of safetensors' private (copy-on-write) mapping of the file,
read when first used (`mapped.py`, which also names the risk: a file truncated
while mapped fails with SIGBUS on first use).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .buffers import init_weights_with_buffers, is_transformers, moved, recompute_buffers, takes_nan
from .errors import CheckpointError, fail, quiet, reason, some
from .experts import checkpoint_view, load_planner, optimizer_views, part_targets
from .inspect import Match, match
from .layout import optimizer_problems
from .source import locate, read_metadata
from .stages import as_one
from .training.asyncsave import wait_pending
from .training.state import restore, targets_for_load

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class LoadResult:
    """What `load_checkpoint` did on this rank."""

    path: str
    format: str  # "hf" or "dcp"
    loaded: list[str]  # checkpoint keys read
    initialized: list[str] = field(default_factory=list)  # missing keys allowed by allow_missing, initialised instead
    read_bytes: int = 0  # checkpoint bytes this rank reads (its shards)
    recomputed_buffers: list[str] = field(default_factory=list)
    step: int | None = None  # the training step of a step-N checkpoint (a training root: its latest)
    extra: Any = None  # what save_checkpoint(extra=...) saved on this rank (rank 0's at another world size)
    directory: str = ""  # the checkpoint directory read (a training root: its latest step-N)
    layout: dict | None = None  # the mesh and plan it was saved under (layout.py); None where it records none
    match: Match | None = field(default=None, repr=False)


def load_checkpoint(
    model: "nn.Module | Sequence[nn.Module]",
    path: str | os.PathLike,
    *,
    dtype: "torch.dtype | None" = None,
    allow_missing: Iterable[str] = (),
    device: "torch.device | str | None" = None,
    optimizer: "torch.optim.Optimizer | None" = None,
) -> LoadResult:
    """Load `path` into `model` in place (parallelized by a plan or not, on the meta
    device or materialized). Each rank allocates and reads only its local shards.
    Under a pipeline, `model` is this rank's materialized stages (`plan.pipeline_stages`;
    or load the whole model before cutting it): each reads its own keys.

    `dtype`: floating-point tensors become this dtype (default: the checkpoint's
    for tensors on the meta device; a materialized tensor keeps its own).
    `allow_missing`: shell-style patterns (`*.bias`) of keys that may be missing;
    those are initialised as the model would (transformers' `_init_weights`, or the
    module's `reset_parameters()`). `device`: where meta tensors are materialized
    (default: the device of the parameters' mesh, else of the model, else cpu).

    A training root (what `save_checkpoint(..., step=N)` writes) loads its latest
    complete step; `optimizer` (created over the materialized model) gets its
    saved state back; the result's `.step` and `.extra` are what was saved.
    A DCP checkpoint loads under any layout (any mesh, FSDP2/HSDP and TP degrees):
    each rank reads its slices, the optimizer state in its own layout too; the
    result's `.layout` is the one it was saved under.

    Raises `CheckpointError` (a `PlanError`) naming keys and files: TP600 unreadable
    path, TP601 missing, TP602 unexpected, TP603 shape, TP604 dtype, TP605 corrupt,
    TP606 another model's checkpoint, TP607 a buffer that cannot be recomputed,
    TP609 an incomplete checkpoint (a save that did not finish).
    Everything but TP605 during the read (which says so) leaves the model untouched.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    wait_pending()  # an asynchronous save still in flight is committed first
    parts, model = model, as_one(model)
    if parts is not model and any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("load_checkpoint: stages on the meta device are loaded into copies; load the model "
                         "before plan.pipeline_stages(...) cuts it, or materialize the stages (to_empty) first")
    source = locate(path)
    read_metadata(source)
    found = match(model, source, allow_missing)
    if found.problems:
        raise CheckpointError(found.problems)
    if optimizer is not None and (problems := optimizer_problems(model, source)):
        raise CheckpointError(problems)
    if optimizer is not None and source.format != "dcp":
        raise fail("TP601", f"{source.path} is a safetensors checkpoint: it holds no optimizer state (load it without optimizer=)", source.where)
    held = targets_for_load(model, optimizer, source.keys, source.where)
    target = _target_device(model, device)
    state, initialized, fresh = _materialize(model, found, dtype, target)
    _initialize(model, initialized, source.where)
    filled = init_weights_with_buffers(model, target)
    no_dist = _no_dist(state)
    try:
        with torch.no_grad(), quiet():
            dcp.load(
                {**state, **optimizer_views(held)},
                storage_reader=source.reader(),
                planner=load_planner(mappable=fresh, allow_partial_load=False),
                no_dist=no_dist,
            )
    except (Exception, CheckpointException) as exc:  # safetensors, pickle, OS errors (DCP's is a BaseException)
        raise fail(
            "TP605",
            f"reading the tensors of {source.path} failed: {reason(exc)}; the model is left partly loaded "
            f"(its {len(state)} tensors were allocated, some were not read): build it again before use",
            source.where,
        ) from None
    recomputed = filled + recompute_buffers(model, source.where)
    extra = restore(model, optimizer, held)
    rank = _rank_in_meshes(model)
    return LoadResult(
        path=str(path),
        format=source.format,
        loaded=list(state),  # this rank's keys (expert parallel: its experts' only)
        initialized=[e.names[0] for e in found.allowed_missing],
        read_bytes=_rank_bytes(found, rank),
        recomputed_buffers=recomputed,
        step=source.step,
        extra=extra,
        directory=source.directory,
        layout=source.layout,
        match=found,
    )


def _no_dist(state: dict) -> bool:
    """Plain tensors need no coordination; nor does the simulation's fake group
    (its collectives return nothing)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        return True
    if dist.get_backend() == "fake":
        return True
    return not any(isinstance(t, DTensor) or hasattr(t, "__create_chunk_list__") for t in state.values())


def _rank_in_meshes(model: "nn.Module") -> int:
    """This rank's index among the ranks of the parameters' mesh (0 without one)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            coordinate = p.device_mesh.get_coordinate() or [0]
            index = 0
            for size, c in zip(p.device_mesh.shape, coordinate):
                index = index * size + c
            return index
    return 0


def _rank_bytes(found: Match, rank: int) -> int:
    ranks = max((len(e.local_shapes) for e in found.loads.values()), default=1)
    return found.rank_bytes(ranks)[min(rank, ranks - 1)] if found.loads else 0


def _target_device(model: "nn.Module", device) -> "torch.device":
    import torch
    from torch.distributed.tensor import DTensor

    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        if isinstance(p, DTensor):
            kind = p.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            module = getattr(torch, kind)
            return torch.device(kind, module.current_device())
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _materialize(model: "nn.Module", found: Match, dtype, device) -> tuple[dict, list, set]:
    """Give every meta (or re-typed) parameter and buffer storage on `device`: the
    local shard only for DTensors. Returns ({checkpoint key: tensor to fill},
    [Expected allowed to be missing], {keys whose tensor was allocated here}: the
    ones the reader may turn into views of the file, nothing else aliasing them)."""
    import torch
    from torch import nn

    ckpt_dtype = {}
    for key, exp in found.loads.items():
        for name in exp.names:
            ckpt_dtype[name] = found.source.tensors[key].properties.dtype
    for exp, parts in found.fused.values():
        for name in exp.names:
            ckpt_dtype[name] = found.source.tensors[parts[0].key].properties.dtype
    floating = Counter(d for d in ckpt_dtype.values() if d.is_floating_point)
    usual = floating.most_common(1)[0][0] if floating else None

    def wanted(name: str, t: "torch.Tensor") -> "torch.dtype":
        if dtype is not None and t.is_floating_point():
            return dtype
        if t.device.type != "meta":
            return t.dtype
        if name in ckpt_dtype:
            return ckpt_dtype[name]
        return usual if (usual is not None and t.is_floating_point()) else t.dtype

    replaced: dict[int, "torch.Tensor"] = {}
    fresh: set[int] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            for key, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:
                    new = _storage_like(param, wanted(prefix + key, param), device)
                    replaced[id(param)] = param if new is None else nn.Parameter(new, requires_grad=param.requires_grad)
                    if new is not None:
                        fresh.add(id(replaced[id(param)]))
                module._parameters[key] = replaced[id(param)]
            for key, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in replaced:
                    non_persistent = key in module._non_persistent_buffers_set
                    new = _storage_like(buffer, buffer.dtype if non_persistent else wanted(prefix + key, buffer), device)
                    if new is None:
                        new = moved(buffer, device)  # real (meta_parameters()): kept, on the model's device
                    elif non_persistent and takes_nan(new):
                        new.fill_(float("nan"))  # recompute_buffers must overwrite it
                    replaced[id(buffer)] = buffer if new is None else new
                    if new is not None:
                        fresh.add(id(new))
                module._buffers[key] = replaced[id(buffer)]
    state = {key: checkpoint_view(_tensor(model, exp.names[0])) for key, exp in found.loads.items()}
    mappable = {key for key, t in state.items() if id(t) in fresh}  # not a PackedShardState
    for name, (_, parts) in found.fused.items():  # per-expert keys: views into the fused local shard
        state.update(part_targets(_tensor(model, name), parts, found.source.where))
    return state, found.allowed_missing, mappable


def _storage_like(t: "torch.Tensor", dtype, device) -> "torch.Tensor | None":
    """An empty tensor like `t` (a DTensor: its local shard, same mesh and placements)
    with storage on `device`; None when `t` can stay as it is."""
    import torch
    from torch.distributed.tensor import DTensor

    if t.device.type != "meta" and t.dtype == dtype:
        return None
    if isinstance(t, DTensor):
        local = t.to_local()
        if local.device.type == "meta":
            fresh = torch.empty(local.shape, dtype=dtype, device=device)
        else:
            fresh = local.detach().to(dtype)
        return DTensor.from_local(fresh, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    if t.device.type == "meta":
        return torch.empty(t.shape, dtype=dtype, device=device)
    return t.detach().to(dtype)


def _tensor(model: "nn.Module", name: str) -> "torch.Tensor":
    module_name, _, key = name.rpartition(".")
    module = model.get_submodule(module_name)
    value = module._parameters.get(key)
    return value if value is not None else module._buffers[key]


def _initialize(model: "nn.Module", missing: list, where: str) -> None:
    """Initialise the tensors allowed to be missing, as the model's own init would."""
    import torch

    if not missing:
        return
    owners = {}
    for exp in missing:
        module_name = exp.names[0].rpartition(".")[0]
        owners[module_name] = model.get_submodule(module_name)
    with torch.no_grad():
        for module_name, module in owners.items():
            if is_transformers(model):
                model._init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                names = [e.names[0] for e in missing if e.names[0].rpartition(".")[0] == module_name]
                raise fail(
                    "TP601",
                    f"{some(names)} may be missing (allow_missing) but '{module_name}' ({type(module).__name__}) has no "
                    "reset_parameters() to initialise them",
                    where,
                )
