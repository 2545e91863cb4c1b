"""`apply --dry-run` with memory planning: the memory plan at `--tp`, or at every
degree of the plan's mesh.sizes, as a result the dry run puts in its report (the
measurement itself is memory.py's)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..simulation.layouts import ParamLayout
from .memory import plan_memory
from .memory_report import DegreeFit, MemoryReport
from .reuse import block_reuse


@dataclass(frozen=True)
class DegreePlan:
    """The memory plan at one TP degree: the plan applied (every module and parameter
    of the whole model, also when repeated blocks were simulated once), one training
    step's collectives (counts and bytes per phase) and its memory."""

    tp: int
    dp: int
    modules: dict[str, str]
    rule_of: dict[str, str]
    rule_where: dict[str, str]
    params: tuple[ParamLayout, ...]
    comms: dict[str, dict[str, int]]  # forward, backward
    comm_bytes: dict[str, dict[str, int]]
    optimizer_comms: dict[str, Any]  # {"counts", "bytes"}
    memory: MemoryReport
    notes: tuple[str, ...]  # what the planning chose (e.g. why no block was reused)


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
    if options.inputs and (train.batch is not None or train.seq is not None):
        return ["--inputs gives the inputs: --batch and --seq size only the default inputs and are not used"]
    return []


def dry_run_memory(options, plan, factory, event: Callable[[str], None]) -> MemoryPlan:
    """The memory plan: at `options.tp`, or at every degree of the plan's mesh.sizes
    (the report then shows the smallest degree that fits, else the largest, and the
    table of all). A PlanError when no degree could be planned, or when the model
    fails on one device too (its own TP500)."""
    from ..core.degrees import tp_degrees
    from ..core.problems import PlanError, first_line
    from ..simulation.layouts import param_layouts
    from ..simulation.locate import FailureLocator, Sharded, shard_with_progress, unpromised_tp_note
    from ..simulation.modelref import build_model, make_inputs
    from ..simulation.one_device import blamed

    train = options.train
    # core/degrees.py's rule, as the dry run's (dry_run_tp refused a run with neither); every
    # promised degree, smallest first: the report shows the smallest that fits
    degrees = sorted(tp_degrees(options.tp, plan.mesh_sizes))
    batch, seq = train.batch or 2, train.seq or 8

    @functools.cache  # the same at every degree: decided once
    def blame_model() -> PlanError | None:
        """The model's own TP500 when it fails without the plan on one device too (in
        the planned dtype)."""
        from ..simulation.one_device import one_device_failure
        from ..simulation.training import torch_dtype

        event("forward and backward without the plan")
        return one_device_failure(options, factory, torch_dtype(train.dtype), batch, seq)

    def one(tp: int) -> DegreePlan:
        applied: dict[str, tuple[Sharded, list[ParamLayout], FailureLocator]] = {}
        failed: list[PlanError] = []  # the sharded step raised (not the build or the plan's application)

        def shard(model, mesh):
            sharded = shard_with_progress(plan, model, mesh, event)
            applied["plan"] = (sharded, param_layouts(model, tp), FailureLocator(plan, model, sharded.rules, tp))

        def run(step):
            from ..simulation.locate import run_located

            try:
                return run_located(applied["plan"][2], step)
            except PlanError as exc:
                failed.append(exc)
                raise

        event(f"planning memory at TP {tp}" + (f" x FSDP {train.dp}" if train.dp > 1 else ""))
        try:
            planned = plan_memory(
                lambda: build_model(options.model, "cpu", factory),
                lambda model: make_inputs(options.inputs, model, "cpu", batch=batch, seq=seq),
                shard,
                tp,
                train,
                plan.mesh_axis,
                plan.loss_parallel,
                run,
                None if not options.reuse_blocks else block_reuse(plan, event),
            )
        except PlanError as exc:
            # a failed step is the plan's only if the model runs without it
            raise (blamed(exc, blame_model) if failed else exc) from None
        sharded, params, _ = applied["plan"]
        modules, rule_of = sharded.modules, sharded.rule_of
        reused = planned.memory.reuse
        if reused is not None:  # the report names every module and parameter of the whole model
            modules, rule_of, params = reused.expand_dict(modules), reused.expand_dict(rule_of), reused.expand_params(params)
        return DegreePlan(
            tp=tp,
            dp=train.dp,
            modules=modules,
            rule_of=rule_of,
            rule_where=sharded.rule_where,
            params=tuple(params),
            comms={phase: planned.step.comms[phase] for phase in ("forward", "backward")},
            comm_bytes={phase: planned.step.comm_bytes[phase] for phase in ("forward", "backward")},
            optimizer_comms={"counts": planned.step.comms["optimizer"], "bytes": planned.step.comm_bytes["optimizer"]},
            memory=planned.memory,
            notes=tuple(planned.notes),
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
        sweep.append(DegreeFit(tp, train.dp, memory.per_rank_peak_bytes, memory.fits))
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
