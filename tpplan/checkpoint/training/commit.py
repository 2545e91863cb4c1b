"""The ranks' side of an atomic save: rank 0 prepares the staging directory and
commits it; every rank hears its verdict, so they fail or succeed together.

    prepare   rank 0: the target can be written (not a file, parent creatable),
              the lock, the leftovers of killed saves removed, the staging
              directory: the spare (the copy before the target's, overwritten
              file by file, `atomic.py`) or a fresh one; broadcast (its name,
              or why not) to every rank
    (write)   every rank writes its files into staging and fsyncs them (DCP's
              FileSystemWriter(sync_files=True)), rank 0 the .metadata last:
              `run` calls the writer `save_checkpoint` gives, then finish
    finish    rank 0: the spare's files this save did not write
              removed, the manifest, fsync, exchange into place (the previous
              copy becomes the spare), then the `latest` marker and the
              retention of a training root; broadcast the verdict

A rank killed anywhere in between leaves the target as it was (the staging
directory is ignored by loads, reused or removed by the next save).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import asyncsave, atomic, steps
from .complete import write_manifest
from .. import errors
from ..errors import CheckpointError, fail


_SHORT = 255  # bytes of a verdict's text sent in the first broadcast


@dataclass
class Save:
    root: str  # the training root (step= given), else the target itself
    target: str
    step: int | None
    keep: int | None
    format: str
    distributed: bool  # every rank writes its shards
    rank: int
    real_group: bool  # a process group of real ranks: verdicts are broadcast
    layout: dict | None = None  # the mesh and plan of the save, for its manifest
    staging: str = ""
    recycled: bool = False  # rank 0: the staging directory is a spare, overwritten

    @property
    def _lock(self) -> str:
        """A training root is its own lock (kept for the job's life: no file); a plain
        target's is `.NAME.lock` beside it, for the save's duration."""
        if self.step is not None:
            return self.root
        p = Path(self.target)
        return str(p.parent / f".{p.name}.lock")

    def prepare(self) -> None:
        """Every rank: the staging directory to write into, or TP608 on all of them."""
        verdict = None
        if self.rank == 0:
            try:
                if self.step is not None and os.path.exists(self.root) and not os.path.isdir(self.root):
                    raise atomic.SaveRefused(f"{self.root!r} is a file, not a checkpoint directory: remove it or save elsewhere")
                atomic.check_target(self.target)
                atomic.acquire(self._lock, keep=self.step is not None)  # a training root stays this job's
                spare = steps.clean_root(self.root) if self.step is not None else atomic.clean(self.target)
                if self.format != "dcp" and spare is not None:  # the safetensors writer makes subdirectories: a fresh one
                    shutil.rmtree(spare, ignore_errors=True)
                    spare = None
                self.recycled = spare is not None
                verdict = ("ok", atomic.new_staging(self.target, spare))
            except atomic.SaveRefused as exc:
                atomic.release(self._lock)
                verdict = ("error", str(exc))
            except OSError as exc:
                atomic.release(self._lock)
                verdict = ("error", f"preparing to save to {self.target!r} failed: {exc.strerror or exc}")
        kind, value = self._hear(verdict)
        if kind == "error":
            raise fail("TP608", value, self.target)
        self.staging = value

    def run(self, write: Callable[[], Any], write_async: Callable[[], Any], *, async_save: bool) -> "str | asyncsave.AsyncSave":
        """Every rank, after `prepare`: fill the staging directory and commit it. `write()`
        returns DCP's Metadata (None for safetensors), `write_async()` DCP's upload future;
        only the ranks that write call them (unsharded under a process group: rank 0 alone).
        Returns the target once committed, or at once (`async_save`) an `AsyncSave` whose
        `wait()` does. A failed write is TP608 on every rank, its staging directory gone."""
        writes = self.distributed or self.rank == 0
        if async_save:
            return asyncsave.start(self.target, self.step, write_async if writes else (lambda: None), self.finish_async, self.failed_async)
        try:
            metadata = write() if writes else None
        except BaseException as exc:  # OS errors, DCP's CheckpointException (a BaseException) with every rank's failure
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = self.failed(exc)  # before the staging directory goes: the free space it filled
            self.abandon()
            raise error from None
        self.finish(metadata)
        return self.target

    def finish(self, metadata) -> None:
        """Every rank, after its write: rank 0 commits; TP608 on all ranks if it could not.
        No barrier first: rank 0's dcp.save returns only after every rank's write
        results reached it (their files written and fsynced) and it wrote `.metadata`."""
        verdict = None
        if self.rank == 0:
            try:
                self.finish_async(metadata)
                verdict = ("ok", "")
            except CheckpointError as exc:
                verdict = ("error", exc.problems[0].message)
        kind, value = self._hear(verdict)
        if kind == "error":
            raise fail("TP608", value, self.target)

    def finish_async(self, metadata) -> None:
        """Rank 0 (no collectives: also run when an asynchronous write completes): the commit."""
        if self.rank != 0:
            return
        try:
            save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
            if self.recycled:  # the spare's files this save did not overwrite
                atomic.prune(self.staging, {".metadata", *(getattr(i, "relative_path", None) for i in (metadata.storage_data or {}).values())})
            write_manifest(self.staging, step=self.step, save_id=save_id, format=self.format, layout=self.layout)
            if self.format == "dcp":  # FileSystemWriter(sync_files=True) synced every file, write_manifest its own: the entries remain
                atomic.fsync_dir(self.staging)
            else:  # the safetensors writer does not sync
                atomic.fsync_files(self.staging)
            atomic.publish(self.staging, self.target, keep_spare=self.format == "dcp")
        except OSError as exc:
            self.abandon()
            raise fail("TP608", f"saving to {self.target!r} failed: {exc.strerror or exc} (the previous checkpoint is left as it was)", self.target) from None
        try:
            if self.step is not None:
                steps.record(self.root, self.step)
                steps.retain(self.root, self.step, self.keep)
        except OSError as exc:
            raise fail("TP608", f"{self.target!r} is saved, but recording it in {self.root!r} failed: {exc.strerror or exc}", self.target) from None
        finally:
            atomic.release(self._lock)

    def abandon(self) -> None:
        """Rank 0: a failed save's staging directory goes (the target was never touched)."""
        if self.rank == 0:
            if self.staging:
                shutil.rmtree(self.staging, ignore_errors=True)
            atomic.release(self._lock)

    def failed(self, exc: BaseException) -> CheckpointError:
        """The TP608 of a write that failed (OS error, DCP's report of every rank's failure)."""
        if isinstance(exc, CheckpointError):
            return exc
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
        else:
            reason = errors.reason(exc)
        full = _full(str(Path(self.target).parent))  # torch's serializer can hide ENOSPC behind its own error
        if full and "No space left" not in reason:
            reason += f"; {full}"
        return fail("TP608", f"saving to {self.target!r} failed: {reason} (the previous checkpoint is left as it was)", self.target)

    def failed_async(self, exc: BaseException) -> CheckpointError:
        error = self.failed(exc)  # before the staging directory goes: the free space it filled
        self.abandon()
        return error

    def _hear(self, verdict):
        """Rank 0's verdict ("ok", text) or ("error", why), on every rank: one broadcast of
        a few bytes when it is ok with a short text (the staging directory's name),
        a second one with the message otherwise."""
        if not self.real_group:
            return verdict
        import torch
        import torch.distributed as dist

        short = torch.zeros(1 + _SHORT, dtype=torch.uint8)
        if self.rank == 0:
            kind, text = verdict
            raw = text.encode()
            if kind == "ok" and len(raw) <= _SHORT and b"\0" not in raw:
                short[0] = 1
                short[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else short[1:1]
        dist.broadcast(short, src=0)
        if short[0] == 1:
            return "ok", bytes(short[1:].tolist()).rstrip(b"\0").decode()
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _full(directory: str) -> str | None:
    """'the file system of DIR is full (N bytes free)' when under 1 MiB is left, else None."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    return f"the file system of {directory!r} is full ({free} bytes free)" if free < (1 << 20) else None
