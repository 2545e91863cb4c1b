"""A world of ranks in one process: torch's threaded process group (each rank a thread,
collectives performed on the threads' real tensors), for code whose Python branches on
its rank (torch's ring attention chooses each block's causal mask by `dist.get_rank`),
which `LocalTensorMode`'s one Python program over all ranks cannot run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def run_threaded(world: int, fn: Callable[[int], T]) -> list[T]:
    """[fn(rank) for each rank], each on its own thread, in one process group of `world`
    ranks; the first rank's error is raised (the others are woken from their collectives)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}
    store = dist.HashStore()

    def worker(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[rank] = exc
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting for this one
        finally:
            dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if errors:
        raise errors[min(errors)]
    return [results[rank] for rank in range(world)]
