"""`apply --dry-run` with memory planning: the memory plan at `--tp`, or at every
degree of the plan's mesh.sizes, over the mesh the dry run simulates (a version 1
plan's tp x --fsdp's dp, a version 2 plan's named axes: runtime/dry_world.py), one
simulated rank per distinct position (simulation/positions.py), as a result the
dry run puts in its report (the measurement itself is memory.py's)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..simulation.layouts import ParamLayout
from ..simulation.positions import MeshDims
from .memory import plan_memory
from .memory_report import DegreeFit, MemoryReport
from .reuse import block_reuse


@dataclass(frozen=True)
class RankPlan:
    """One simulated position: its coordinate ({dim: index}), the global ranks it
    stands for (positions.py says why they are alike), its memory and its
    collectives per axis (SPEC §7's `comms_by_axis`)."""

    position: dict[str, int]
    ranks: tuple[int, ...]
    memory: MemoryReport
    comms_by_axis: dict[str, dict[str, dict[str, dict[str, int]]]]

    @property
    def over_limit_bytes(self) -> int | None:
        """How far the peak is above --memory-limit (0: it fits; None: no limit)."""
        limit = self.memory.limit_bytes
        return None if limit is None else max(0, self.memory.per_rank_peak_bytes - limit)

    def to_json(self) -> dict[str, Any]:
        return {"position": dict(self.position), "memory": self.memory.to_json(), "global_ranks": list(self.ranks),
                "over_limit_bytes": self.over_limit_bytes, "comms_by_axis": self.comms_by_axis}


@dataclass(frozen=True)
class DegreePlan:
    """The memory plan at one TP degree: the plan applied (every module and parameter
    of the whole model, also when repeated blocks were simulated once), one training
    step's collectives (counts and bytes per phase) and memory of the worst rank, and
    every simulated position (`ranks`)."""

    tp: int
    dp: int
    mesh: dict[str, int]
    modules: dict[str, str]
    rule_of: dict[str, str]
    rule_where: dict[str, str]
    params: tuple[ParamLayout, ...]
    comms: dict[str, dict[str, int]]  # forward, backward
    comm_bytes: dict[str, dict[str, int]]
    optimizer_comms: dict[str, Any]  # {"counts", "bytes"}
    memory: MemoryReport
    notes: tuple[str, ...]  # what the planning chose (e.g. why no block was reused)
    ranks: tuple[RankPlan, ...] = ()
    comms_by_axis: dict[str, Any] | None = None  # the worst rank's
    pipeline: Any = None  # pipeline_dryrun.PipelinePlan: a pipeline's stages and pp ranks


@dataclass(frozen=True)
class MemoryPlan:
    """The degree the report shows (the smallest that fits, else the largest), the
    rows of every degree planned when there were several, and what to tell the user."""

    chosen: DegreePlan
    sweep: tuple[DegreeFit, ...]  # empty when one degree was planned
    notes: tuple[str, ...]


def unused_size_note(options) -> list[str]:
    """A note when --inputs is given with --batch or --seq, which size only the default inputs."""
    train = options.train
    if options.inputs and any(size is not None for size in (train.batch, train.seq, train.global_batch)):
        given = "the plan's training section" if set(train.from_plan) & {"global_batch", "seq"} else "--batch and --seq"
        return [f"--inputs gives the inputs: {given} size only the default inputs and are not used"]
    return []


def dry_run_memory(options, plan, factory, event: Callable[[str], None], dims_at: Callable[[int], MeshDims]) -> MemoryPlan:
    """The memory plan: at `options.tp`, or at every degree of the plan's mesh.sizes
    (the report then shows the smallest degree that fits, else the largest, and the
    table of all). At each degree, one simulated rank per distinct position of the
    mesh (simulation/positions.py; every rank with `options.every_rank`), the worst
    of them reported; `dims_at(tp)` is the mesh simulated at degree tp (the dry run's
    `dry_world.dry_run_dims`). A PlanError when no degree could be planned, or when the
    model fails on one device too (its own TP500)."""
    from ..core.degrees import tp_degrees
    from ..core.problems import PlanError, first_line
    from ..simulation.fsdp import after_rules_notes, expert_note
    from ..simulation.layouts import param_layouts
    from ..simulation.locate import FailureLocator, Sharded, shard_with_progress, unpromised_tp_note
    from ..simulation.modelref import build_model, make_inputs
    from ..simulation.one_device import blamed
    from ..simulation.forked import Forked
    from ..simulation.positions import distinct_positions, every_rank, ring_ranks

    train = options.train
    # core/degrees.py's rule, as the dry run's (dry_run_tp refused a run with neither); every
    # promised degree, smallest first: the report shows the smallest that fits
    degrees = sorted(tp_degrees(options.tp, plan.mesh_sizes))
    seq = train.seq or 8

    def batch_at(dims) -> int:
        """Each data-parallel rank's batch on mesh `dims`: --batch, or the plan's
        training.global_batch over its dp_replicate·dp_shard, else 2."""
        return train.batch_at(dims.sizes) or 2

    @functools.cache  # the same at every degree: decided once
    def blame_model(batch: int) -> PlanError | None:
        """The model's own TP500 when it fails without the plan on one device too (in
        the planned dtype)."""
        from ..simulation.one_device import one_device_failure
        from ..simulation.training import torch_dtype

        event("forward and backward without the plan")
        return one_device_failure(options, factory, torch_dtype(train.dtype), batch, seq)

    def at_rank(dims, rank: int, stage=None, quiet: bool = False):
        """One simulated rank: its planned step, and the plan as applied there (modules, parameters).
        `stage` (pipeline_dryrun.StageRun): a pipeline stage cut from the model around the TP
        rules, its microbatch's step measured. `quiet`: no progress events (a forked child's)."""
        say = (lambda text: None) if quiet else event
        applied: dict[str, tuple[Sharded, list[ParamLayout], FailureLocator]] = {}
        failed: list[PlanError] = []  # the sharded step raised (not the build or the plan's application)

        def shard(model, mesh):
            sharded = shard_with_progress(plan, model, mesh, say)
            applied["plan"] = (sharded, param_layouts(model, dims.tp), FailureLocator(plan, model, sharded.rules, dims.tp))
            if stage is not None:
                stage.after_rules(model)

        def run(step):
            from ..simulation.locate import run_located

            try:
                return run_located(applied["plan"][2], step)
            except PlanError as exc:
                failed.append(exc)
                raise

        where = " x ".join(f"{name} {size}" for name, size in zip(dims.names, dims.shape))
        say(f"planning memory on {where}" + (f", rank {rank}" if rank else ""))
        try:
            planned = plan_memory(
                plan,
                lambda: build_model(options.model, "cpu", factory),
                stage.inputs if stage is not None else lambda model: make_inputs(options.inputs, model, "cpu", batch=batch_at(dims), seq=seq),
                shard,
                dims,
                train,
                run,
                (None if not options.reuse_blocks else block_reuse(plan, say)) if stage is None else
                stage.strategy(block_reuse(plan, say) if options.reuse_blocks else None),
                rank,
                stage.io if stage is not None else None,
            )
        except PlanError as exc:
            # a failed step is the plan's only if the model runs without it
            raise (blamed(exc, lambda: blame_model(batch_at(dims))) if failed else exc) from None
        return planned, applied["plan"]

    def pipelined(tp: int) -> DegreePlan:
        """A pipeline's plan (pipeline_dryrun.py): each stage's microbatch, each pp rank's step; the worst rank reported."""
        import dataclasses

        from .pipeline_dryrun import ONE_STAGE, plan_pipeline, rank_comms, rescheduled, shared, whole_model

        dims = dims_at(tp)
        by_stage: dict[int, tuple] = {}  # by stage simulated: the plan as applied there (its stage's blocks)
        schedule = plan.spec.pipeline.schedule

        def simulate(rank: int, stage):
            planned, (sharded, params, _) = at_rank(dims, rank, stage)
            reused = planned.memory.reuse  # the stage's repeated blocks simulated once: its whole names
            by_stage[stage.index] = (reused.expand(sharded.rules.items()) if reused else list(sharded.rules.items()),
                                     reused.expand_params(params) if reused else params, sharded.under,
                                     f"stage {stage.index}: {reused.describe()}" if reused else None)
            return planned

        def stages() -> tuple:
            pipeline, steps = plan_pipeline(plan, dims, train.batch_at(dims.sizes), seq, simulate, lambda model, size: make_inputs(
                options.inputs, model, "cpu", batch=size, seq=seq), event, options.reuse_blocks)
            return pipeline, steps, dict(by_stage)

        # the same pipeline under the other one-stage schedule simulates the same stages (fit's layouts: shared_stages)
        key = (options.model, options.inputs, options.reuse_blocks, repr(train), seq, tp, tuple(dims.sizes.items()),
               repr(plan.rules), plan.spec.model_dump_json(exclude={"name": True, "description": True, "pipeline": {"schedule"}}),
               ) if schedule in ONE_STAGE else None
        (pipeline, steps, simulated_stages), taken = shared(key, stages)
        by_stage, source = simulated_stages, pipeline.schedule
        if source != schedule:
            pipeline = rescheduled(pipeline, schedule)
        # the whole model's modules and parameters, put together from the stages
        sharded = Sharded(dict(whole_model(pipeline, {i: found[0] for i, found in by_stage.items()})), by_stage[0][2])
        params = [dataclasses.replace(layout, name=name) for name, layout in
                  whole_model(pipeline, {i: [(p.name, p) for p in found[1]] for i, found in by_stage.items()})]
        pp = dims.sizes["pp"]
        per = dims.world // pp
        reports = []
        first = steps[0].memory
        for rank in pipeline.ranks:
            reports.append(MemoryReport(tp=dims.tp, dp=dims.dp // pp, per_rank_peak_bytes=rank.peak_bytes, categories=rank.categories,
                                        peak_module=rank.peak_action, limit_bytes=train.memory_limit, batch=pipeline.microbatch_size,
                                        seq=first.seq, dtype=first.dtype, optimizer=first.optimizer))
        worst = max(range(pp), key=lambda r: reports[r].per_rank_peak_bytes)
        comms = rank_comms(pipeline, worst, dims.names)
        notes = [f"pipeline: {pipeline.schedule} over pp {pp}, {len(pipeline.stages)} stages, {pipeline.microbatches} "
                 f"microbatches of {pipeline.microbatch_size} per step; each stage's microbatch simulated once "
                 f"({len(steps)} simulated{', alike stages reused' if options.reuse_blocks else ''}), each pp rank's step "
                 "composed in its schedule's order; "
                 f"bubble {pipeline.bubble:.3f}; the worst is pp {worst}"]
        notes += [found[3] for found in by_stage.values() if found[3]]  # the blocks reused within a stage
        if taken:
            notes.append(f"the stages were taken from this process's earlier dry run of the same pipeline under {source}, "
                         "which simulates them alike")
        return DegreePlan(
            tp=tp, dp=dims.dp // pp, mesh=dims.sizes, modules=sharded.modules, rule_of=sharded.rule_of, rule_where=sharded.rule_where,
            params=tuple(params), comms=comms["comms"], comm_bytes=comms["bytes"], optimizer_comms=comms["optimizer"],
            memory=reports[worst], notes=tuple(notes),
            ranks=tuple(RankPlan({**dict.fromkeys(dims.names, 0), "pp": r}, tuple(range(r * per, (r + 1) * per)), reports[r],
                                 rank_comms(pipeline, r, dims.names)["by_axis"]) for r in range(pp)),
            comms_by_axis=comms["by_axis"], pipeline=pipeline)

    def one(tp: int) -> DegreePlan:
        if plan.version == 2 and plan.spec.pipeline is not None:
            return pipelined(tp)
        dims = dims_at(tp)
        # the other positions, options.jobs at once in forked children (simulation/forked.py), those
        # known before rank 0 (cp's) started with it
        with Forked(options.jobs, lambda rank: at_rank(dims, rank, quiet=True)[0]) as others:
            for rank in ring_ranks(dims):
                others.start(rank)
            planned, (sharded, params, _) = at_rank(dims, 0)
            layouts = planned.layouts
            positions = every_rank(dims) if options.every_rank else distinct_positions(dims, layouts, planned.memory.seq, plan.mesh_axis)
            for position in positions[1:]:
                others.start(position.rank)
            ranks = [(position, planned if position.rank == 0 else others.result(position.rank)) for position in positions]
        _, worst = max(ranks, key=lambda found: found[1].memory.per_rank_peak_bytes)  # the first of the highest
        modules, rule_of = sharded.modules, sharded.rule_of
        reused = planned.memory.reuse
        if reused is not None:  # the report names every module and parameter of the whole model
            modules, rule_of, params = reused.expand_dict(modules), reused.expand_dict(rule_of), reused.expand_params(params)
        notes = list(worst.notes)
        if plan.version == 2:  # what follows the TP rules, as torchrun's report says it
            if experts := expert_note(plan, list(plan.match_experts(modules)), dims.sizes, planned.blocks):
                notes += [experts[0] + "; routing simulated as balanced (each rank sends an equal share of its tokens to "
                          "every ep rank: the fake world has no router values), so the all_to_all bytes and the experts' "
                          "activations are those of even routing, and a skewed router needs headroom above them"]
            notes += after_rules_notes(plan, planned.checkpointed, dims.sizes if dims.dp > 1 else None)
        if dims.dp > 1 or len(positions) > 1 or options.every_rank:  # which ranks stand for which (a TP-only even world: rank 0 for all)
            notes.append(_positions_note(dims, positions, options.every_rank))
        return DegreePlan(
            tp=tp,
            dp=dims.dp,
            mesh=dims.sizes,
            modules=modules,
            rule_of=rule_of,
            rule_where=sharded.rule_where,
            params=tuple(params),
            comms={phase: worst.step.comms[phase] for phase in ("forward", "backward")},
            comm_bytes={phase: worst.step.comm_bytes[phase] for phase in ("forward", "backward")},
            optimizer_comms={"counts": worst.step.comms["optimizer"], "bytes": worst.step.comm_bytes["optimizer"]},
            memory=worst.memory,
            notes=tuple(notes),
            ranks=tuple(RankPlan(dims.position(p.rank), p.ranks, step.memory, step.step.comms_by_axis(dims.names)) for p, step in ranks),
            comms_by_axis=worst.step.comms_by_axis(dims.names),
        )

    results: dict[int, DegreePlan] = {}
    sweep: list[DegreeFit] = []
    failures: dict[int, PlanError] = {}
    for tp in degrees:
        try:
            results[tp] = one(tp)
        except PlanError as exc:
            if len(degrees) == 1 or exc.problems[0].code == "TP500":  # the model's own failure: the same at every degree
                raise
            failures[tp] = exc
            sweep.append(DegreeFit(tp, train.dp, None, None, first_line(exc)))
            continue
        memory = results[tp].memory
        sweep.append(DegreeFit(tp, results[tp].dp, memory.per_rank_peak_bytes, memory.fits))
    if not results:
        raise next(iter(failures.values()))
    fitting = [tp for tp in results if results[tp].memory.fits]
    chosen = min(fitting) if fitting else max(results)
    notes = list(results[chosen].notes)
    if len(degrees) > 1:
        why = "the smallest that fits" if fitting else ("none fits: the largest" if train.memory_limit is not None else "the largest")
        notes.append(f"--tp not given: planned every degree of the plan's mesh.sizes {degrees}; the report is TP {chosen}, {why}")
    notes += unpromised_tp_note(plan, chosen) if options.tp is None else []
    return MemoryPlan(results[chosen], tuple(sweep) if len(degrees) > 1 else (), tuple(notes))


def _positions_note(dims, positions, every: bool) -> str:
    """Which ranks were simulated, and why the others are equal to them."""
    from ..simulation.positions import ranks_text

    if every:
        return f"every one of the {dims.world} ranks simulated (--every-rank)"
    shown = "; ".join(
        " · ".join(f"{name} {index}" for name, index in dims.position(p.rank).items()) + f" (ranks {ranks_text(p.ranks)})"
        for p in positions[:4]
    ) + (f"; and {len(positions) - 4} more" if len(positions) > 4 else "")
    return (f"{len(positions)} distinct position(s) of {dims.world} ranks simulated: {shown}. Ranks holding equal shapes "
            "(every parameter's shard and its FSDP2-gathered whole, the sequence chunk on tp) run the same step; dp_replicate ranks are replicas, "
            "dp_shard and tp ranks differ only where a dim does not divide evenly"
            + ("; each cp rank runs its own part of the ring" if dims.sizes.get("cp", 1) > 1 else ""))
