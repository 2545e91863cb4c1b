"""A check's verdict as data (`CheckResult`), which the check engine returns and the
apply report carries; nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """How a tensor-parallel run compares with its single-device reference
    (`check.verify`): the verdict, the worst difference, why it did not pass
    (the first difference first) and each compared tensor's difference."""

    passed: bool
    max_abs_diff: float  # over the outputs and every parameter gradient
    problems: list[str] = field(default_factory=list)  # why it did not pass, in comparison order
    diffs: dict[str, float] = field(default_factory=dict)  # compared tensor -> max abs diff
    comms: dict[str, dict[str, int]] | None = None  # collectives of the compared run, when counted
    notes: list[str] = field(default_factory=list)  # what the check did to make the runs comparable (dropout off)
    located: Any = None  # first_difference.Located of a failed check: the first differing tensor and its rule
    replicas: list = field(default_factory=list)  # replicas.ReplicaDifference: replicated values that differ by rank

    @property
    def first_difference(self) -> str | None:
        return self.problems[0] if self.problems else None

    @property
    def out_diff(self) -> float:
        return max((d for name, d in self.diffs.items() if name.startswith("output")), default=0.0)

    @property
    def grad_diffs(self) -> dict[str, float]:
        """Parameter fqn -> max abs diff of its gradient."""
        return {name.removesuffix(" grad"): d for name, d in self.diffs.items() if name.endswith(" grad")}

    def to_json(self) -> dict:
        return {"passed": self.passed, "max_abs_diff": self.max_abs_diff}
