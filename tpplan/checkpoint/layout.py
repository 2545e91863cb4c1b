"""The layout a checkpoint was saved under, and whether it loads under another
(SPEC §7): what a save records, and the header-only check the dry run runs.

A save records, in its manifest (`training/complete.py`), the mesh the model's
tensors were sharded over (every named axis and its size: `{"dp_shard": 2,
"tp": 2}`; `{}` from one device) and the plan that laid them out (its name, file,
version and fingerprint), when the caller gave one.

DCP reshards on load: every rank reads the slices of the global tensors its own
layout holds, whatever layout wrote them, so a DCP checkpoint loads under any
other layout of the same model: any degree of any axis, HSDP and FSDP, TP and
none, the optimizer's state included (its moments are sharded like the
parameters, read back through torch's `get_optimizer_state_dict` /
`set_optimizer_state_dict` in the target's layout). Whether it will load is
therefore a question about global tensors, decided from headers alone: the
model's keys, shapes and dtypes (`inspect.match`) and, for a training
checkpoint, the optimizer state's (`optimizer_problems`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.problems import Problem, error
from .errors import some
from .training.state import OPTIMIZER

# The state torch's optimizers keep per parameter in the parameter's shape (`zeros_like(p)`):
# AdamW's moments, SGD's momentum, ... Other state (a scalar `step`, Adafactor's factored
# row and column moments) has shapes of its own, which only the optimizer knows.
PARAMETER_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                              "acc_delta", "sum", "exp_inf", "ax", "prev", "step_size"})

if TYPE_CHECKING:
    from torch import nn

    from .source import Source


def mesh_of(model: "nn.Module") -> dict[str, int]:
    """{axis: size} of the mesh the model's parameters and buffers are sharded over:
    every dim of the meshes their DTensors were cut from (a TP submesh reports the
    data axes beside it too), outermost first; {} for a model on one device."""
    from torch.distributed.tensor import DTensor

    axes: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not isinstance(t, DTensor):
            continue
        # A parameter lives on a submesh (tp alone, or FSDP2's (dp_shard, tp)); the mesh
        # it was cut from names every axis of the job (private API, stable since torch 2.4).
        mesh = t.device_mesh._get_root_mesh()
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        for name, size in zip(names, mesh.shape):
            axes.setdefault(name, int(size))
    return axes


def saved_layout(model: "nn.Module", plan: Any = None) -> dict:
    """What a save records of its layout: the mesh, and the plan (None without one)."""
    record = None
    if plan is not None:
        record = {"name": plan.name, "file": str(plan.file), "version": plan.version, "fingerprint": plan.fingerprint()}
    return {"mesh": mesh_of(model), "plan": record}


def same_layout(a: dict[str, int] | None, b: dict[str, int]) -> bool:
    """Whether two meshes lay tensors out alike (axes of size 1 shard nothing)."""
    if a is None:
        return False
    return {k: v for k, v in a.items() if v != 1} == {k: v for k, v in b.items() if v != 1}


def layout_entry(source: "Source", target: dict[str, int]) -> dict:
    """The report's `checkpoint.layout`: the layout it was saved under (None for a
    checkpoint without a record: another tool's, safetensors, or an older tpplan's),
    the target, and whether loading reshards."""
    saved = source.layout
    return {
        "saved": saved,
        "target": dict(target),
        "reshards": not same_layout(saved.get("mesh") if saved else None, target),
        "optimizer": any(k.startswith(OPTIMIZER) for k in source.keys),
    }


def optimizer_problems(model: "nn.Module", source: "Source") -> list[Problem]:
    """The problems of loading a training checkpoint's optimizer state into an optimizer
    over `model`, from its headers: the state kept in a parameter's shape
    (PARAMETER_SHAPED: AdamW's exp_avg and exp_avg_sq) must have the parameter's global
    shape. (State of parameters the model lacks is not read: the model's own keys say
    whether it is the same model, `inspect.match`.)"""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    prefix = f"{OPTIMIZER}state."
    wrong = []
    for key, md in source.held.items():
        fqn, _, kind = key[len(prefix):].rpartition(".") if key.startswith(prefix) else ("", "", "")
        if fqn in shapes and kind in PARAMETER_SHAPED and tuple(md.size) != shapes[fqn]:
            wrong.append(f"{kind} of {fqn} is {tuple(md.size)}, the parameter {shapes[fqn]}")
    if not wrong:
        return []
    return [error("TP603", f"the optimizer state of {source.path} does not fit the model: {some(wrong, 3)}", source.where)]
