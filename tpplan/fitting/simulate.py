"""Each layout's exact simulation: the dry run of its written plan (`runtime.dryrun.dry_run`,
given no flags: the plan's `training` section sizes the step, as `tpplan apply --dry-run`
of the written file does), `jobs` at a time in worker processes. A pipelined layout
whose 1F1B or GPipe twin ran before in the same process takes that run's stages and
composes its own ranks (memory/pipeline_dryrun.shared_stages): the same figures.

Workers are spawned, not forked (torch's thread pools do not survive a fork); each pays
its imports once. Results come back in the order the layouts were sent, so a search
reads them as if they had run one after another.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Simulated:
    """What a layout's dry run says: its worst rank's peak and where, its collectives per
    axis (SPEC §7's comms_by_axis), or the located plan problem that refused it."""

    peak_bytes: int = 0
    peak_where: str = ""
    comms_by_axis: dict[str, Any] | None = None
    refused: tuple[str, str] | None = None  # (code, message)


def dry_run_text(text: str, model: str, reuse_blocks: bool) -> Simulated:
    """The dry run of the plan `text` (its `extends:` an absolute path) on `model`."""
    from ..core.problems import PlanError
    from ..memory.pipeline_dryrun import shared_stages
    from ..runtime.dryrun import dry_run
    from ..runtime.options import ApplyOptions

    with tempfile.TemporaryDirectory(prefix="tpplan-fit-") as folder:
        path = os.path.join(folder, "layout.yaml")
        with open(path, "w") as handle:
            handle.write(text)
        with warnings.catch_warnings():
            # torch's advice on a root module's output view, repeated for every layout; the
            # simulated step never changes the output in place
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            try:
                with shared_stages():  # layouts that differ only in a one-stage schedule share their stages
                    report = dry_run(ApplyOptions(plan=path, model=model, reuse_blocks=reuse_blocks))
            except PlanError as exc:
                return Simulated(refused=(exc.problems[0].code, exc.problems[0].message))
    if report.problems:
        return Simulated(refused=(report.problems[0].code, report.problems[0].message))
    return Simulated(report.memory.per_rank_peak_bytes, report.memory.peak_module or "", report.comms_by_axis or {})


def _spawnable() -> bool:
    """Whether a spawned worker can import this process's main module, as spawn does
    (a script read from standard input cannot be: its dry runs then run here)."""
    import sys

    main = sys.modules["__main__"]
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return path is None or os.path.exists(path)


class Simulations:
    """Dry runs `jobs` at a time (1, or a main module spawn cannot import: in this process)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Simulations":
        if self.jobs > 1 and _spawnable():
            import multiprocessing

            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def submit(self, run: Callable[..., Simulated], *args: Any) -> "Future[Simulated]":
        if self._pool is not None:
            return self._pool.submit(run, *args)
        done: Future[Simulated] = Future()
        done.set_result(run(*args))
        return done
