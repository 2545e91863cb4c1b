"""Checkpoints of sharded models with `torch.distributed.checkpoint`:
`load_checkpoint` (HuggingFace safetensors or DCP, each rank reading its slices),
`save_checkpoint` (DCP, or consolidated safetensors), `inspect` (metadata
against a model, for the dry run). The training loop's side (step-N roots,
retention, crash-safe and asynchronous saves, the optimizer state and `extra`
of a resume) is `training/`, which these compose."""

from .errors import CODE_DOCS, CheckpointError

__all__ = ["CODE_DOCS", "CheckpointError", "load_checkpoint", "save_checkpoint"]


def __getattr__(name: str):
    if name == "load_checkpoint":
        from .load import load_checkpoint

        return load_checkpoint
    if name == "save_checkpoint":
        from .save import save_checkpoint

        return save_checkpoint
    raise AttributeError(f"module 'tpplan.checkpoint' has no attribute {name!r}")
