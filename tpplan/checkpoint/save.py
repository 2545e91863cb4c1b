"""`save_checkpoint`: write a (sharded) model with `torch.distributed.checkpoint`.

- `format="dcp"`: every rank writes its own shards (`FileSystemWriter`, one
  `__RANK_0.distcp` file each, rank 0 the `.metadata`); replicated tensors are
  written once. It loads at any TP degree (DCP reshards on load).
- `format="hf"`: consolidated HuggingFace safetensors (`HuggingFaceStorageWriter`:
  every rank writes its shards, then they are merged into full tensors with a
  `model.safetensors.index.json`), plus `config.json` for a transformers model,
  so `AutoModelForCausalLM.from_pretrained(path)` loads it on one device. The
  ranks must share the file system (one node, or a shared mount).

Tied parameters are saved once, under their first name (transformers' convention:
`model.embed_tokens.weight`, not `lm_head.weight`).

Saving into the directory a model was loaded from is safe: tensors that are
still views of files there (`mapped.py`) are copied into memory first.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import fail, quiet
from .experts import checkpoint_view, save_planner
from .inspect import expected_tensors
from .mapped import release

if TYPE_CHECKING:
    import torch
    from torch import nn

FORMATS = ("dcp", "hf")


def state_to_save(model: "nn.Module", dtype: "torch.dtype | None" = None) -> dict[str, "torch.Tensor"]:
    """{name: tensor}: parameters and persistent buffers, each tied tensor once."""
    from .load import _tensor

    state = {}
    for exp in expected_tensors(model):
        t = _tensor(model, exp.names[0]).detach()
        if t.device.type == "meta":
            raise fail("TP608", f"cannot save {exp.names[0]}: it is on the meta device (load or initialise the model first)", exp.names[0])
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        state[exp.names[0]] = checkpoint_view(t)  # a packed gate/up shard: its plain chunks
    return state


def save_checkpoint(model: "nn.Module", path: str | os.PathLike, *, format: str = "dcp", dtype: "torch.dtype | None" = None) -> str:
    """Save `model` (sharded or not) to the directory `path`; every rank of the
    model's mesh must call it. `dtype` casts floating-point tensors (e.g. an fp32
    model saved as bfloat16). Returns the path. Raises CheckpointError TP608."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import DTensor

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    target = os.fspath(path)
    release(model, target)  # tensors still viewing files there (a load from `path`) are copied before they are overwritten
    state = state_to_save(model, dtype)
    real_group = dist.is_initialized() and dist.get_backend() != "fake"
    sharded = any(isinstance(t, DTensor) or hasattr(t, "__create_chunk_list__") for t in state.values())
    if dist.is_initialized() and not real_group and sharded:
        raise ValueError("save_checkpoint needs real ranks (torchrun): the fake process group of a simulation cannot gather the shards")
    distributed = real_group and sharded  # every rank writes its shards
    rank = dist.get_rank() if real_group else 0
    writes = distributed or rank == 0  # unsharded under a process group: rank 0 writes alone
    try:
        Path(target).mkdir(parents=True, exist_ok=True)  # on every rank: an unwritable path fails them all alike
        if real_group:
            dist.barrier()
        if writes:
            _write(model, state, target, format, distributed, rank)
        if real_group:
            dist.barrier()
    except OSError as exc:
        raise fail("TP608", f"saving to {target!r} failed: {exc.strerror or exc}", target) from None
    except (Exception, CheckpointException) as exc:  # DCP's (a BaseException) wraps every rank's failure
        from .load import _reason

        raise fail("TP608", f"saving to {target!r} failed: {_reason(exc)}", target) from None
    return target


def _write(model: "nn.Module", state: dict, target: str, format: str, distributed: bool, rank: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if format == "dcp":
        from torch.distributed.checkpoint import FileSystemWriter

        with quiet():
            dcp.save(state, storage_writer=FileSystemWriter(target, overwrite=True), planner=save_planner(), no_dist=not distributed)
        return
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(target, save_distributed=distributed, enable_consolidation=distributed)
    with quiet():
        dcp.save(state, storage_writer=writer, planner=save_planner(), no_dist=not distributed)
    if distributed:
        dist.barrier()  # the coordinator consolidated every rank's shards
    if rank == 0:
        shutil.rmtree(os.path.join(target, "sharded"), ignore_errors=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(target)
