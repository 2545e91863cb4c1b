"""`apply --dry-run` with memory planning: the memory plan at `--tp`, or at every
degree of the plan's mesh.sizes, assembled into the apply report (the
measurement itself is memory.py's)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..memory.memory import plan_memory
from ..memory.reuse import block_reuse


def dry_run_memory(options, plan, factory, report, event: Callable[[str], None]) -> None:
    """Fill `report` (an ApplyReport) with the memory plan: at `options.tp`, or at
    every degree of the plan's mesh.sizes (the report then shows the smallest
    degree that fits, else the largest, and the table of all)."""
    from ..core.degrees import tp_degrees
    from ..core.problems import PlanError, first_line, raised_by_tpplan
    from ..simulation.layouts import param_layouts
    from ..simulation.locate import FailureLocator, shard_with_progress, unpromised_tp_note
    from ..memory.memory_report import DegreeFit
    from ..simulation.modelref import build_model, make_inputs
    from .report import ApplyReport

    train = options.train
    # core/degrees.py's rule, as the dry run's (dry_run_tp refused a run with neither); every
    # promised degree, smallest first: the report shows the smallest that fits
    degrees = sorted(tp_degrees(options.tp, plan.mesh_sizes))
    if options.inputs and (train.batch is not None or train.seq is not None):
        report.notes.append("--inputs gives the inputs: --batch and --seq size only the default inputs and are not used")
    batch, seq = train.batch or 2, train.seq or 8

    @functools.cache  # the same at every degree: decided once
    def blame_model() -> PlanError | None:
        """The model's own TP500 when it fails without the plan on one device too (in
        the planned dtype)."""
        from ..simulation.one_device import one_device_failure
        from ..simulation.training import torch_dtype

        event("forward and backward without the plan")
        return one_device_failure(options, factory, torch_dtype(train.dtype), batch, seq)

    def one(tp: int) -> ApplyReport:
        scratch = ApplyReport(mode="dry-run", plan_file=report.plan_file, model=report.model, device="fake", backend="fake")
        scratch.tp, scratch.dp, scratch.world_size = tp, train.dp, tp * train.dp
        located: dict[str, FailureLocator] = {}
        failed: list[bool] = []  # the sharded step raised (not the build or the plan's application)

        def shard(model, mesh):
            sharded = shard_with_progress(plan, model, mesh, event)
            scratch.add_sharding(sharded)
            scratch.params = param_layouts(model, tp)
            located["locator"] = FailureLocator(plan, model, sharded.rules, tp)

        def run(step):
            locator = located["locator"]
            with locator.tracking():
                try:
                    return step()
                except Exception as exc:  # the model or torch on fake tensors: located at the module and rule
                    if raised_by_tpplan(exc):
                        raise  # tpplan's own code: a bug, shown as one
                    problem = locator.problem(exc)
            failed.append(True)
            raise PlanError([problem])

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
        except PlanError:
            blame = blame_model() if failed else None  # a failed step is the plan's only if the model runs without it
            if blame is not None:
                raise blame from None
            raise
        reused = planned.memory.reuse
        if reused is not None:  # the report names every module and parameter of the whole model
            scratch.modules, scratch.rule_of = reused.expand_dict(scratch.modules), reused.expand_dict(scratch.rule_of)
            scratch.params = reused.expand_params(scratch.params)
        scratch.notes = planned.notes
        scratch.memory = planned.memory
        scratch.comms = {phase: planned.step.comms[phase] for phase in ("forward", "backward")}
        scratch.comm_bytes = {phase: planned.step.comm_bytes[phase] for phase in ("forward", "backward")}
        scratch.optimizer_comms = {"counts": planned.step.comms["optimizer"], "bytes": planned.step.comm_bytes["optimizer"]}
        return scratch

    results: dict[int, ApplyReport] = {}
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
    best = results[chosen]
    for name in ("modules", "rule_of", "rule_where", "params", "comms", "memory", "comm_bytes", "optimizer_comms", "tp", "dp", "world_size"):
        setattr(report, name, getattr(best, name))
    report.notes += best.notes
    report.memory_sweep = sweep if len(degrees) > 1 else []
    if len(degrees) > 1:
        why = "the smallest that fits" if fitting else ("none fits: the largest" if train.memory_limit is not None else "the largest")
        report.notes.append(f"--tp not given: planned every degree of the plan's mesh.sizes {degrees}; the report is TP {chosen}, {why}")
    report.notes += unpromised_tp_note(plan, chosen) if options.tp is None else []
