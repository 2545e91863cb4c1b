"""The problems of reading and writing checkpoints, and their codes (TP6xx).

Plain data, no torch: `tpplan rules` documents these codes without importing it.
A `CheckpointError` is a `PlanError` (it carries `.problems`, located at the
checkpoint file), so the CLI prints it like any other problem and picks the
exit code: TP600 (the path cannot be read) exits 2, the others 1.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from ..core.problems import PlanError, Problem, error

# code -> (name, what it means and what to do); see `tpplan rules TP6xx`.
CODE_DOCS = {
    "TP600": ("unreadable-checkpoint", """
        The checkpoint path cannot be read: it does not exist, is not readable,
        or is neither a HuggingFace safetensors file or directory (with
        `model.safetensors.index.json` when sharded) nor a
        `torch.distributed.checkpoint` directory (with `.metadata`). Exits 2.
    """),
    "TP601": ("missing-keys", """
        Tensors the model has are not in the checkpoint. Nothing is loaded: a
        partial load is an error unless `--allow-missing PATTERN`
        (`allow_missing=` in the API) names the keys that may be missing; those
        are initialised as the model's own initialisation would.
    """),
    "TP602": ("unexpected-keys", """
        The checkpoint holds tensors the model does not have (a renamed module,
        another variant of the architecture). Nothing is loaded.
    """),
    "TP603": ("shape-mismatch", """
        A tensor of the checkpoint has another shape than the model's parameter
        or buffer of the same name (another configuration: hidden size, vocabulary,
        KV heads). Nothing is loaded.
    """),
    "TP604": ("dtype-mismatch", """
        A tensor of the checkpoint has a dtype that cannot become the model's: an
        integer or boolean tensor for a floating-point parameter, or the reverse.
        (Floating-point tensors of another precision are cast, e.g. a bfloat16
        checkpoint into a float32 model.)
    """),
    "TP605": ("corrupt-checkpoint", """
        A checkpoint file cannot be decoded: a safetensors header that is not
        valid, a file shorter than its header says (truncated), a DCP `.metadata`
        that does not unpickle, an index that names files that are missing, or a
        read that fails half-way. The message names the file; when reading failed
        after the model's tensors were allocated it says that the model is left
        partly loaded.
    """),
    "TP606": ("checkpoint-of-another-model", """
        Most of the model's tensors are missing from the checkpoint and the
        checkpoint holds tensors the model does not have: it was saved from
        another model (check `--model` and `--checkpoint`).
    """),
    "TP607": ("buffer-not-recomputable", """
        The model was built on the meta device and a non-persistent buffer (not
        in any checkpoint, e.g. a rotary `inv_freq` table) cannot be recomputed:
        the module is not a transformers model, has no `reset_parameters()` and
        the model no torchtitan-style `init_weights(buffer_device=)`. Build the
        model under `tpplan.meta_parameters()` (parameters alone on meta, buffers
        computed as the constructor writes them), or give the module a
        `reset_parameters()` that fills them.
    """),
    "TP608": ("save-failed", """
        Writing the checkpoint failed: the path is a file, a directory cannot be
        created or written, the disk is full, or another job is saving to the
        same directory (it holds the directory's lock). The message names the path.
        Saves are staged beside the target and renamed into place only when
        every rank has finished, so the previous checkpoint there is left as it was.
    """),
    "TP609": ("incomplete-checkpoint", """
        The directory is not a complete checkpoint: shard files without a DCP
        `.metadata` (a save that did not finish), shard files the metadata names
        missing or shorter than it says, files its manifest
        (`.tpplan-checkpoint.json`) lists missing or of another size, a `step-N`
        directory holding another step, or a training root whose `latest` marker
        names a missing step. Nothing is loaded. tpplan's own saves never leave
        one (they are staged and renamed); load an earlier step, or save again.
    """),
}

UNREADABLE = "TP600"


class CheckpointError(PlanError):
    """Loading or saving a checkpoint failed; `.problems` say which keys and files."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems)

    @property
    def unreadable(self) -> bool:
        return any(p.code == UNREADABLE for p in self.problems)


def fail(code: str, message: str, file: str) -> CheckpointError:
    return CheckpointError([error(code, message, str(file))])


def some(names: list[str], n: int = 5) -> str:
    """'a, b, c (and 4 more)'"""
    shown = ", ".join(names[:n])
    return shown + (f" (and {len(names) - n} more)" if len(names) > n else "")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group is up: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def reason(exc: BaseException) -> str:
    """Why a DCP read or write failed, in one line: every failing rank's first line
    (DCP's CheckpointException, one entry per rank), else the error's own."""
    from torch.distributed.checkpoint.api import CheckpointException  # only once something failed: the codes need no torch

    if isinstance(exc, CheckpointException):  # one entry per failing rank
        failures = getattr(exc, "failures", {}) or {}
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {first_line(inner)}")
        if parts:
            return "; ".join(parts[:4])
    return f"{type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__
