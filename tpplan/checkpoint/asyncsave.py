"""`save_checkpoint(..., async_save=True)`: torch's `dcp.async_save` writes in a
background thread while training goes on; the atomic commit (manifest, rename,
`latest`, retention) runs on rank 0 when the write completes.

DCP copies the state to CPU memory before `async_save` returns (training may
then change the parameters), and coordinates the ranks' writes over a process
group of its own (a gloo group made once: the training's collectives on the
default group cannot interleave with the checkpoint's). Rank 0's write completes
only after every rank's files are written and fsynced and the `.metadata` is, so
it commits without another barrier. The next `save_checkpoint` (and a
`load_checkpoint`) waits for the previous asynchronous save first.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

_PENDING: "AsyncSave | None" = None
_GROUP: Any = None
_LOCK = threading.Lock()


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
