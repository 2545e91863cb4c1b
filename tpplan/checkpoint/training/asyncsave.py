"""`save_checkpoint(..., async_save=True)`: the state is copied to CPU memory
(`stage`: what the call blocks for; training may then change the parameters),
then `dcp.save` writes the copy in a background thread while training goes on;
the atomic commit (manifest, rename, `latest`, retention) runs on rank 0 when
the write completes.

What `dcp.async_save` does, with two changes for the training's step time:

- the staging copy goes into buffers allocated by the first save and reused by
  the next ones of the same state (torch's `BlockingAsyncStager(
  cache_staged_state_dict=True)`, which needs CUDA for its pinned memory; ours
  pins only where CUDA is): DCP's default stager allocates, deep-copies and
  copies again every time. The buffers (one copy of the state) live as long
  as the process, or until a save of another state;
- the writer thread runs at nice 19 (Linux: a thread's own priority), so the
  ranks' training takes the cores first and the write fills the time they
  leave (collectives, I/O); on other systems it runs at the process's.

The write coordinates the ranks over a process group of its own (a gloo group
made once: the training's collectives on the default group cannot interleave
with the checkpoint's). Rank 0's write completes only after every rank's files
are written and fsynced and the `.metadata` is, so it commits without another
barrier. The next `save_checkpoint` (and a `load_checkpoint`) waits for the
previous asynchronous save first.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

_PENDING: "AsyncSave | None" = None
_GROUP: Any = None
_LOCK = threading.Lock()
_STAGED: dict[str, Any] = {"layout": None, "buffers": None}  # the staging buffers of the last state and its layout
WRITER_NICE = 19


class AsyncSave:
    """A save in flight. `wait()` returns the checkpoint's path once it is committed
    (on rank 0; on the other ranks once their part is written) or raises its
    CheckpointError; `done()` says whether it has finished."""

    def __init__(self, path: str, step: int | None):
        self.path = path
        self.step = step
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        global _PENDING
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                with _LOCK:
                    if _PENDING is self:
                        _PENDING = None

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"AsyncSave({self.path!r}, step={self.step}, {state})"


def start(path: str, step: int | None, write: Callable[[], concurrent.futures.Future | None],
          commit: Callable[[Any], None], fail: Callable[[BaseException], BaseException]) -> AsyncSave:
    """Run `write()` (which returns DCP's upload future, or None when this rank writes
    nothing), then `commit(metadata)` when it completes; `fail(exc)` turns a failure
    into the error `wait()` raises (and cleans up)."""
    global _PENDING
    handle = AsyncSave(path, step)

    def finished(upload: concurrent.futures.Future | None) -> None:
        try:
            metadata = upload.result() if upload is not None else None
            commit(metadata)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            handle._future.set_exception(fail(exc))
            return
        handle._future.set_result(path)

    upload = write()
    with _LOCK:
        _PENDING = handle
    if upload is None:
        finished(None)
    else:
        upload.add_done_callback(finished)
    return handle


def wait_pending() -> None:
    """Block until the previous asynchronous save has finished; its failure is raised here."""
    pending = _PENDING
    if pending is not None:
        pending.wait()


def process_group():
    """The gloo group asynchronous saves coordinate over (made on first use: every rank calls it)."""
    global _GROUP
    import torch.distributed as dist

    world = dist.group.WORLD
    if _GROUP is None or _GROUP[0] is not world:  # a new default group: a new group of ours
        _GROUP = (world, dist.new_group(backend="gloo"))
    return _GROUP[1]


def stage(state: dict) -> dict:
    """A copy of `state` in CPU memory, in the buffers of the previous save of the same
    layout (keys, shapes, dtypes, placements) when there was one."""
    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    layout = _layout(state)
    if _STAGED["layout"] != layout:
        _STAGED["buffers"] = None  # another state: its buffers go
        _STAGED["buffers"] = _create_cpu_state_dict(state, pin_memory=torch.cuda.is_available())
        _STAGED["layout"] = layout
    return _copy_state_dict(state, _STAGED["buffers"], type_check=False)  # non-tensor values (extra) are this call's


def _layout(value: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return tuple((k, _layout(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_layout(v) for v in value))
    if isinstance(value, DTensor):
        return ("dtensor", tuple(value.shape), value.dtype, tuple(value.placements), id(value.device_mesh), _layout(value._local_tensor))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    return type(value).__name__


def in_background(write: Callable[[], Any]) -> concurrent.futures.Future:
    """Run `write()` in a thread of its own at nice WRITER_NICE; its result (or error) in the future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)  # Linux: this thread alone
            except OSError:  # a sandbox refusing it: the write runs at the process's priority
                pass
        try:
            result = write()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            future.set_exception(exc)
            return
        future.set_result(result)

    threading.Thread(target=run, name="tpplan-checkpoint-writer").start()  # not a daemon: a write finishes before exit
    return future
