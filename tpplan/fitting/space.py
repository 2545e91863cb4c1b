"""The layouts `tpplan fit` weighs (SPEC §9), without torch: every way to split
the world over the axes asked for, with activation checkpointing off or on and,
with a pipeline, each schedule and microbatch count; where the base plan places
experts over ep, each ep its ranks can borrow (SPEC §7: ep is no factor of the
world, it divides dp_shard·cp·tp); each one written as the version 2 plan it
is, and checked by the plan's own located checks (`core/axes.sized_problems`)
before anything is simulated.

Two rules of the search itself, stated in the report: tensor parallelism stays
inside a node (tp ≤ --gpus-per-node: its collectives are on every layer's
critical path), and the pipeline's stages are the model's blocks split as evenly
as the count allows, the remainder going to the middle stages (the first and
last also hold the embeddings and the head).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.axes_spec import AXES, WORLD_AXES

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")  # the schedules weighed; the zero-bubble ones are composed approximately
INTERLEAVED_VIRTUAL = 2  # Interleaved1F1B's stages per rank


@dataclass(frozen=True)
class Layout:
    """One layout: the size of every axis (SPEC §7's order), activation checkpointing,
    and with pp > 1 the schedule, its microbatch count and stages per rank."""

    sizes: tuple[int, ...]  # AXES' order: pp, dp_replicate, dp_shard, cp, tp, ep
    checkpointing: bool
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int = 1

    @property
    def mesh(self) -> dict[str, int]:
        return dict(zip(AXES, self.sizes))

    @property
    def dp(self) -> int:
        mesh = self.mesh
        return mesh["dp_replicate"] * mesh["dp_shard"]

    def describe(self) -> str:
        """`pp 16 · dp_shard 128 · tp 8, AC, 1F1B × 16`: the axes above 1, then the rest."""
        mesh = " · ".join(f"{axis} {size}" for axis, size in self.mesh.items() if size > 1) or "one rank"
        pipe = f", {self.schedule} × {self.microbatches}" + (f" (v {self.virtual_stages})" if self.virtual_stages > 1 else "") \
            if self.schedule else ""
        return mesh + (", AC" if self.checkpointing else "") + pipe

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "checkpointing": self.checkpointing, "microbatches": self.microbatches, "schedule": self.schedule}


@dataclass(frozen=True)
class Rejected:
    """A layout dropped before or after its simulation, and why (`kind`: "check", "search",
    "memory" or "ranked out"; `code`: the check's code where a plan check dropped it)."""

    layout: Layout
    kind: str
    reason: str
    code: str | None = None
    peak_bytes: int | None = None  # simulated and over the memory
    bound_seconds: float | None = None  # ranked out: its step takes at least this long

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.to_json(), "kind": self.kind, "code": self.code, "reason": self.reason, "peak_bytes": self.peak_bytes,
                "bound_seconds": self.bound_seconds}


def needs_no_less(layout: Layout, than: Layout) -> bool:
    """Whether `layout` needs at least the memory of `than`: the same layout but sharded
    over fewer dp_shard ranks (more over dp_replicate), without activation checkpointing
    where `than` has it, in fewer (so larger) microbatches, or under a schedule that holds
    more in flight (HEAVIER). Each is more of what a rank holds, at the same ep only (the
    experts are sharded over efsdp = dp_shard·cp·tp / ep: fewer dp_shard ranks, fewer
    shards of them too; another ep moves tokens and experts otherwise); tests/test_fit.py
    and tests/test_fit_ep.py check every pair they simulate."""
    mine, theirs = layout.mesh, than.mesh
    if any(mine[axis] != theirs[axis] for axis in ("pp", "cp", "tp", "ep")) or layout.dp != than.dp:
        return False
    if mine["dp_shard"] > theirs["dp_shard"] or (layout.checkpointing and not than.checkpointing):
        return False
    if layout.schedule != than.schedule and (layout.schedule, than.schedule) not in HEAVIER:
        return False
    if layout.virtual_stages != than.virtual_stages and layout.schedule == than.schedule:
        return False
    return layout.microbatches is None or layout.microbatches <= than.microbatches


# (schedule, schedule it holds at least as much as): GPipe keeps every microbatch in flight, 1F1B at most pp;
# Interleaved1F1B (2 stages per rank) warms up with (v − 1)·pp + 2·(pp − 1 − r) + 1 chunks of L/(v·pp) blocks on
# rank r, at least 1F1B's pp − r microbatches of L/pp blocks
HEAVIER = {("GPipe", "1F1B"), ("Interleaved1F1B", "1F1B")}


def lighter(layout: Layout) -> Layout | None:
    """The layout that needs no more memory than `layout` and whose failing drops it: an
    Interleaved1F1B layout's 1F1B twin (the search runs it first: a layout that does not
    fit under 1F1B does not under Interleaved1F1B either)."""
    if layout.schedule != "Interleaved1F1B":
        return None
    return Layout(layout.sizes, layout.checkpointing, "1F1B", layout.microbatches, 1)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def splits(world: int, count: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of `count` whole numbers multiplying to `world`."""
    if count == 1:
        yield (world,)
        return
    for first in divisors(world):
        for rest in splits(world // first, count - 1):
            yield (first, *rest)


def layouts(world: int, axes: tuple[str, ...], *, global_batch: int, blocks: int, gpus_per_node: int,
            experts: bool = False) -> Iterator[Layout | Rejected]:
    """Every layout of `world` ranks over `axes` (the world axes among them; the others 1),
    in a fixed order; the ones the search's own rules drop come as `Rejected` (kind
    "search"). With `experts` (the base plan has an experts section) and ep among `axes`,
    each split once per ep dividing its dp_shard·cp·tp (ep 1: the experts on no axis of
    their own, FSDP2 shards them over all those ranks); else ep stays 1."""
    free = [axis for axis in WORLD_AXES if axis in axes]
    for sizes in splits(world, len(free)):
        mesh = {**dict.fromkeys(AXES, 1), **dict(zip(free, sizes))}
        borrowed = mesh["dp_shard"] * mesh["cp"] * mesh["tp"]
        for ep in divisors(borrowed) if experts and "ep" in axes else (1,):
            for checkpointing in (False, True):
                for layout in _pipelines({**mesh, "ep": ep}, checkpointing, global_batch):
                    yield _search_rule(layout, gpus_per_node, blocks)


def _pipelines(mesh: dict[str, int], checkpointing: bool, global_batch: int) -> Iterator[Layout]:
    sizes = tuple(mesh[axis] for axis in AXES)
    pp, dp = mesh["pp"], mesh["dp_replicate"] * mesh["dp_shard"]
    if pp == 1:
        yield Layout(sizes, checkpointing)
        return
    local = global_batch // dp if global_batch % dp == 0 else 1  # an uneven batch is TP123's (the check says so)
    for schedule in SCHEDULES:
        virtual = INTERLEAVED_VIRTUAL if schedule == "Interleaved1F1B" else 1
        for microbatches in divisors(local):
            yield Layout(sizes, checkpointing, schedule, microbatches, virtual)


def _search_rule(layout: Layout, gpus_per_node: int, blocks: int) -> Layout | Rejected:
    mesh = layout.mesh
    if mesh["tp"] > gpus_per_node:
        return Rejected(layout, "search", f"tp {mesh['tp']} spans nodes of {gpus_per_node} GPUs: tensor parallelism is kept "
                        "inside a node (its collectives are on every layer's critical path)")
    stages = mesh["pp"] * layout.virtual_stages
    if stages > blocks:
        return Rejected(layout, "search", f"pp·virtual_stages = {stages} stages for the model's {blocks} blocks: "
                        "each stage needs a block")
    return layout


def stage_units(units: list[str], blocks: list[str], stages: int) -> list[list[str]]:
    """The model's units cut into `stages` runs (module docstring): blocks split evenly,
    the remainder to the middle stages; what comes before the first block goes to the
    first stage, what comes after the last to the last."""
    if stages == 1:
        return [list(units)]
    base, extra = divmod(len(blocks), stages)
    middle = list(range(1, stages - 1)) + [0, stages - 1]  # who takes the remainder, in order
    counts = [base + (1 if i in middle[:extra] else 0) for i in range(stages)]
    first, last = units.index(blocks[0]), units.index(blocks[-1])
    cut, start = [], 0
    for count in counts:
        cut.append(list(blocks[start:start + count]))
        start += count
    cut[0] = units[:first] + cut[0]
    cut[-1] = cut[-1] + units[last + 1:]
    return cut


def plan_sections(layout: Layout, *, blocks_glob: str, stages: list[list[str]] | None, training: dict[str, Any],
                  context_parallel: dict[str, Any] | None) -> dict[str, Any]:
    """The version 2 sections of a layout's plan (SPEC §7), beside its TP rules: the
    mesh, FSDP2 over the data axes, activation checkpointing, the pipeline, context
    parallelism, and the training step."""
    mesh = {axis: size for axis, size in layout.mesh.items() if size > 1 or axis == "tp"}
    sections: dict[str, Any] = {"mesh": mesh}
    if layout.dp > 1:
        sections["fsdp"] = {"units": [blocks_glob, ""]}
    if layout.checkpointing:
        sections["checkpointing"] = {"modules": blocks_glob}
    if layout.schedule is not None:
        cut = {"stages": stages} if stages is not None else {"layers_per_stage": 1}  # (none: a probe of the checks)
        sections["pipeline"] = {**cut, "schedule": layout.schedule, "microbatches": layout.microbatches,
                                **({"virtual_stages": layout.virtual_stages} if layout.virtual_stages > 1 else {})}
    if layout.mesh["cp"] > 1 and context_parallel is not None:
        sections["context_parallel"] = context_parallel
    sections["training"] = training
    return sections
