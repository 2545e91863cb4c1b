"""What `tpplan apply` found, as data, and its JSON object (SPEC §4). The text
tables are `render.apply_report`'s; nothing here imports torch or rich.

The JSON keys of SPEC §4 (`ok`, `problems`, `world_size`, `modules`, `params`,
`comms`, `check`) always appear with exactly the shapes it fixes; details the
SPEC leaves open (`mode`, `tp`, `dp`, `parameters`, `step_time_s`, `steps`,
...) are extra keys beside them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..check.result import CheckResult
from ..core.problems import Problem
from ..simulation.layouts import ParamLayout



@dataclass
class StepsResult:
    losses: list[float]
    step_times_s: list[float]
    optimizer: str = "SGD"
    max_abs_diff: float | None = None  # --check: the trained parameters against one device

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    def to_json(self) -> dict:
        return {"n": len(self.losses), "losses": self.losses, "median_step_s": self.median_step_s, "optimizer": self.optimizer, "max_abs_diff": self.max_abs_diff}


@dataclass
class ApplyReport:
    mode: str  # "dry-run" (simulated ranks) or "torchrun" (real ranks)
    plan_file: str
    model: str
    world_size: int = 0
    tp: int = 0
    dp: int = 1
    plan_name: str | None = None
    device: str | None = None  # "fake" (a dry run on fake tensors), "cpu", "cuda", "npu"
    backend: str | None = None  # "fake", "gloo", "nccl", "hccl"
    modules: dict[str, str] = field(default_factory=dict)  # fqn -> style
    rule_of: dict[str, str] = field(default_factory=dict)  # fqn -> rule pattern
    rule_where: dict[str, str] = field(default_factory=dict)  # rule pattern -> file:line
    params: list[ParamLayout] = field(default_factory=list)
    comms: dict[str, dict[str, int]] | None = None
    check: CheckResult | None = None
    step_time_s: float | None = None
    steps: StepsResult | None = None
    problems: list[Problem] = field(default_factory=list)
    # Memory planning (memory/memory.py): per-rank peak, bytes per collective, the degrees tried.
    memory: Any = None  # memory_report.MemoryReport
    comm_bytes: dict[str, dict[str, int]] | None = None
    optimizer_comms: dict | None = None
    memory_sweep: list = field(default_factory=list)  # memory_report.DegreeFit rows
    notes: list[str] = field(default_factory=list)  # what the run chose for the user (e.g. a default --tp)
    checkpoint: dict | None = None  # --checkpoint: what was (or would be) loaded, see tpplan.checkpoint.inspect
    saved: dict | None = None  # --save: {"path", "format"}
    mesh: dict[str, int] | None = None  # the device mesh's dims, outermost first {name: size} (SPEC §7)
    # Memory planning (a dry run's world): collectives per mesh axis {axis: {phase: {op: {"count", "bytes"}}}} of
    # the worst rank, and each simulated position (memory_dryrun.RankPlan), SPEC §7
    comms_by_axis: dict[str, Any] | None = None
    ranks: list = field(default_factory=list)
    context_parallel: dict | None = None  # a dry run with CP: this rank's shapes, the ring's collectives (runtime/dryrun_cp.py)
    pipeline: dict | None = None  # a pipelined run: schedule, microbatches, each stage's modules and pp rank (SPEC §8)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems) and (self.check is None or self.check.passed)

    @property
    def total_bytes(self) -> int:
        return sum(p.global_bytes for p in self.params)

    @property
    def rank_bytes(self) -> list[int]:
        """Parameter bytes held by each TP rank."""
        return [sum(p.rank_bytes(r) for p in self.params) for r in range(self.tp)] if self.params else []

    @property
    def per_rank_bytes(self) -> int:
        """The most any rank holds: what must fit on one device."""
        return max(self.rank_bytes, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems],
            "world_size": self.world_size,
            "modules": dict(self.modules),
            "params": {"total_bytes": self.total_bytes, "per_rank_bytes": self.per_rank_bytes},
            "comms": self.comms or {"forward": {}, "backward": {}},
            "check": self.check.to_json() if self.check else None,
            # Beyond SPEC §4:
            "mode": self.mode,
            "plan": self.plan_file,
            "model": self.model,
            "tp": self.tp,
            "dp": self.dp,
            "device": self.device,
            "backend": self.backend,
            "rank_bytes": self.rank_bytes,
            "parameters": {p.name: p.to_json() for p in self.params},
            "step_time_s": self.step_time_s,
            "steps": self.steps.to_json() if self.steps else None,
            "checkpoint": self.checkpoint,
            "saved": self.saved,
            "notes": list(self.notes),  # what the run chose or changed for the user (e.g. dropout off for --check)
            **({"mesh": dict(self.mesh)} if self.mesh is not None else {}),
            **({"context_parallel": self.context_parallel} if self.context_parallel is not None else {}),
            **({"pipeline": self.pipeline} if self.pipeline is not None else {}),
            **self._memory_json(),
        }

    def _memory_json(self) -> dict[str, Any]:
        """SPEC §4's `memory` and `comm_bytes`, with memory planning only."""
        if self.memory is None:
            return {}
        found = {"memory": self.memory.to_json(), "comm_bytes": self.comm_bytes or {"forward": {}, "backward": {}}}
        if self.optimizer_comms is not None:
            found["optimizer_comms"] = self.optimizer_comms
        if self.memory_sweep:
            found["memory_by_tp"] = [row.to_json() for row in self.memory_sweep]
        if self.comms_by_axis is not None:
            found["comms_by_axis"] = self.comms_by_axis
        if self.ranks:
            found["ranks"] = [rank.to_json() for rank in self.ranks]
        return found

