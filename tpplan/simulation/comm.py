"""Failed collectives (a peer died, hung or timed out), told apart from errors of
the model or plan by the exception's type and by where it arose, never by its text."""

from __future__ import annotations

import traceback

from ..core.plan import Plan
from ..core.problems import Problem, error, first_line

# torch.distributed's modules that issue collectives: a RuntimeError raised through
# them is the collective's (gloo raises plain RuntimeErrors for a closed connection).
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py", "_functional_collectives_impl.py")


def _through_collective(exc: BaseException) -> bool:
    return any(frame.filename.endswith(_COLLECTIVE_FILES) for frame in traceback.extract_tb(exc.__traceback__))


def is_comm_failure(exc: BaseException, *, in_collective: bool = False) -> bool:
    """A failed collective, as opposed to an error of the model or plan: a
    `torch.distributed.DistError` (backend, network, store, timeout errors), or a
    RuntimeError raised inside a collective (`in_collective`: the caller issued one,
    or torch.distributed's collective code is on the traceback). Never under the
    fake process group: its collectives cannot fail."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake":
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and (in_collective or _through_collective(exc))


class CommFailure(Exception):
    """A collective failed on this rank; carries the TP504 problem."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def comm_problem(plan: Plan, doing: str, exc: BaseException) -> Problem:
    return error(
        "TP504",
        f"{doing} failed in a collective: {first_line(exc)}; another rank probably died, hung or timed out "
        "(see its output; --timeout bounds the wait)",
        plan.file,
    )
