"""`tpplan fit` (SPEC §9): the layouts of a world (space.py), each dropped where a
plan check refuses it, bounded cheaply, simulated exactly by the dry run itself
(`runtime.dryrun.dry_run` of the layout's plan, so a layout's peak is what
`apply --dry-run` of its written plan says), and ranked by the stated cost model
(cost.py).

Best first, so that a world of thousands of layouts costs a handful of
simulations: each layout's step time has a lower bound known before it is
simulated (its compute, from the model's counted FLOPs, and its pipeline bubble
on that compute: exact parts of the cost model, the collectives being ≥ 0), and
its memory one (bounds.py: its parameters and optimizer state spread evenly over
tp·dp_shard·cp, and the larger of its gradients and, without activation
checkpointing, the activations its blocks save until backward: the real shards
are no smaller, the experts' over ep·efsdp included). A layout whose dry run
raises a plan error (a stage's forward that fails under the TP rules) drops the
layouts that differ from it only in the data-parallel split or the pipeline's
stage count, schedule and microbatches (`_cut_of`). A layout that does not fit drops every layout that
needs no less memory (space.needs_no_less); an Interleaved1F1B layout's 1F1B twin
runs first (space.lighter). Layouts are simulated in
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

from ..core.axes_spec import AXES
from .bounds import Bounds, read_model
from .cost import HIDDEN_AXES
from .layout_plans import LayoutPlans, seconds_text, size_text
from .result import FitError, FitOptions, FitResult, Ranked
from .simulate import Simulated, Simulations, dry_run_text
from .space import Layout, Rejected, layouts, lighter, needs_no_less


def fit(model: str, *, world: int, seq: int, batch: int, plan: str | None = None, memory: int | str | None = None, gpu: str = "h100",
        gpus_per_node: int = 8, dtype: str = "bf16", optimizer: str = "adamw", axes: tuple[str, ...] = AXES, top: int = 3,
        exhaustive: bool = False, jobs: int | None = None, on_event: Callable[[str], None] | None = None,
        **gpu_figures: float) -> FitResult:
    """`tpplan fit` in Python (SPEC §9): the layouts of `world` GPUs for the model `model`
    (`MOD:FN` or `hf:SPEC`) with the TP rules of `plan` (None: `tpplan init`'s on the model,
    `FitResult.rules`), `batch` sequences of `seq` tokens
    per step, ranked by the cost model of the `gpu` preset (its figures overridden by
    `gpu_figures`: efficiency, peak_flops, intra_bandwidth, ...); `memory` per GPU (bytes
    or "80GiB"; default the preset's); `jobs` dry runs at once (default: one per CPU).
    `FitResult.best` is the chosen layout. A FitError for a memory size that does not parse."""
    from ..memory.memory import parse_size
    from .cost import gpu_with

    preset = gpu_with(gpu, **gpu_figures)
    try:
        limit = preset.memory_bytes if memory is None else parse_size(memory) if isinstance(memory, str) else memory
    except ValueError as exc:
        raise FitError(f"memory {memory!r}: {exc}") from None
    return search(FitOptions(model=model, world=world, memory_bytes=limit, seq=seq, global_batch=batch, plan=plan, gpu=preset,
                             gpus_per_node=gpus_per_node, dtype=dtype, optimizer=optimizer, axes=tuple(axes), top=top,
                             exhaustive=exhaustive, jobs=jobs or os.cpu_count() or 1), on_event)


def search(options: FitOptions, on_event: Callable[[str], None] | None = None) -> FitResult:
    """The layouts of `options.world` ranked (module docstring). A PlanError for a base
    plan that does not load (or, without one, a model init cannot trace); a FitError for a
    model the search cannot cut."""
    import dataclasses

    from ..core.loader import load_plan
    from .cost import assumptions
    from .inferred import inferred_rules, tp_degrees

    event = on_event or (lambda message: None)
    started = time.perf_counter()
    rules = None
    if options.plan is None:  # SPEC §9: the TP rules from init on the model
        rules, path = inferred_rules(options.model, tp_degrees(options.world, options.gpus_per_node, options.axes), event)
        options = dataclasses.replace(options, plan=path)
    base = load_plan(options.plan)
    experts = base.version == 2 and bool(base.spec.experts)  # ep is searched where the base plan places experts over it
    model = read_model(options, event, base)
    context_parallel = (base.spec.context_parallel.model_dump(exclude_defaults=True)
                        if base.version == 2 and base.spec.context_parallel is not None else None)
    training = {"global_batch": options.global_batch, "seq": options.seq, "dtype": options.dtype, "optimizer": options.optimizer}
    bounds = Bounds(model, options)
    writer = LayoutPlans(options, model, bounds, training, context_parallel)

    rejected: list[Rejected] = []
    candidates: list[tuple[float, int, int, Layout]] = []  # a heap: (step-time bound, -dp_shard, order, layout)
    considered = 0
    for found in layouts(options.world, options.axes, global_batch=options.global_batch, blocks=len(model.blocks),
                         gpus_per_node=options.gpus_per_node, experts=experts):
        considered += 1
        if isinstance(found, Rejected):
            rejected.append(found)
            continue
        problem = writer.check(found)
        if problem is not None:
            rejected.append(Rejected(found, "check", problem[1], problem[0]))
            continue
        bound = bounds.memory_bytes(found)
        if bound > options.memory_bytes:
            rejected.append(Rejected(found, "memory", f"at least {size_text(bound)} per rank > {size_text(options.memory_bytes)}: "
                                     + _bound_parts(bounds, found, bound)))
            continue
        candidates.append((bounds.step(found, {}).total, -found.mesh["dp_shard"], considered, found))
    heapq.heapify(candidates)
    entries = {entry[3]: entry for entry in candidates}  # a layout's place in the queue
    stale: set = set()  # the orders of entries moved ahead (space.lighter): skipped when they come up
    event(f"{considered} layouts: {len(candidates)} may fit; simulating best first")

    ranked: list[Ranked] = []
    too_big: list[tuple[Layout, int]] = []  # the layouts simulated that did not fit, and their peaks
    refused: dict[tuple, Rejected] = {}  # a layout's cut (_cut_of) -> the plan error its dry run raised
    known: dict[tuple, dict[str, float]] = {}  # a layout less its dp split -> its collectives' seconds off the axes it
    # splits (cost.HIDDEN_AXES: the data axes and the experts' efsdp, whose sizes follow the dp split)
    fitted: set[tuple] = set()  # the groups (_less_split) one of which fits: its siblings are worth running at once
    sent: deque = deque()  # (layout, its dry run's future), in the order sent
    simulated = 0

    def settle(layout: Layout, outcome: Simulated) -> None:
        """What a layout's dry run says, taken into the ranking and the later bounds."""
        comms = writer.comms(layout, outcome) if outcome.refused is None else None
        if comms is not None:
            known[_less_split(layout)] = {axis: seconds for axis, seconds in comms.items() if axis not in HIDDEN_AXES}
        verdict = writer.verdict(layout, outcome, comms)
        if isinstance(verdict, Rejected):
            if verdict.kind == "check":
                refused.setdefault(_cut_of(layout), verdict)
            else:
                too_big.append((layout, verdict.peak_bytes))
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
            if order in stale:
                continue
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
                rejected += [Rejected(later, "ranked out", f"its step takes at least {seconds_text(later_bound)} (its compute, "
                                      f"bubble and known collectives), no faster than the #{options.top}'s {seconds_text(kth)}",
                                      bound_seconds=later_bound)
                             for later_bound, _, _, later in sorted([(bound, shard, order, layout), *candidates])]
                candidates = []
                continue
            in_flight = [other for other, _ in sent]
            if any((needs_no_less(layout, other) and _less_split(other) not in fitted) or _cut_of(other) == _cut_of(layout)
                   for other in in_flight):
                deferred.append((bound, shard, order, layout))  # no guess beside a sibling whose verdict is on its way,
                runnable = [entry for entry in deferred if lighter(entry[3]) not in in_flight]
                if not runnable or (candidates and candidates[0][0] <= bound):  # while another as good may run
                    continue
                # all that is left as good is held back: the first held back runs even so (what the slot would run
                # instead takes longer and may never be needed; a verdict that drops it only wastes the slot), but
                # not beside its lighter twin, whose failing drops it for certain (space.lighter)
                deferred.remove(runnable[0])
                bound, shard, order, layout = runnable[0]
            if (failed := refused.get(_cut_of(layout))) is not None:
                rejected.append(Rejected(layout, "check", f"as {failed.layout.describe()} (simulated): {failed.reason}", failed.code))
                continue
            if not options.exhaustive and (larger := next((over for over in too_big if needs_no_less(layout, over[0])), None)):
                rejected.append(Rejected(layout, "memory", f"does not fit: {larger[0].describe()} needs no more memory and "
                                         f"takes {size_text(larger[1])} > {size_text(options.memory_bytes)}"))
                continue
            twin = entries.get(lighter(layout)) if not options.exhaustive else None
            if twin is not None and twin[2] not in stale:  # its lighter twin first: if that does not fit, neither does it
                stale.add(twin[2])
                heapq.heappush(candidates, (bound, shard, order, layout))
                heapq.heappush(candidates, (bound, shard, order - 0.5, twin[3]))
                continue
            simulated += 1
            event(f"simulating {layout.describe()} ({simulated})")
            sent.append((layout, simulations.submit(dry_run_text, writer.text(layout),
                                                   options.model, options.reuse_blocks)))
    result = FitResult(options, ranked, rejected, assumptions(options.gpu, options.gpus_per_node), considered, simulated,
                       rules=rules, _plans=writer)
    result.notes += _notes(options, experts)
    result.seconds = time.perf_counter() - started
    return result


def _less_split(layout: Layout) -> tuple:
    mesh = layout.mesh
    return (tuple(size for axis, size in mesh.items() if axis not in ("dp_replicate", "dp_shard")), layout.dp,
            layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)


def _bound_parts(bounds: Bounds, layout: Layout, bound: int) -> str:
    """What the memory bound of `layout` adds up, in words."""
    twin = lighter(layout)
    if twin is not None and bounds.memory_bytes(twin) == bound:
        return f"as its {twin.schedule} twin ({layout.schedule} holds no less), {_bound_parts(bounds, twin, bound)}"
    if bound > bounds.static_bytes(layout):  # the activations outweigh the gradients
        return (f"parameters, optimizer state and the {size_text(bounds.activation_bytes(layout))} of activations its blocks "
                "save for backward (without activation checkpointing, when backward starts)")
    return "parameters, gradients and optimizer state"


def _cut_of(layout: Layout) -> tuple:
    """What a plan error of a layout's forward depends on: the TP rules' axes, whether the
    model is cut into stages, activation checkpointing; not the data-parallel split, the
    stage count, the schedule or the microbatches (a TP rule that fails on a stage's input
    fails on every cut: the model's stages all take what the blocks pass on)."""
    mesh = layout.mesh
    return (mesh["pp"] > 1, mesh["cp"], mesh["tp"], mesh["ep"], layout.checkpointing)


def _notes(options: FitOptions, experts: bool) -> list[str]:
    notes = [f"the search: tensor parallelism inside a node (tp ≤ {options.gpus_per_node}); pipeline stages of equal block "
             "counts (the remainder to the middle stages); schedules 1F1B, Interleaved1F1B (2 stages per rank) and GPipe, "
             "each microbatch count dividing the rank's batch; FSDP2 over every block and the root where dp > 1"
             + ("; ep, each divisor of dp_shard·cp·tp (the ranks it borrows), the base plan's experts over it"
                if experts and "ep" in options.axes else ""),
             "Megatron's formula is of Megatron's own layout: TP and PP with its distributed optimizer (optimizer state "
             "sharded over dp, parameters and gradients whole on every dp rank), no CP; where FSDP shards the parameters "
             "and gradients too, ours is far below it",
             "peaks are the dry run's of each layout's plan (`tpplan apply --dry-run` of it gives the same); layouts are "
             "simulated in order of their step-time bound" + ("" if options.exhaustive else
                                                              f", until no later one can enter the top {options.top}")]
    if "ep" in options.axes and not experts:
        notes.append("ep is not searched: the base plan has no experts section (every layout has ep 1); for an MoE model, "
                     "name its experts in one, as plans/qwen3_moe_fsdp_ep.yaml does")
    elif experts and "ep" not in options.axes:
        notes.append("ep is not searched (not in --axes): the base plan's experts stay at ep 1, FSDP2 sharding them over "
                     "dp_shard·cp·tp")
    return notes
