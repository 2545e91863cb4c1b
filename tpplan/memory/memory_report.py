"""The memory plan of `apply --dry-run`, as data (no torch, no rich): per-rank
peak of one training step by category, and the rows of the "which TP degrees
fit" table. render/memory.py prints it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass
class MemoryReport:
    """Per-rank memory at the peak of one training step (bytes)."""

    tp: int
    dp: int
    per_rank_peak_bytes: int
    categories: dict[str, int]  # CATEGORIES -> bytes at the peak
    peak_module: str  # where the peak happens, e.g. "layers.3.feed_forward (backward)"
    limit_bytes: int | None = None
    batch: int = 0
    seq: int = 0
    dtype: str = ""
    optimizer: str = ""
    steady: dict[str, int] = field(default_factory=dict)  # after the step (gradients freed): what stays between steps
    reuse: Any = None  # reuse.BlockReuse: the blocks simulated once and reused, when there were

    @property
    def fits(self) -> bool | None:
        return None if self.limit_bytes is None else self.per_rank_peak_bytes <= self.limit_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "per_rank_peak_bytes": self.per_rank_peak_bytes,
            **{name: self.categories.get(name, 0) for name in CATEGORIES},
            "peak_module": self.peak_module,
            "fits": self.fits,
            # Beyond SPEC §4:
            "limit_bytes": self.limit_bytes,
            "tp": self.tp,
            "dp": self.dp,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "optimizer_name": self.optimizer,
            "after_step": dict(self.steady),
            "block_reuse": self.reuse.to_json() if self.reuse is not None else None,
        }


@dataclass(frozen=True)
class DegreeFit:
    """One row of the "which TP degrees fit" table."""

    tp: int
    dp: int
    per_rank_peak_bytes: int | None  # None: the degree failed (see problem)
    fits: bool | None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "dp": self.dp, "per_rank_peak_bytes": self.per_rank_peak_bytes, "fits": self.fits, "problem": self.problem}
