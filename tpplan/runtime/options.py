"""What a `tpplan apply` run is asked to do, and the error for options that cannot be run."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 300.0


class UsageError(ValueError):
    """The run cannot be done as asked (the CLI exits 2)."""


@dataclass(frozen=True)
class ApplyOptions:
    plan: str
    model: str
    tp: int | None = None
    check: bool = False
    steps: int = 0
    inputs: str | None = None
    device: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S
    seed: int = 0
