"""The dry run of a version 2 plan's pipeline (SPEC §8): each stage's one microbatch
simulated on its own, in the world of the plan's mesh, on fake tensors (the fake
process group cannot build torch's `PipelineStage`, pytorch#191538), then each pp
rank's step composed in its schedule's order (pipeline_memory.py).

A stage is simulated as torchrun runs it (runtime/pipelined.py): the whole model
built, the TP rules applied, the stage cut from it (`sharding.pipeline.keep_stage`:
the other stages' units removed, names kept), activation checkpointing and FSDP2 on
its share of the units, its microbatch's input (token ids on the first stage, else
a tensor shaped as the stage before it hands on), one microbatch's forward and, by
PipelineStage's own code, backward and gradient reduction, then the optimizer step.
Two savings, each checked against doing without (`--no-reuse`): the other stages'
blocks are dropped before the TP rules (which then shard this stage's alone; the
report's whole model is put together from the stages, `whole_model`), and a stage's
repeated blocks are simulated once (memory/reuse.py); stages alike (the same units'
classes and parameter shapes, the same place: first, middle or last, the same
input) are simulated once: a 16-stage pipeline of equal blocks simulates three.
Each stage runs at the lowest global rank of its pp index; its ranks on the other
axes are taken as alike. Inside `shared_stages()` (fit's dry runs), a pipeline run
before under the other one-stage schedule lends its stages (`shared`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .memory import StageIO
from .pipeline_memory import RankStep, StageMemory, bubble, compose, schedule_orders

if TYPE_CHECKING:
    from torch import nn

    from .memory import PlannedStep
    from ..simulation.positions import MeshDims


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline's dry run: each stage as measured, each pp rank's composed step."""

    schedule: str
    microbatches: int
    microbatch_size: int
    bubble: float
    stages: tuple[StageMemory, ...]
    ranks: tuple[RankStep, ...]  # by pp rank
    steps: tuple[Any, ...] = ()  # each stage's measured microbatch (memory.StepMemory)
    simulated_as: tuple[int, ...] = ()  # each stage's: the index of the stage simulated for it (itself, or one alike)

    def rank_of(self, stage: int) -> RankStep:
        """The pp rank that runs `stage`."""
        return next(rank for rank in self.ranks if stage in rank.stages)

    def to_json(self) -> dict[str, Any]:
        """SPEC §8's `pipeline` (per_rank_peak_bytes: the peak of the pp rank that runs the stage)."""
        stages = []
        for stage in self.stages:
            rank = self.rank_of(stage.stage)
            stages.append({"stage": stage.stage, "modules": list(stage.modules), "pp_rank": rank.pp_rank,
                           "per_rank_peak_bytes": rank.peak_bytes, "activations": stage.activations,
                           "in_flight": rank.in_flight[stage.stage], "p2p_bytes": stage.p2p_bytes,
                           # Beyond SPEC §8:
                           "peak_action": rank.peak_action, "static_bytes": stage.static})
        return {"schedule": self.schedule, "microbatches": self.microbatches, "bubble": self.bubble, "stages": stages}


@dataclass
class _Whole:
    """What the whole model tells every stage's simulation (read once, on the first build)."""

    stages: list[list[str]] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    fsdp_units: tuple[str, ...] = ()
    vocab: int | None = None
    kinds: dict[str, tuple] = field(default_factory=dict)  # each unit's class and parameters' names, shapes, dtypes


@dataclass
class StageRun:
    """One stage's simulation, as memory_dryrun's `at_rank` runs it on a build of the whole
    model: `strategy` first (the whole model read, the other stages' blocks dropped, then
    the stage's repeated blocks simulated once or the stage whole), and for each model
    it simulates `io`, `inputs`, the TP rules, `after_rules`, what follows the rules,
    the measured microbatch."""

    plan: Any
    whole: _Whole
    index: int
    microbatches: int
    size: int  # the microbatch's sequences
    seq: int
    boundary: tuple | None  # the stage before's output: (shape, dtype); None on the first stage
    first_inputs: Callable[["nn.Module", int], tuple]

    def strategy(self, reuse: "Callable | None") -> Callable:
        """plan_memory's strategy: on the whole built model, read what every stage needs (the
        first stage's build), drop the other stages' blocks, then `reuse` (reuse.block_reuse:
        the stage's repeated blocks simulated once) or the stage simulated whole."""
        def run(model: "nn.Module", simulate: Callable) -> "PlannedStep":
            if self.index == 0:
                self._read(model)
            # repeated blocks are found in the stage's own (the whole list's would span other stages)
            return reuse(model, simulate) if self._drop_other_blocks(model) and reuse is not None else simulate(model)

        return run

    def _read(self, model: "nn.Module") -> None:
        from ..sharding.pipeline import stages_of, whole_model_units
        from ..simulation.training import token_vocab

        whole = self.whole
        whole.stages, whole.units = stages_of(self.plan, model)
        whole.fsdp_units = tuple(whole_model_units(self.plan, model))
        whole.vocab = token_vocab(model)
        whole.kinds = {unit: _kind(model.get_submodule(unit)) for unit in whole.units}

    def io(self, model: "nn.Module") -> StageIO:
        import torch

        whole = self.whole
        last = self.index == len(whole.stages) - 1
        targets = torch.randint(0, whole.vocab, (self.size, self.seq)) if last and whole.vocab is not None else None
        return StageIO(first=self.index == 0, last=last, microbatches=self.microbatches, targets=targets,
                       fsdp_units=whole.fsdp_units)

    def inputs(self, model: "nn.Module") -> tuple:
        import torch

        if self.boundary is None:
            return self.first_inputs(model, self.size)
        shape, dtype = self.boundary
        return (torch.empty(shape, dtype=dtype).requires_grad_(True),)

    def _drop_other_blocks(self, model: "nn.Module") -> bool:
        """The other stages' blocks dropped before the TP rules shard the model, unless a
        rule names one of them (its glob would then match nothing): the rules' work on
        126 blocks is most of a stage's simulation (the report's whole model is put
        together from the stages: `whole_model`). Whether they were."""
        from ..core.problems import PlanError
        from ..sharding.pipeline import drop_blocks

        restore = drop_blocks(model, self.whole.units, self.whole.stages[self.index])
        try:
            self.plan.match(model)
        except PlanError:
            restore()
            return False
        return True

    def after_rules(self, model: "nn.Module") -> None:
        from ..sharding.pipeline import keep_stage, output_tensor

        keep_stage(model, self.whole.units, self.whole.stages[self.index])
        model.register_forward_hook(output_tensor)


def plan_pipeline(plan: Any, dims: "MeshDims", batch: int | None, seq: int,
                  simulate: "Callable[[int, StageRun], PlannedStep]",
                  first_inputs: "Callable[[nn.Module, int], tuple]", event: Callable[[str], None],
                  reuse: bool = True) -> tuple[PipelinePlan, list["PlannedStep"]]:
    """The pipeline's plan at mesh `dims`, and the planned step of each stage simulated.
    `simulate(rank, stage)` plans one stage's microbatch at global `rank` (memory_dryrun's
    `at_rank`, running the `StageRun`); `first_inputs(model, microbatch)` makes the first
    stage's inputs. `reuse`: alike stages simulated once (else each)."""
    from ..core.stages import rank_stages, split_batch, stage_rank

    pipe = plan.spec.pipeline
    _, count, size = split_batch(plan, batch)
    pp = dims.sizes["pp"]
    whole = _Whole()
    measured: dict[Any, tuple[Any, Any]] = {}  # stage signature -> (its planned step, its output (shape, dtype))
    planned: list[PlannedStep] = []
    of_stage: list[PlannedStep] = []  # each stage's (alike stages share one)
    stages: list[StageMemory] = []
    simulated_as: list[int] = []
    boundary: tuple | None = None  # the previous stage's output: (shape, dtype)
    index = 0
    while index == 0 or index < len(whole.stages):
        first = index == 0
        last = bool(whole.stages) and index == len(whole.stages) - 1  # known once the first stage's build read the model
        key = None if first or not reuse else (last, tuple(whole.kinds[unit] for unit in whole.stages[index]), boundary)
        if key is None or key not in measured:
            rank = stage_rank(index, pp, pipe.schedule) * (dims.world // pp)
            event(f"pipeline stage {index}" + (f" of {len(whole.stages)}" if whole.stages else ""))
            step = simulate(rank, StageRun(plan, whole, index, count, size, seq, boundary, first_inputs))
            planned.append(step)
            found = (step, step.step.stage_output, index)
            if key is not None:
                measured[key] = found
        else:
            found = measured[key]
        step, output, simulated = found
        of_stage.append(step)
        simulated_as.append(simulated)
        last = index == len(whole.stages) - 1  # the first stage's, now that the model was read
        input_bytes = 0 if first else _bytes(*boundary)
        output_bytes = 0 if last else _bytes(*output)
        stages.append(StageMemory.measured(index, whole.stages[index], step.step, input_bytes, output_bytes))
        boundary = output
        index += 1
    ranks, idle = _composed(pipe.schedule, count, [rank_stages(r, pp, pipe.virtual_stages, pipe.schedule) for r in range(pp)], stages)
    return PipelinePlan(pipe.schedule, count, size, idle, tuple(stages), ranks, tuple(s.step for s in of_stage),
                        tuple(simulated_as)), planned


def _composed(schedule: str, microbatches: int, stage_ids: list[list[int]], stages) -> tuple[tuple[RankStep, ...], float]:
    """Each pp rank's step composed from the measured stages in `schedule`'s order, and its bubble."""
    orders = schedule_orders(schedule, len(stage_ids), microbatches, stage_ids)
    by_index = {stage.stage: stage for stage in stages}
    return tuple(compose(rank, orders[rank], by_index, microbatches) for rank in range(len(stage_ids))), bubble(orders)


# One-stage schedules: pp rank r runs stage r alone, and each stage's microbatch is simulated
# as the other schedule's (stage_rank places it alike): only the composition differs.
ONE_STAGE = ("1F1B", "GPipe")
_SHARED: dict[Any, tuple] = {}  # a pipeline less its schedule -> (pipeline, steps, tables): the last _KEPT
_KEPT = 8
_SHARING = False


@contextlib.contextmanager
def shared_stages() -> Iterator[None]:
    """Inside, a dry run of a pipeline under a one-stage schedule takes its stages from an
    earlier dry run in this process of the same pipeline under the other (`shared`), and
    composes its own ranks (`rescheduled`): `tpplan fit`'s layouts that share a stage
    shape. Outside, every dry run simulates its own stages. What is kept is plain data
    (the measured stages, the report's module and parameter tables)."""
    global _SHARING
    outer, _SHARING = _SHARING, True
    try:
        yield
    finally:
        _SHARING = outer


def shared(key: Any, simulate: "Callable[[], tuple]") -> "tuple[tuple, bool]":
    """(what `simulate()` gives for the pipeline `key` (its plan, mesh and step, its
    schedule left out), whether it came from an earlier dry run): inside `shared_stages()`
    each key is simulated once; outside (or with no key), every time."""
    if not _SHARING or key is None:
        return simulate(), False
    if key in _SHARED:
        return _SHARED[key], True
    found = _SHARED[key] = simulate()
    while len(_SHARED) > _KEPT:
        del _SHARED[next(iter(_SHARED))]
    return found, False


def rescheduled(pipeline: PipelinePlan, schedule: str) -> PipelinePlan:
    """`pipeline`'s measured stages under another one-stage schedule (ONE_STAGE)."""
    import dataclasses

    ranks, idle = _composed(schedule, pipeline.microbatches, [list(rank.stages) for rank in pipeline.ranks], pipeline.stages)
    return dataclasses.replace(pipeline, schedule=schedule, ranks=ranks, bubble=idle)


def whole_model(pipeline: PipelinePlan, found: dict[int, list[tuple[str, Any]]]) -> list[tuple[str, Any]]:
    """The whole model's (fqn, value) pairs from each simulated stage's (`found`: by the
    index of the stage simulated; each simulation sharded only its own stage's blocks):
    every stage's from the one simulated for it, its units renamed in order (alike
    stages hold alike units), and what lies outside every stage's units (the root, the
    ancestors of the blocks) from the first stage's. In the model's order."""
    units = [stage.modules for stage in pipeline.stages]
    every = {unit for held in units for unit in held}

    def unit_of(fqn: str, held: tuple[str, ...]) -> str | None:
        return next((unit for unit in held if fqn == unit or fqn.startswith(unit + ".")), None)

    outside = [(fqn, value) for fqn, value in found[0] if unit_of(fqn, tuple(every)) is None]
    inside = []
    for index, held in enumerate(units):
        simulated = pipeline.simulated_as[index]
        rename = dict(zip(units[simulated], held))
        for fqn, value in found[simulated]:
            if (unit := unit_of(fqn, units[simulated])) is not None:
                inside.append((rename[unit] + fqn[len(unit):], value))
    return outside + inside


def rank_comms(pipeline: PipelinePlan, pp_rank: int, axes) -> dict[str, Any]:
    """One pp rank's collectives over a step: each of its stages' microbatch forward and
    backward times the microbatches, its gradient reduction and optimizer step once,
    and PipelineStage's sends and receives over pp (an activation forward, a gradient
    backward, per microbatch).
    {"comms", "bytes": {"forward"|"backward": {op: n}}, "optimizer": {"counts", "bytes"},
    "by_axis": SPEC §7's {axis: {phase: {op: {"count", "bytes"}}}}}."""
    from collections import Counter

    from ..simulation.comm_axes import per_op
    from .memory import by_axis

    counts = {phase: Counter() for phase in ("forward", "backward", "optimizer")}
    sizes = {phase: Counter() for phase in ("forward", "backward", "optimizer")}
    for index in pipeline.ranks[pp_rank].stages:
        step = pipeline.steps[index]
        for phase, times, into in (("forward", pipeline.microbatches, "forward"), ("backward", pipeline.microbatches, "backward"),
                                   ("reduce", 1, "backward"), ("optimizer", 1, "optimizer")):
            for key, n in step.axis_comms.get(phase, {}).items():
                counts[into][key] += n * times
                sizes[into][key] += step.axis_bytes[phase][key] * times
        stage, m = pipeline.stages[index], pipeline.microbatches
        for phase, sent, received in (("forward", stage.output_bytes, stage.input_bytes), ("backward", stage.input_bytes, stage.output_bytes)):
            for op, size in (("send", sent), ("recv", received)):  # PipelineStage's p2p over pp, one per microbatch
                if size:
                    counts[phase][("pp", op)] += m
                    sizes[phase][("pp", op)] += m * size
    return {"comms": {phase: per_op(counts[phase]) for phase in ("forward", "backward")},
            "bytes": {phase: per_op(sizes[phase]) for phase in ("forward", "backward")},
            "optimizer": {"counts": per_op(counts["optimizer"]), "bytes": per_op(sizes["optimizer"])},
            "by_axis": by_axis(counts, sizes, axes)}


def _kind(module: "nn.Module") -> tuple:
    """What makes two units alike for the simulation: the class, each parameter's name, shape and dtype."""
    return type(module).__qualname__, tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def _bytes(shape: tuple[int, ...], dtype: Any) -> int:
    import math

    return math.prod(shape) * dtype.itemsize
