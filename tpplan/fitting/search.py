"""`tpplan fit` (SPEC §9): the layouts of a world (space.py), each dropped where a
plan check refuses it, bounded cheaply, simulated exactly by the dry run itself
(`runtime.dryrun.dry_run` of the layout's plan, so a layout's peak is what
`apply --dry-run` of its written plan says), and ranked by the stated cost model
(cost.py).

Best first, so that a world of thousands of layouts costs a handful of
simulations: each layout's step time has a lower bound known before it is
simulated (its compute, from the model's counted FLOPs, and its pipeline bubble
on that compute: exact parts of the cost model, the collectives being ≥ 0), and
its memory one (its parameters, gradients and optimizer state, spread evenly
over tp and dp_shard: the real shards are no smaller). A layout whose dry run
raises a plan error (a stage's forward that fails under the TP rules) drops the
layouts that differ from it only in the data-parallel split or the pipeline's
stage count, schedule and microbatches (`_cut_of`). A layout that does not fit drops every layout that
needs no less memory (space.needs_no_less). Layouts are simulated in
the order of their step-time bound; once `top` layouts fit and the next bound is
no better than the last of them, no later layout can enter the top, and the rest
are reported as ranked out, by how much. `exhaustive` simulates every layout
its checks and its memory bound let through.
"""

from __future__ import annotations

import heapq
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.axes_spec import DP_AXES, WORLD_AXES
from .simulate import Simulated, Simulations, dry_run_text
from .space import Layout, Rejected, layouts, needs_no_less, plan_sections, stage_units

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "none": 0}  # tensors per parameter (sgd's momentum is off by default)


class FitError(ValueError):
    """The search cannot be done as asked (the CLI exits 2)."""


@dataclass(frozen=True)
class FitOptions:
    model: str
    world: int
    memory_bytes: int
    seq: int
    global_batch: int
    plan: str  # the TP rules (a version 1 or 2 plan); its context_parallel section names the attention for cp > 1
    gpu: Any  # cost.GPU
    gpus_per_node: int = 8
    dtype: str = "bf16"
    optimizer: str = "adamw"
    axes: tuple[str, ...] = WORLD_AXES
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
    plan_text: str
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
    _writer: Any = field(default=None, repr=False, compare=False)

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    def evaluate(self, layout: Layout) -> "Ranked | Rejected":
        """`layout` simulated and costed as the search does it: one it ranked out, or one
        to compare with the top (a published layout)."""
        writer = self._writer
        text = writer.text(layout, os.path.abspath(self.options.plan))
        return writer.verdict(layout, dry_run_text(text, self.options.model, self.options.reuse_blocks))

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
                "assumptions": self.assumptions, "plan": best.plan_text if best else None,
                # beyond SPEC §9:
                "counts": self.counts(), "seconds": round(self.seconds, 3), "notes": self.notes}


# -- what the model tells the search, read once ---------------------------------------------


@dataclass(frozen=True)
class _Model:
    units: list[str]  # the pipeline's units (core/stages.split_units), in order
    blocks: list[str]  # the blocks among them
    blocks_glob: str
    numel: dict[str, int]  # unit -> its parameters' elements
    flops: Any  # flops.ModuleFlops of one sequence
    shape: Any  # megatron.TransformerShape, or None where the formula cannot read the model


def _read_model(options: FitOptions, event: Callable[[str], None]) -> _Model:
    from ..core.globs import ModuleTree
    from ..core.stages import split_units
    from ..memory.megatron import TransformerShape
    from ..simulation.modelref import build_model
    from .flops import count_flops

    event("reading the model")
    model = build_model(options.model, "meta")
    units, blocks_fqn = split_units(ModuleTree(name for name, _ in model.named_modules()))
    if blocks_fqn is None:
        raise FitError(f"{options.model}: no module list of repeated blocks (such as layers) to cut into pipeline stages, "
                       "checkpoint and shard: fit searches models built of blocks")
    blocks = [unit for unit in units if unit.startswith(blocks_fqn + ".")]
    seen: set[int] = set()
    numel = {}
    for unit in units:
        count = 0
        for param in model.get_submodule(unit).parameters():
            if id(param) not in seen:  # a tied parameter counts once, where it first appears
                seen.add(id(param))
                count += param.numel()
        numel[unit] = count
    try:
        shape = TransformerShape.of(model)
    except AttributeError:
        shape = None
    event("counting the model's FLOPs")
    flops = count_flops(options.model, options.seq, options.dtype)
    return _Model(units, blocks, f"{blocks_fqn}.*", numel, flops, shape)


# -- the search ------------------------------------------------------------------------------


def fit(model: str, *, world: int, seq: int, batch: int, plan: str, memory: int | str | None = None, gpu: str = "h100",
        gpus_per_node: int = 8, dtype: str = "bf16", optimizer: str = "adamw", axes: tuple[str, ...] = WORLD_AXES, top: int = 3,
        exhaustive: bool = False, jobs: int | None = None, on_event: Callable[[str], None] | None = None,
        **gpu_figures: float) -> FitResult:
    """`tpplan fit` in Python (SPEC §9): the layouts of `world` GPUs for the model `model`
    (`MOD:FN` or `hf:SPEC`) with the TP rules of `plan`, `batch` sequences of `seq` tokens
    per step, ranked by the cost model of the `gpu` preset (its figures overridden by
    `gpu_figures`: efficiency, peak_flops, intra_bandwidth, ...); `memory` per GPU (bytes
    or "80GiB"; default the preset's); `jobs` dry runs at once (default: one per CPU).
    `FitResult.best` is the chosen layout."""
    from ..memory.memory import parse_size
    from .cost import gpu_with

    preset = gpu_with(gpu, **gpu_figures)
    limit = preset.memory_bytes if memory is None else parse_size(memory) if isinstance(memory, str) else memory
    return search(FitOptions(model=model, world=world, memory_bytes=limit, seq=seq, global_batch=batch, plan=plan, gpu=preset,
                             gpus_per_node=gpus_per_node, dtype=dtype, optimizer=optimizer, axes=tuple(axes), top=top,
                             exhaustive=exhaustive, jobs=jobs or os.cpu_count() or 1), on_event)


def search(options: FitOptions, on_event: Callable[[str], None] | None = None) -> FitResult:
    """The layouts of `options.world` ranked (module docstring). A PlanError for a base
    plan that does not load; a FitError for a model the search cannot cut."""
    from ..core.loader import load_plan
    from .cost import assumptions

    event = on_event or (lambda message: None)
    started = time.perf_counter()
    base = load_plan(options.plan)
    model = _read_model(options, event)
    context_parallel = (base.spec.context_parallel.model_dump(exclude_defaults=True)
                        if base.version == 2 and base.spec.context_parallel is not None else None)
    expert_count = None  # expert parallelism is searched where the base plan has experts (a later tpplan)
    axes = tuple(axis for axis in options.axes if axis != "ep")
    training = {"global_batch": options.global_batch, "seq": options.seq, "dtype": options.dtype, "optimizer": options.optimizer}
    bounds = _Bounds(model, options)
    writer = _Writer(options, base, model, bounds, training, context_parallel)

    rejected: list[Rejected] = []
    candidates: list[tuple[float, int, int, Layout]] = []  # a heap: (step-time bound, -dp_shard, order, layout)
    considered = 0
    for found in layouts(options.world, axes, global_batch=options.global_batch, blocks=len(model.blocks),
                         expert_count=expert_count, gpus_per_node=options.gpus_per_node):
        considered += 1
        if isinstance(found, Rejected):
            rejected.append(found)
            continue
        problem = writer.check(found)
        if problem is not None:
            rejected.append(Rejected(found, "check", problem[1], problem[0]))
            continue
        bound = bounds.static_bytes(found)
        if bound > options.memory_bytes:
            rejected.append(Rejected(found, "memory", f"at least {_size(bound)} of parameters, gradients and optimizer state "
                                     f"per rank (before activations) > {_size(options.memory_bytes)}"))
            continue
        candidates.append((bounds.step(found, {}).total, -found.mesh["dp_shard"], considered, found))
    heapq.heapify(candidates)
    event(f"{considered} layouts: {len(candidates)} may fit; simulating best first")

    ranked: list[Ranked] = []
    too_big: list[tuple[Layout, int]] = []  # the layouts simulated that did not fit, and their peaks
    refused: dict[tuple, Rejected] = {}  # a layout's cut (_cut_of) -> the plan error its dry run raised
    known: dict[tuple, dict[str, float]] = {}  # a layout less its dp split -> its collectives' seconds off the dp axes
    fitted: set[tuple] = set()  # the groups (_less_split) one of which fits: its siblings are worth running at once
    sent: deque = deque()  # (layout, its dry run's future), in the order sent
    simulated = 0

    def settle(layout: Layout, outcome: Simulated) -> None:
        """What a layout's dry run says, taken into the ranking and the later bounds."""
        verdict = writer.verdict(layout, outcome)
        if isinstance(verdict, Rejected) and verdict.kind == "check":
            refused.setdefault(_cut_of(layout), verdict)
        if outcome.refused is None:
            comms = writer.comms(layout, outcome)
            known[_less_split(layout)] = {axis: seconds for axis, seconds in comms.items() if axis not in DP_AXES}
        if isinstance(verdict, Rejected):
            too_big.extend([(layout, verdict.peak_bytes)] if verdict.kind == "memory" else [])
            rejected.append(verdict)
            return
        fitted.add(_less_split(layout))
        ranked.append(verdict)
        ranked.sort(key=lambda r: r.step.total)

    deferred: list = []  # candidates held back while a sibling's dry run is on its way (its verdict may drop them)

    def take_oldest() -> None:
        """The oldest dry run sent, taken in order; the held-back candidates back in the queue."""
        layout, future = sent.popleft()
        settle(layout, future.result())
        for waiting in deferred:
            heapq.heappush(candidates, waiting)
        deferred.clear()

    with Simulations(options.jobs) as simulations:
        while candidates or sent:
            if len(sent) >= options.jobs or not candidates:
                take_oldest()
                continue
            bound, shard, order, layout = heapq.heappop(candidates)
            key = _less_split(layout)
            if key in known:  # its group's collectives off the dp axes are known: the bound rises to them
                raised = bounds.step(layout, known[key]).total
                if raised > bound:
                    heapq.heappush(candidates, (raised, shard, order, layout))
                    continue
            if not options.exhaustive and len(ranked) >= options.top and bound >= ranked[options.top - 1].step.total:
                if sent:  # a verdict on its way may still rank or raise a held-back candidate
                    heapq.heappush(candidates, (bound, shard, order, layout))
                    take_oldest()
                    continue
                kth = ranked[options.top - 1].step.total
                rejected += [Rejected(later, "ranked out", f"its step takes at least {_seconds(later_bound)} (its compute, "
                                      f"bubble and known collectives), no faster than the #{options.top}'s {_seconds(kth)}")
                             for later_bound, _, _, later in sorted([(bound, shard, order, layout), *candidates])]
                candidates = []
                continue
            if any((needs_no_less(layout, other) and _less_split(other) not in fitted) or _cut_of(other) == _cut_of(layout)
                   for other, _ in sent):
                deferred.append((bound, shard, order, layout))  # no guess beside a sibling whose verdict is on its way
                continue
            if (failed := refused.get(_cut_of(layout))) is not None:
                rejected.append(Rejected(layout, "check", f"as {failed.layout.describe()} (simulated): {failed.reason}", failed.code))
                continue
            if not options.exhaustive and (larger := next((over for over in too_big if needs_no_less(layout, over[0])), None)):
                rejected.append(Rejected(layout, "memory", f"does not fit: {larger[0].describe()} needs no more memory and "
                                         f"takes {_size(larger[1])} > {_size(options.memory_bytes)}"))
                continue
            simulated += 1
            event(f"simulating {layout.describe()} ({simulated})")
            sent.append((layout, simulations.submit(dry_run_text, writer.text(layout, os.path.abspath(options.plan)),
                                                   options.model, options.reuse_blocks)))
    result = FitResult(options, ranked, rejected, assumptions(options.gpu, options.gpus_per_node), considered, simulated,
                       _writer=writer)
    result.notes += _notes(options)
    result.seconds = time.perf_counter() - started
    return result


def _less_split(layout: Layout) -> tuple:
    mesh = layout.mesh
    return (tuple(size for axis, size in mesh.items() if axis not in ("dp_replicate", "dp_shard")), layout.dp,
            layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)


def _cut_of(layout: Layout) -> tuple:
    """What a plan error of a layout's forward depends on: the TP rules' axes, whether the
    model is cut into stages, activation checkpointing; not the data-parallel split, the
    stage count, the schedule or the microbatches (a TP rule that fails on a stage's input
    fails on every cut: the model's stages all take what the blocks pass on)."""
    mesh = layout.mesh
    return (mesh["pp"] > 1, mesh["cp"], mesh["tp"], mesh["ep"], layout.checkpointing)


def _notes(options: FitOptions) -> list[str]:
    return [f"the search: tensor parallelism inside a node (tp ≤ {options.gpus_per_node}); pipeline stages of equal block "
            "counts (the remainder to the middle stages); schedules 1F1B, Interleaved1F1B (2 stages per rank) and GPipe, "
            "each microbatch count dividing the rank's batch; FSDP2 over every block and the root where dp > 1",
            "Megatron's formula is of Megatron's own layout: TP and PP with its distributed optimizer (optimizer state "
            "sharded over dp, parameters and gradients whole on every dp rank), no CP; where FSDP shards the parameters "
            "and gradients too, ours is far below it",
            "peaks are the dry run's of each layout's plan (`tpplan apply --dry-run` of it gives the same); layouts are "
            "simulated in order of their step-time bound" + ("" if options.exhaustive else
                                                             f", until no later one can enter the top {options.top}")]


def _size(count: int) -> str:
    from ..core.units import human_bytes

    return human_bytes(count)


def _seconds(value: float) -> str:
    return f"{value:.4g} s"


# -- bounds: exact parts of the model, known before a simulation ---------------------------------


class _Bounds:
    """What a layout's pipeline cut gives its bounds and its compute, once per cut."""

    def __init__(self, model: _Model, options: FitOptions):
        self.model, self.options = model, options
        self._ranks: dict[tuple, list[list[str]]] = {}
        self._flops: dict[tuple, float] = {}
        self._numel: dict[tuple, int] = {}

    def rank_units(self, layout: Layout) -> list[list[str]]:
        """Each pp rank's units (its stages')."""
        from ..core.stages import rank_stages

        pp, virtual, schedule = layout.mesh["pp"], layout.virtual_stages, layout.schedule
        key = (pp, virtual, schedule)
        if key not in self._ranks:
            stages = stage_units(self.model.units, self.model.blocks, pp * virtual)
            self._ranks[key] = stages if pp == 1 else [
                [unit for stage in rank_stages(rank, pp, virtual, schedule) for unit in stages[stage]] for rank in range(pp)]
        return self._ranks[key]

    def static_bytes(self, layout: Layout) -> int:
        """The worst pp rank's parameters, gradients and optimizer state, spread evenly over
        tp and dp_shard: a lower bound of its peak (module docstring)."""
        key = (layout.mesh["pp"], layout.virtual_stages, layout.schedule)
        if key not in self._numel:
            self._numel[key] = max(sum(self.model.numel[unit] for unit in units) for units in self.rank_units(layout))
        per = DTYPE_BYTES[self.options.dtype] * (2 + OPTIMIZER_STATES[self.options.optimizer])
        return self._numel[key] * per // (layout.mesh["tp"] * layout.mesh["dp_shard"])

    def rank_flops(self, layout: Layout) -> float:
        """The worst pp rank's FLOPs per step: its units' forward and backward (and, with
        activation checkpointing, its blocks' forward again) for each of its sequences,
        spread evenly over tp and cp."""
        key = (layout.mesh["pp"], layout.virtual_stages, layout.schedule, layout.checkpointing)
        if key not in self._flops:
            flops, blocks = self.model.flops, set(self.model.blocks)
            worst = 0.0
            for units in self.rank_units(layout):
                forward, backward = flops.of(units)
                if layout.checkpointing:
                    forward += flops.of([unit for unit in units if unit in blocks])[0]
                worst = max(worst, forward + backward)
            self._flops[key] = worst
        mesh = layout.mesh
        return self._flops[key] * (self.options.global_batch // layout.dp) / (mesh["tp"] * mesh["cp"])

    def bubble(self, layout: Layout) -> float:
        """The idle share of the pipelined step (pipeline_memory.schedule_bubble)."""
        from ..memory.pipeline_memory import schedule_bubble

        pp = layout.mesh["pp"]
        return 0.0 if pp == 1 else schedule_bubble(layout.schedule, pp, layout.microbatches, layout.virtual_stages)

    def step(self, layout: Layout, comms: dict[str, float]):
        """The cost model's step (cost.step_time): with no collectives, its lower bound."""
        from .cost import compute_seconds, step_time

        return step_time(compute_seconds(self.rank_flops(layout), self.options.gpu), comms, self.bubble(layout))


# -- a layout's plan: checked, simulated, ranked ------------------------------------------------


class _Writer:
    """Writes each layout's plan (its sections beside the base plan's rules, `extends`), checks it, simulates it."""

    def __init__(self, options: FitOptions, base, model: _Model, bounds: _Bounds, training: dict, context_parallel: dict | None):
        self.options, self.base, self.model, self.bounds = options, base, model, bounds
        self.training, self.context_parallel = training, context_parallel
        self._specs: dict[tuple, Any] = {}

    def text(self, layout: Layout, extends: str, *, probe: bool = False) -> str:
        """The layout's plan; a `probe` (every axis 1, stages by count) loads whatever its
        sections, for the checks to read at the layout's sizes."""
        from ..core.yamltext import plan_yaml

        pp = layout.mesh["pp"]
        stages = stage_units(self.model.units, self.model.blocks, pp * layout.virtual_stages) if pp > 1 and not probe else None
        if probe:
            layout = Layout((1,) * len(layout.sizes), layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)
        sections = plan_sections(layout, blocks_glob=self.model.blocks_glob, stages=stages, training=self.training,
                                 context_parallel=self.context_parallel)
        top = {"version": 2, "name": f"fit-{'-'.join(f'{a}{s}' for a, s in layout.mesh.items() if s > 1) or 'one'}",
               "description": f"written by tpplan fit: {layout.describe()}", "extends": extends, "mesh": sections.pop("mesh")}
        return plan_yaml(top, {}, after=sections)

    def check(self, layout: Layout) -> tuple[str, str] | None:
        """The first (code, message) of the plan's checks at this layout's sizes (one parsed
        probe per kind of layout: the checks read its sections, the sizes are given)."""
        from ..core.axes import sized_problems
        from ..core.loader import load_plan

        if self.context_parallel is None and layout.mesh["cp"] > 1:
            return ("TP128", f"cp {layout.mesh['cp']}: the base plan has no context_parallel section naming the attention "
                    "modules: add one to --plan, or leave cp out of --axes")
        key = (layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)
        if key not in self._specs:
            self._specs[key] = load_plan(text=self.text(layout, os.path.abspath(self.options.plan), probe=True), file="<fit>").spec
        problems = sized_problems(self._specs[key], layout.mesh)
        return problems[0] if problems else None

    def comms(self, layout: Layout, outcome: Simulated) -> dict[str, float]:
        """The seconds of the layout's collectives per axis (cost.comm_seconds of its dry run's)."""
        from .cost import comm_seconds

        return comm_seconds(outcome.comms_by_axis, layout.mesh, self.options.gpu, self.options.gpus_per_node)

    def verdict(self, layout: Layout, outcome: Simulated) -> "Ranked | Rejected":
        """A layout's dry run read: refused by a plan check, over the memory, or ranked."""
        memory = self.options.memory_bytes
        if outcome.refused is not None:
            return Rejected(layout, "check", outcome.refused[1], outcome.refused[0])
        if outcome.peak_bytes > memory:
            return Rejected(layout, "memory", f"{_size(outcome.peak_bytes)} > {_size(memory)}, {_size(outcome.peak_bytes - memory)} "
                            f"over (at {outcome.peak_where})", peak_bytes=outcome.peak_bytes)
        return self.ranked(layout, outcome, self.comms(layout, outcome))

    def ranked(self, layout: Layout, outcome, comms: dict[str, float]) -> Ranked:
        options = self.options
        step = self.bounds.step(layout, comms)
        tokens = options.global_batch * options.seq / step.total / options.world
        return Ranked(layout, outcome.peak_bytes, step, tokens, self._megatron(layout),
                      self.text(layout, os.path.abspath(options.plan)), outcome.peak_where)

    def _megatron(self, layout: Layout) -> int | None:
        from ..memory.megatron import megatron_memory

        if self.model.shape is None:
            return None
        mesh = layout.mesh
        local = self.options.global_batch // layout.dp
        micro = local // layout.microbatches if layout.microbatches else local
        estimate = megatron_memory(self.model.shape, tp=mesh["tp"], pp=mesh["pp"], dp=layout.dp, seq=self.options.seq,
                                   micro_batch=micro, microbatches=layout.microbatches,
                                   virtual_stages=layout.virtual_stages if layout.virtual_stages > 1 else None,
                                   sequence_parallel_selective=layout.checkpointing)
        return int(estimate.total)


def plan_for(result: FitResult, output: str, ranked: Ranked | None = None) -> str:
    """The plan of `ranked` (default the best layout), its `extends:` relative to `output`, where it is written."""
    chosen = ranked or result.best
    assert chosen is not None
    base = os.path.abspath(result.options.plan)
    relative = os.path.relpath(base, os.path.dirname(os.path.abspath(output)))
    return chosen.plan_text.replace(f"extends: {base}", f"extends: {relative}", 1)
