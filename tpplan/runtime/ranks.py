"""What one rank of a `tpplan apply` torchrun job knows (`Rank`), what applying the
plan there found (`Ran`) and `--checkpoint`'s load: shared by the plain run
(runtime/torchrun.py) and the pipelined one (runtime/pipelined.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..check.result import CheckResult
from ..core.plan import Plan
from ..core.problems import Problem
from ..simulation.comm import CommFailure, comm_problem
from ..simulation.layouts import ParamLayout
from ..simulation.locate import Sharded
from .report import StepsResult

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .options import ApplyOptions


@dataclass
class Rank:
    rank: int
    world: int
    device: "torch.device"
    backend: str
    control: Any  # gloo group for object collectives (consensus, results)

    def gather(self, value: Any, plan: Plan, doing: str) -> list[Any]:
        """Every rank's `value`, in rank order; a broken group is a located CommFailure."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(values, value, group=self.control)
        except RuntimeError as exc:
            raise CommFailure(comm_problem(plan, doing, exc)) from None
        return values


@dataclass
class Ran:
    """What applying the plan and running the model found, as far as it got
    (`problems`: why it stopped)."""

    tp: int
    dp: int  # the data-parallel ranks: dp_replicate·dp_shard, or --fsdp's dp
    mesh: dict[str, int] = field(default_factory=dict)
    data_parallel: bool = False  # FSDP2 (HSDP) shards the data axes (or the experts over efsdp)
    sharded: Sharded | None = None
    params: list[ParamLayout] = field(default_factory=list)
    comms: dict | None = None
    step_time_s: float | None = None
    check: CheckResult | None = None
    steps: StepsResult | None = None
    checkpoint: dict | None = None
    saved: dict | None = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipeline: dict | None = None  # the stages and schedule of a pipelined run (runtime/pipelined.py)


def load_checkpoint_of(ctx: Rank, options: "ApplyOptions", model: "nn.Module", ran: Ran, event) -> "nn.Module | None":
    """Load --checkpoint into the sharded meta model (each rank its slices); with
    --check, also into a single-device reference, which the check then compares
    as it is (not with the sharded weights copied in)."""
    from ..checkpoint.run import load_into
    from ..simulation.modelref import build_model

    event(f"loading {options.checkpoint}")
    ran.checkpoint = load_into(model, options.checkpoint, options.allow_missing, ctx.device, ran.mesh)
    if not options.check:
        return None
    event(f"loading {options.checkpoint} on a single device for --check")
    reference = build_model(options.model, "meta", real_buffers=True)
    load_into(reference, options.checkpoint, options.allow_missing, ctx.device, {})
    return reference


