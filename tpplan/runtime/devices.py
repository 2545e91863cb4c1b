"""Devices, the process group and the mesh of a torchrun job."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.axes import tp_dims
from .options import ApplyOptionsError

if TYPE_CHECKING:
    import torch

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the variables torchrun sets."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ApplyOptionsError("launch", "not-torchrun", f"not started by torchrun ({', '.join(missing)} not set)", missing=missing)
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError:
        raise ApplyOptionsError("launch", "bad-env", "RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None


def pick_device(choice: str) -> str:
    """The device type for the `device` option (auto: cuda, then npu, then cpu)."""
    import torch

    if choice not in ("auto", *BACKENDS):
        raise ApplyOptionsError("device", "unknown", f"must be auto, cpu, cuda or npu, not {choice!r}", value=choice)
    npu = _npu_available()
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "npu" if npu else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ApplyOptionsError("device", "no-cuda", "cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if choice == "npu" and not npu:
        raise ApplyOptionsError("device", "no-npu", "npu needs torch_npu installed and an Ascend NPU visible")
    return choice


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  registers torch.npu and the hccl backend
    except ImportError:
        return False
    import torch

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def rank_device(device_type: str, local_rank: int) -> "torch.device":
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    getattr(torch, device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)


def init_process_group(device: "torch.device", timeout: float) -> str:
    """Initialise the default group from torchrun's environment; returns the backend."""
    import torch.distributed as dist

    backend = BACKENDS[device.type]
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout)}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad device fails here, not in the first collective
    dist.init_process_group(**kwargs)
    return backend


def mesh_shape(world_size: int, tp: int | None, axis: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """1-D mesh of the world, or 2-D (dp, tp) when `tp` is smaller than the world."""
    tp = world_size if tp is None else tp
    if tp < 1 or tp > world_size or world_size % tp:
        raise ApplyOptionsError("tp", "not-a-divisor", f"{tp} does not divide the world size ({world_size})", tp=tp, world=world_size)
    if tp < world_size and axis == "dp":
        raise ApplyOptionsError("plan", "dp-axis", "the plan's mesh.axis is 'dp', the name of the data-parallel dim of a 2-D mesh: rename it (e.g. 'tp')")
    return tp_dims(world_size, tp, axis)


def fsdp_tp(world_size: int, tp: int | None, fsdp: int | None) -> int | None:
    """The TP degree under torchrun with FSDP2 on N = `fsdp`: world / N unless `tp`
    is given (and agrees); without `fsdp`, `tp` as given."""
    if fsdp is None:
        return tp
    if tp is None and world_size % fsdp:
        raise ApplyOptionsError("fsdp", "not-a-divisor", f"{fsdp} does not divide the world size {world_size}", fsdp=fsdp, world=world_size)
    tp = world_size // fsdp if tp is None else tp
    if fsdp * tp != world_size:
        raise ApplyOptionsError("fsdp", "world-mismatch", f"{fsdp} x tp {tp} is not the world size {world_size}", fsdp=fsdp, tp=tp, world=world_size)
    return tp


def synchronize(device: "torch.device") -> None:
    import torch

    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)

