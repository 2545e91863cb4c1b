"""`save_checkpoint`: write a (sharded) model with `torch.distributed.checkpoint`.

- `format="dcp"`: every rank writes its own shards (`FileSystemWriter`, one
  `__RANK_0.distcp` file each, rank 0 the `.metadata`); replicated tensors are
  written once. It loads under any layout (DCP reshards on load: `layout.py`).
- `format="hf"`: consolidated HuggingFace safetensors (`HuggingFaceStorageWriter`:
  every rank writes its shards, then they are merged into full tensors with a
  `model.safetensors.index.json`), plus `config.json` for a transformers model,
  so `AutoModelForCausalLM.from_pretrained(path)` loads it on one device. The
  ranks must share the file system (one node, or a shared mount).

Tied parameters are saved once, under their first name (transformers' convention:
`model.embed_tokens.weight`, not `lm_head.weight`).

Saving into the directory a model was loaded from is safe: tensors that are
still views of files there (`mapped.py`) are copied into memory first.

This module says what a save holds and how it is written (the writers, the
planner); where it lands and when it counts is the training side's
(`training/`): saves are atomic (`training/commit.py`): written into a staging
directory beside the target, then renamed into place by rank 0 after every
rank's files are synced; the previous copy stays beside it as the spare the
next save overwrites in place (`training/atomic.py`).
With `step=N` the target is `ROOT/step-N` of a training root
(`training/steps.py`), with the optimizer state and `extra` beside the model
(`training/state.py`), recorded as the latest only then; `async_save=True`
writes in the background (`training/asyncsave.py`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import fail, quiet
from .experts import checkpoint_view, optimizer_views, save_planner
from .inspect import expected_tensors
from .layout import saved_layout
from .mapped import release
from .stages import as_one, is_stage
from .training import asyncsave, commit
from .training.state import state_for_save
from .training.steps import check_step, step_dir

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


def save_checkpoint(
    model: "nn.Module | Sequence[nn.Module]",
    path: str | os.PathLike,
    *,
    format: str = "dcp",
    dtype: "torch.dtype | None" = None,
    step: int | None = None,
    keep: int | None = None,
    optimizer: "torch.optim.Optimizer | None" = None,
    extra: Any = None,
    async_save: bool = False,
    plan: Any = None,
) -> "str | asyncsave.AsyncSave":
    """Save `model` (sharded or not) to the directory `path`, atomically; every rank
    of the model's mesh must call it. Under a pipeline, `model` is this rank's stages
    (`plan.pipeline_stages(...)`): each rank saves the keys its stages hold. `dtype` casts floating-point tensors (e.g. an
    fp32 model saved as bfloat16).

    Training checkpoints: `step=N` writes `path/step-N` and records it in
    `path/latest` once complete; `keep=K` then removes all but the K newest steps;
    `optimizer` adds its state (torch's `get_optimizer_state_dict`), `extra` any
    picklable value of this rank (data position, RNG states). `async_save=True`
    returns an `AsyncSave` at once (`.wait()`), the write going on in the background.

    The checkpoint records the layout it was saved under (`layout.py`): the mesh of
    the model's DTensors (every named axis and its size) and `plan`, the Plan that
    laid it out, when given. A DCP checkpoint loads under any other layout.

    Returns the checkpoint's directory. Raises CheckpointError TP608 naming the
    path (unwritable, a file, full disk, another job saving there); the previous
    checkpoint at the path is left as it was."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    check_step(step, keep)
    if format == "hf" and (optimizer is not None or extra is not None or async_save):
        raise ValueError("optimizer=, extra= and async_save=True need format='dcp' (safetensors hold tensors of the model only)")
    asyncsave.wait_pending()  # one save at a time: the previous asynchronous one is committed first
    model = as_one(model)
    root = os.fspath(path)
    target = step_dir(root, step) if step is not None else root
    release(model, target)  # tensors still viewing files there (a load from `path`) are copied before they are overwritten
    state = state_to_save(model, dtype)
    sharded = any(isinstance(t, DTensor) or hasattr(t, "__create_chunk_list__") for t in state.values())
    state.update(optimizer_views(state_for_save(model, optimizer, extra)))  # a packed moment: its plain chunks
    real_group = dist.is_initialized() and dist.get_backend() != "fake"
    if dist.is_initialized() and not real_group and sharded:
        raise ValueError("save_checkpoint needs real ranks (torchrun): the fake process group of a simulation cannot gather the shards")
    save = commit.Save(root=root, target=target, step=step, keep=keep, format=format,
                       distributed=real_group and (sharded or is_stage(model)), rank=dist.get_rank() if real_group else 0, real_group=real_group,
                       layout=saved_layout(model, plan))
    save.prepare()
    return save.run(lambda: _write(model, state, save), lambda: _write_async(state, save), async_save=async_save)


def _write(model: "nn.Module", state: dict, save: "commit.Save"):
    """Write `state` into the save's staging directory; DCP's Metadata (None for hf)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if save.format == "dcp":
        from torch.distributed.checkpoint import FileSystemWriter

        with quiet():  # sync_files: each rank fsyncs its files before DCP writes .metadata
            return dcp.save(state, storage_writer=FileSystemWriter(save.staging, sync_files=True), planner=save_planner(), no_dist=not save.distributed)
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(save.staging, save_distributed=save.distributed, enable_consolidation=save.distributed)
    with quiet():
        dcp.save(state, storage_writer=writer, planner=save_planner(), no_dist=not save.distributed)
    if save.distributed:
        dist.barrier()  # the coordinator consolidated every rank's shards
    if save.rank == 0:
        shutil.rmtree(os.path.join(save.staging, "sharded"), ignore_errors=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(save.staging)
    return None


def _write_async(state: dict, save: "commit.Save"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    group = asyncsave.process_group() if save.distributed else None
    if not save.distributed:  # DCP's thread warns that it assumes one process: the intent (quiet() cannot reach a thread)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    staged = asyncsave.stage(state)  # the only part the caller waits for
    writer = FileSystemWriter(save.staging, sync_files=True)

    def write():
        return dcp.save(staged, storage_writer=writer, planner=save_planner(), process_group=group, no_dist=not save.distributed)

    return asyncsave.in_background(write)
