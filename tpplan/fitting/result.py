"""What `tpplan fit` answers (SPEC §9), as data: the options, each layout that fits
with its peak and its step, the rejected layouts (space.Rejected), the JSON."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..core.axes_spec import AXES
from .simulate import dry_run_text
from .space import Layout, Rejected


class FitError(ValueError):
    """The search cannot be done as asked (the CLI exits 2)."""


@dataclass(frozen=True)
class FitOptions:
    model: str
    world: int
    memory_bytes: int
    seq: int
    global_batch: int
    plan: str | None  # the TP rules (a version 1 or 2 plan; None: init's, inferred.py); its context_parallel section names the attention for cp > 1
    gpu: Any  # cost.GPU
    gpus_per_node: int = 8
    dtype: str = "bf16"
    optimizer: str = "adamw"
    axes: tuple[str, ...] = AXES  # ep: where the base plan has experts
    top: int = 3
    exhaustive: bool = False
    reuse_blocks: bool = True
    jobs: int = 1  # dry runs at once, in worker processes


@dataclass(frozen=True)
class Ranked:
    """A layout that fits: its exact peak (the dry run's worst rank), the step's estimate, Megatron's peak."""

    layout: Layout
    peak_bytes: int
    step: Any  # cost.StepTime
    tokens_per_second_per_gpu: float
    megatron_peak_bytes: int | None
    peak_where: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.to_json(), "peak_bytes": self.peak_bytes, "fits": True, "step_seconds": self.step.total,
                "compute_seconds": self.step.compute, "comm_seconds": self.step.comm, "bubble_seconds": self.step.bubble,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu, "megatron_peak_bytes": self.megatron_peak_bytes}


@dataclass
class FitResult:
    options: FitOptions
    ranked: list[Ranked]
    rejected: list[Rejected]
    assumptions: dict[str, Any]
    considered: int = 0
    simulated: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    rules: str | None = None  # init's plan when no base plan was given (inferred.py): write it beside the best
    _plans: Any = field(default=None, repr=False, compare=False)  # layout_plans.LayoutPlans: evaluate's

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    def plan_text(self, ranked: Ranked | None = None, output: str | None = None, base: str | None = None) -> str:
        """The plan of `ranked` (default the best layout), its `extends:` relative to `output`,
        where it is written (default: the base plan's absolute path); `base`: where the base
        plan is (default the one searched with; `rules` written elsewhere)."""
        chosen = ranked or self.best
        assert chosen is not None
        base = os.path.abspath(base or self.options.plan)
        relative = os.path.relpath(base, os.path.dirname(os.path.abspath(output))) if output is not None else None
        return self._plans.text(chosen.layout, extends=relative)

    @staticmethod
    def rules_written_to(output: str) -> str:
        """Where init's rules go beside the best plan written to `output` (its `extends:`)."""
        stem, _ = os.path.splitext(output)
        return f"{stem}.rules.yaml"

    def evaluate(self, layout: Layout) -> "Ranked | Rejected":
        """`layout` simulated and costed as the search does it: one it ranked out, or one
        to compare with the top (a published layout)."""
        plans = self._plans
        return plans.verdict(layout, dry_run_text(plans.text(layout), self.options.model, self.options.reuse_blocks))

    def counts(self) -> dict[str, int]:
        kinds = {"check": 0, "search": 0, "memory": 0, "ranked out": 0}
        for rejected in self.rejected:
            kinds[rejected.kind] += 1
        return {"considered": self.considered, "rejected_by_checks": kinds["check"], "rejected_by_search": kinds["search"],
                "rejected_by_memory": kinds["memory"], "ranked_out": kinds["ranked out"], "simulated": self.simulated,
                "fitting": len(self.ranked)}

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {"layouts": [ranked.to_json() for ranked in self.ranked],
                "rejected": [rejected.to_json() for rejected in self.rejected],
                "assumptions": self.assumptions, "plan": self.plan_text() if best else None,
                # beyond SPEC §9:
                "counts": self.counts(), "seconds": round(self.seconds, 3), "notes": self.notes,
                "rules": self.rules}  # init's plan, which "plan" extends, where no base plan was given
