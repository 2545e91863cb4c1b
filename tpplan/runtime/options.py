"""What a `tpplan apply` run is asked to do, and the typed errors for a run that
cannot be done as asked. The library names the option (a field of
`ApplyOptions`) and why; the CLI words them in its own flag names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..simulation.training import TrainOptions, data_ranks

DEFAULT_TIMEOUT_S = 300.0


class UsageError(ValueError):
    """The run cannot be done as asked (the CLI exits 2)."""


class ApplyOptionsError(UsageError):
    """An option of the run cannot be used as given.

    `option`: the `ApplyOptions` field ("tp", "device", "steps", "plan"), or
    "launch" for the environment torchrun sets; `kind`: which check failed (a
    stable key for the CLI's wording); `facts`: the values it quotes."""

    def __init__(self, option: str, kind: str, reason: str, **facts: Any):
        self.option, self.kind, self.reason, self.facts = option, kind, reason, facts
        super().__init__(f"{option}: {reason}")

    def __reduce__(self):  # pickled between ranks in the plan consensus
        return (_rebuild, (self.option, self.kind, self.reason, self.facts))

    def __repr__(self) -> str:
        return f"ApplyOptionsError({self.option!r}, {self.kind!r}, {self.reason!r}, **{self.facts!r})"


def _rebuild(option: str, kind: str, reason: str, facts: dict) -> ApplyOptionsError:
    return ApplyOptionsError(option, kind, reason, **facts)


def refuse_unapplied(plan: Any, by: str = "torchrun") -> None:
    """An ApplyOptionsError (a usage error: exit 2) where a version 2 plan sets axes or
    sections that this tpplan checks but `by` (torchrun, the dry run) does not apply yet
    (core/axes.py says which)."""
    from ..core.axes import NotAppliedError, refuse_unapplied as refuse

    try:
        refuse(plan, by)
    except NotAppliedError as exc:
        raise ApplyOptionsError("plan", "not-applied", str(exc.problem)) from None


class RanksUsageError(UsageError):
    """Usage errors of the ranks of a torchrun job: (ranks that had it, or None
    when every rank did, the error) each."""

    def __init__(self, errors: list[tuple[str | None, BaseException]]):
        self.errors = errors
        super().__init__("\n".join(f"{ranks}: {exc}" if ranks else str(exc) for ranks, exc in errors))


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
    checkpoint: str | None = None  # load into the sharded model (tpplan.checkpoint)
    save: str | None = None  # save the sharded model after the run
    save_format: str = "dcp"
    allow_missing: tuple[str, ...] = ()
    train: TrainOptions = TrainOptions()  # memory planning (dry run), FSDP2 and the optimizer of --steps
    reuse_blocks: bool = True  # memory planning: simulate identical repeated blocks once (memory/reuse.py)
    world: int | None = None  # dry run of a version 2 plan: the world size its mesh takes (-1 resolved)
    every_rank: bool = False  # memory planning: simulate every rank, not one per distinct position
    jobs: int = 1  # memory planning: positions simulated at once, each past the first in a forked child (simulation/forked.py)


_SECTION_FIELDS = (("global_batch", "batch"), ("seq", "seq"), ("dtype", "dtype"), ("optimizer", "optimizer"))  # (the section's, the flag's)


def with_training(options: ApplyOptions, plan: Any) -> ApplyOptions:
    """The step a dry run plans (SPEC §7): `options` with a version 2 plan's `training`
    section filled in under the flags, each field where its flag (--batch, --seq, --dtype,
    --optimizer) was not given. The global batch is kept whole: each data-parallel rank's
    share depends on the mesh resolved (`TrainOptions.batch_at`). Options unchanged for a
    plan without the section."""
    section = getattr(plan, "training", None)
    if section is None:
        return options
    train = options.train
    filled = {field: getattr(section, field) for field, flag in _SECTION_FIELDS
              if getattr(train, flag) is None and getattr(section, field) is not None}
    if not filled:
        return options
    return dataclasses.replace(options, train=dataclasses.replace(train, **filled, from_plan=tuple(filled)))


def training_note(train: TrainOptions, sizes: Mapping[str, int]) -> list[str]:
    """What the step took from the plan's training section, on a mesh of `sizes`
    ({axis: size}): a note for the report, none when the flags gave everything."""
    if not train.from_plan:
        return []
    parts = []
    for field in train.from_plan:
        if field == "global_batch":
            dp = data_ranks(sizes)
            parts.append(f"global_batch {train.global_batch} over dp {dp} → batch {train.batch_at(sizes)} per rank")
        else:
            parts.append(f"{field} {getattr(train, field)}")
    return [f"training: {', '.join(parts)} (from the plan's training section; --batch, --seq, --dtype, --optimizer override it)"]


def input_size(options: ApplyOptions, plan: Any, sizes: Mapping[str, int]) -> dict[str, int]:
    """The default inputs' batch and seq under torchrun, on a mesh of `sizes`: --batch and
    --seq, else the plan's training section (its global batch split over the data-parallel
    ranks); what neither gives is make_inputs' default."""
    train = with_training(options, plan).train
    given = {"batch": train.batch_at(sizes), "seq": train.seq}
    return {name: value for name, value in given.items() if value is not None}
