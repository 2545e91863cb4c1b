"""What `tpplan apply` found, as data, and its two renderings: the JSON object of
SPEC §4 and rich text tables.

The JSON keys of SPEC §4 (`ok`, `problems`, `world_size`, `modules`, `params`,
`comms`, `check`) always appear with exactly the shapes it fixes; details the
SPEC leaves open (`mode`, `tp`, `dp`, `parameters`, `step_time_s`, `steps`,
...) are extra keys beside them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..core.globs import generalize
from ..core.problems import Problem


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: its full shape and what each TP rank holds of it."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    local_shapes: tuple[tuple[int, ...], ...]  # one per TP rank
    placements: str  # "Shard(0)", "Replicate()"; "-" for a plain (unsharded) tensor
    element_size: int

    @property
    def global_bytes(self) -> int:
        return math.prod(self.global_shape) * self.element_size

    def rank_bytes(self, rank: int) -> int:
        return math.prod(self.local_shapes[rank]) * self.element_size

    @property
    def uneven(self) -> bool:
        return len(set(self.local_shapes)) > 1

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "local_shapes": [list(s) for s in self.local_shapes],
            "placements": self.placements,
        }


@dataclass
class CheckResult:
    passed: bool
    max_abs_diff: float
    problems: list[str] = field(default_factory=list)  # why it did not pass, first few

    def to_json(self) -> dict:
        return {"passed": self.passed, "max_abs_diff": self.max_abs_diff}


@dataclass
class StepsResult:
    losses: list[float]
    step_times_s: list[float]
    optimizer: str = "SGD"

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    def to_json(self) -> dict:
        return {"n": len(self.losses), "losses": self.losses, "median_step_s": self.median_step_s, "optimizer": self.optimizer}


@dataclass
class ApplyReport:
    mode: str  # "dry-run" (simulated ranks) or "torchrun" (real ranks)
    plan_file: str
    model: str
    world_size: int = 0
    tp: int = 0
    dp: int = 1
    plan_name: str | None = None
    device: str | None = None  # "meta", "cpu", "cuda", "npu"
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
    # Memory planning (render/memory.py): per-rank peak, bytes per collective, the degrees tried.
    memory: Any = None
    comm_bytes: dict[str, dict[str, int]] | None = None
    optimizer_comms: dict | None = None
    memory_sweep: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the run chose for the user (e.g. a default --tp)

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
        return found


# -- text ----------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """(first index, last index, value) of each run of equal values: eight equal
    ranks print as one row."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], i, value)
        else:
            runs.append((i, i, value))
    return runs


def render_text(report: ApplyReport, console) -> None:
    """Print the report as rich tables on `console` (problems are the caller's to print)."""
    from rich.table import Table
    from rich.text import Text

    def row(table: Table, *cells: str) -> None:
        # Text, not markup: globs such as 'blocks.[0-3]' would read as rich markup.
        table.add_row(*(Text(cell) for cell in cells))

    where = f"{report.world_size} simulated ranks (fake process group, {report.device} tensors)" if report.mode == "dry-run" else (
        f"world {report.world_size}" + (f" = dp {report.dp} x tp {report.tp}" if report.dp > 1 else "") + f", {report.backend} on {report.device}"
    )
    console.print(Text.assemble(("tpplan apply", "bold"), f" {report.plan_name or report.plan_file} on {report.model}: {where}"))
    for note in report.notes:
        console.print(Text(f"note: {note}"))

    if report.modules:
        table = Table(title="Modules and styles", title_justify="left")
        for column in ("rule", "style", "modules", "where"):
            table.add_column(column, justify="right" if column == "modules" else "left")
        by_rule: dict[str, list[str]] = {}
        for fqn, pattern in report.rule_of.items():
            by_rule.setdefault(pattern, []).append(fqn)
        for pattern, fqns in by_rule.items():
            shown = fqns[0] or "<root>"
            count = f"{len(fqns)}" if len(fqns) > 1 else shown
            row(table, pattern or '""', report.modules[fqns[0]], count, report.rule_where.get(pattern, ""))
        console.print(table)

    if report.params:
        table = Table(title=f"Parameters at TP {report.tp}", title_justify="left")
        for column, justify in (("parameter", "left"), ("count", "right"), ("global", "left"), ("per rank", "left"), ("placement", "left"), ("on rank 0", "right")):
            table.add_column(column, justify=justify)
        groups: dict[tuple, list[ParamLayout]] = {}
        for p in report.params:
            # layers.12.attention.wq.weight -> layers.*.attention.wq.weight: repeated blocks
            # collapse into one row, so a 32-layer model prints like a 2-layer one.
            groups.setdefault((generalize(p.name), p.global_shape, p.local_shapes, p.placements, p.dtype), []).append(p)
        for (family, global_shape, local_shapes, placements, _), members in groups.items():
            local = " | ".join(_shape(s) for s in local_shapes) + " (uneven)" if members[0].uneven else _shape(local_shapes[0])
            row(table, family, str(len(members)), _shape(global_shape), local, placements, human_bytes(sum(m.rank_bytes(0) for m in members)))
        console.print(table)
        table = Table(title="Parameter memory", title_justify="left")
        for column in ("ranks", "bytes", "size"):
            table.add_column(column, justify="left" if column == "ranks" else "right")
        for first, last, held in _runs(report.rank_bytes):
            ranks = f"{first}" if first == last else f"{first}-{last}"
            row(table, f"rank {ranks}" if first == last else f"ranks {ranks}", str(held), human_bytes(held))
        row(table, "all (unsharded)", str(report.total_bytes), human_bytes(report.total_bytes))
        console.print(table)

    if report.comms is not None:
        sizes = report.comm_bytes  # with memory planning: bytes per rank beside the counts
        table = Table(title="Collectives" + (" per rank, one training step" if sizes else ""), title_justify="left")
        columns = (("forward pass", "forward bytes", "backward pass", "backward bytes") if sizes else ("forward pass", "backward pass"))
        for column, justify in (("op", "left"), *((c, "right") for c in columns)):
            table.add_column(column, justify=justify)
        ops = sorted(set(report.comms["forward"]) | set(report.comms["backward"]))
        for op in ops:
            cells = [op]
            for phase in ("forward", "backward"):
                cells.append(str(report.comms[phase].get(op, 0)))
                if sizes:
                    cells.append(human_bytes(sizes[phase].get(op, 0)))
            row(table, *cells)
        if not ops:
            row(table, "(none)", *("0" for _ in columns))
        console.print(table)

    if report.memory is not None:
        from .memory import render_memory

        render_memory(report.memory, report.memory_sweep, console)

    if report.step_time_s is not None:
        console.print(f"step time (forward + backward): {report.step_time_s * 1e3:.2f} ms")
    if report.steps is not None:
        losses = report.steps.losses
        console.print(
            f"{len(losses)} {report.steps.optimizer} steps: loss {losses[0]:.6g} -> {losses[-1]:.6g}, "
            f"median step {report.steps.median_step_s * 1e3:.2f} ms"
        )
    if report.check is not None:
        verdict = "[green]passed[/green]" if report.check.passed else "[red]FAILED[/red]"
        console.print(f"check against a single device: {verdict}, max |diff| {report.check.max_abs_diff:.3g}")
        for line in report.check.problems:
            console.print(f"  {line}", markup=False)
