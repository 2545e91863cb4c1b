"""Simulations run at once, each in a forked child process: a dry run's positions
(`tpplan apply --dry-run --jobs N`).

A fork, not a spawn (as fit's workers are): a child starts with the parent's imports and
everything the parent built, where a spawned worker pays two seconds of imports before
its first op, as long as one position of the 405B takes to simulate. A fork is sound
here because a child only simulates: on fake tensors, outside any simulated world (the
fake process group is made in the child), computing no real value (torch's thread pools,
which a fork does not carry, stay unused: the child keeps one thread), printing nothing,
and leaving with `os._exit` (no handler of the parent's runs twice).

A child that fails, or dies, hands its work back: the parent runs it itself, so an error
is raised and reported where it is without `--jobs`. Results are read in the order the
caller asks for them, so the report is the same whatever ran where.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable, Hashable
from typing import BinaryIO, Generic, TypeVar

T = TypeVar("T")


class Forked(Generic[T]):
    """`run(key)` for each key started, up to `jobs - 1` in children while this process
    runs its own work; `result(key)` waits for a child's, or runs a key no child took here.
    With `jobs` 1, or where this process cannot fork, every key runs here when asked for."""

    def __init__(self, jobs: int, run: Callable[[Hashable], T]):
        self.run = run
        self.children = max(0, jobs - 1) if _can_fork() else 0
        self.queued: list[Hashable] = []
        self.running: dict[Hashable, tuple[int, BinaryIO]] = {}  # key -> (pid, the pipe it writes its value to)

    def __enter__(self) -> "Forked[T]":
        return self

    def __exit__(self, *exc) -> None:
        for pid, pipe in self.running.values():  # the caller stopped early (an error): nothing waits for them
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pipe.close()
        self.running.clear()

    def start(self, key: Hashable) -> None:
        """Run `key` in a child as soon as one is free."""
        if key not in self.running and key not in self.queued:
            self.queued.append(key)
            self._fill()

    def result(self, key: Hashable) -> T:
        """`run(key)`'s value: a child's, or computed here (a key not started, or one whose child failed)."""
        if key in self.running:
            found = self._collect(key)
            self._fill()
            return self.run(key) if found is None else found
        if key in self.queued:
            self.queued.remove(key)
        self._fill()  # the others start while this one runs here
        return self.run(key)

    def _fill(self) -> None:
        while self.queued and len(self.running) < self.children:
            key = self.queued.pop(0)
            self.running[key] = self._fork(key)

    def _fork(self, key: Hashable) -> tuple[int, BinaryIO]:
        read, write = os.pipe()
        pid = os.fork()
        if pid:
            os.close(write)
            return pid, os.fdopen(read, "rb")
        code = 1  # the child: its exit code tells the parent whether the pipe holds the value
        try:
            os.close(read)
            _quiet_child()
            payload = pickle.dumps(self.run(key), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            code = 0
        finally:
            os._exit(code)  # an exception ends here too: the parent runs the key again and raises it there

    def _collect(self, key: Hashable) -> T | None:
        """A child's value, or None when it failed or died (its exit code, not the pipe, says)."""
        pid, pipe = self.running[key]  # still running until reaped: an interrupted wait leaves it to __exit__
        payload = pipe.read()
        _, status = os.waitpid(pid, 0)
        pipe.close()
        del self.running[key]
        return pickle.loads(payload) if os.waitstatus_to_exitcode(status) == 0 else None


def _can_fork() -> bool:
    """Whether a child can start here: the platform forks, and no process group is live
    (a child would inherit its connections, and the simulated world needs none)."""
    import torch.distributed as dist

    return hasattr(os, "fork") and not (dist.is_available() and dist.is_initialized())


def _quiet_child() -> None:
    """One thread, and no warning printed: the parent prints its own, and a child writing
    to the parent's terminal would break its progress line."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
