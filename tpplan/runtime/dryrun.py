"""`tpplan apply --dry-run --tp N`: one process plays N ranks.

The model is built on fake tensors (FakeTensorMode: shapes, dtypes and devices
without storage) and parallelized under torch's fake process group, so a model
of any size costs no real memory and no devices:
the report's per-rank shapes, bytes and collective counts come from the real
DTensor machinery, only the values are missing. `--check` runs with real
per-rank values instead (`LocalTensorMode`), compared with a single-device
reference (`verify.check_parity`, the engine torchrun's `--check` uses too),
`--checkpoint` included.

One build per degree, and the fewest passes (`_passes`): the model is built
once, on fake tensors (or, for `--check --checkpoint`, on the meta device, which
both sides then load); for `--check` on a model under the values limit, the
values pass alone gives the shapes, parameters and collectives too, and the fake
pass runs only when it fails (to tell why), above the limit, or without
`--check`. When fake tensors cannot build or run the model, the next rung of the
fallback ladder (`ladder.py`, shared with the lint) is one build with real
values, for small models.

A forward that fails sharded is the plan's only if the model runs without it:
before a rule is blamed, the unsharded model runs one forward and backward on
one device (`one_device_failure`), with real values under the values limit and
shape-only on fake tensors above it, so that a model failing there too (a
float32 table multiplied into bf16 activations) is its own TP500 at any size.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..check.check_problems import check_problems
from ..check.result import CheckResult
from ..core.degrees import tp_degrees
from ..core.loader import load_plan
from ..core.plan import Plan
from ..core.problems import PlanError, Problem, error, first_line, raised_by_tpplan
from ..core.quiet import simulation_remarks_off
from ..core.units import human_bytes
from ..simulation.layouts import ParamLayout, param_layouts
from ..simulation.locate import FailureLocator, Sharded, run_located, shard_with_progress, unpromised_tp_note
from ..simulation.modelref import ModelRefError, build_model, load_callable, make_inputs
from ..simulation.one_device import blamed, one_device_failure, unsharded_failure
from .checkpoint_layout import applies, checkpoint_dry_run
from .dry_world import check_world, dry_run_dims, plans_world, simulates_world
from .options import ApplyOptions, ApplyOptionsError, refuse_unapplied, training_note, with_training
from .report import ApplyReport

if TYPE_CHECKING:
    from ..memory.memory_dryrun import MemoryPlan


def dry_run_tp(options: ApplyOptions, plan: Plan) -> tuple[int, str | None]:
    """The degree to simulate, and a note when it was not given on the command line."""
    if options.tp is not None and options.tp < 1:
        raise ApplyOptionsError("tp", "below-one", f"{options.tp} is not at least 1", tp=options.tp)
    # core/degrees.py's rule with no default of its own: a simulation at a degree nobody named proves nothing asked
    degrees = tp_degrees(options.tp, plan.mesh_sizes)
    if not degrees:
        raise ApplyOptionsError("tp", "missing", "a dry run needs a TP degree and the plan lists no mesh.sizes to pick from")
    if options.tp is not None:
        return options.tp, None
    tp = max(degrees)
    return tp, f"--tp not given: simulating TP {tp}, the largest of the plan's mesh.sizes {list(plan.mesh_sizes)}"


# -- what each pass returns ----------------------------------------------------------


@dataclass(frozen=True)
class _Applied:
    """The plan applied to one build: which rule styled each module, what each rank
    holds of each parameter, and with --checkpoint the checkpoint's entry for the
    sharded model and the problems of loading it."""

    sharded: Sharded
    params: tuple[ParamLayout, ...]
    checkpoint: dict | None = None
    load_problems: tuple[Problem, ...] = ()


@dataclass(frozen=True)
class _Run:
    """What one pass gives the report. `applied`: each application of the plan, in
    order (the last one's modules and parameters are reported); `failure`: why the
    pass stopped (the dry run stops with it), None when it ran through."""

    applied: tuple[_Applied, ...] = ()
    comms: dict[str, dict[str, int]] | None = None
    device: str | None = None  # "cpu" when the shapes and collectives came from real values
    notes: tuple[str, ...] = ()
    check: CheckResult | None = None
    problems: tuple[Problem, ...] = ()  # a failed check's
    failure: PlanError | None = None


class _Shapes(enum.Enum):
    """Where a `--check` pass stands to the report's shapes, parameters and collectives."""

    GIVEN = "an earlier pass gave them: the check only checks"
    HERE = "this pass gives them (with --checkpoint, after the checkpoint is matched against the sharded model)"


class _Verdict(enum.Enum):
    """How a `--check` pass ended."""

    RAN = "it ran: its check (passed or not) or its plan error stands"
    MISMATCH = "the checkpoint does not fit the sharded model: nothing to load, so nothing to check"
    VALUES_FAILED = "the run with real values raised where no plan error was found"


@dataclass(frozen=True)
class _Checked:
    """A `--check` pass: what it gives the report, how it ended, and for VALUES_FAILED why."""

    run: _Run
    verdict: _Verdict = _Verdict.RAN
    cause: str = ""

    def values_failure(self, plan: Plan, tp: int) -> _Run:
        """The TP502 of a run with real values that failed where no plan error was found."""
        return _Run(failure=PlanError([error("TP502", f"the --check run with real values fails at TP {tp}: {self.cause}", plan.file)]))


class _Mismatch(Exception):
    """Raised by the check's `shard` callback to stop `check_parity` when the checkpoint
    does not fit the sharded model; it never leaves `_check_pass`, which returns MISMATCH."""


# -- the dry run ---------------------------------------------------------------------


@simulation_remarks_off()
def dry_run(options: ApplyOptions, on_event: Callable[[str], None] | None = None) -> ApplyReport:
    """Simulate `options.tp` ranks in this process; the report (with problems, if
    any) of applying the plan and running one forward and backward."""
    event = on_event or (lambda text: None)
    if options.steps and not options.check:
        raise ApplyOptionsError("steps", "needs-ranks", "training steps need real ranks (torchrun), or real per-rank values "
                                "(--check); a dry run runs on fake tensors without values")
    try:
        plan = load_plan(options.plan)
    except PlanError as exc:
        return ApplyReport(mode="dry-run", plan_file=options.plan, model=options.model, device="fake", backend="fake", problems=exc.problems)
    if applies(options, plan):  # a layout not simulated yet: the checkpoint checked against it from headers alone
        return checkpoint_dry_run(options, plan, event)  # (asked on the command line: the plan's training section plans no step here)
    options = with_training(options, plan)  # the step to plan: the plan's training section under the flags
    if plan.version == 2 and plan.spec.context_parallel is not None and plan.mesh.sizes["cp"] != 1 and not plans_world(options):
        from .dryrun_cp import context_parallel_dry_run

        return context_parallel_dry_run(options, plan)  # one CUDA rank's shapes and the ring's collectives
    refuse_unapplied(plan, "dry-run")
    check_world(options, plan)
    # A world beyond the TP axis (a version 2 plan's data axes, checkpointing) is planned
    # as --fsdp's always was: per rank, with memory, on fake tensors.
    whole_world = simulates_world(plan, options)
    if whole_world and options.check:
        raise ApplyOptionsError("check", "data-axes", "the check compares real per-rank values of the TP axis with one device; "
                                "a dry run does not simulate the data axes with values (torchrun's check does)")
    if options.every_rank and not (whole_world or options.train.plans_memory):
        raise ApplyOptionsError("every_rank", "needs-memory", "every rank's simulation is a memory plan: give a memory "
                                "option (batch, seq, dtype, optimizer, memory limit) or a plan with data axes")
    tp, note = dry_run_tp(options, plan)
    planning = options.train.plans_memory or whole_world  # memory planning picks its own degrees without --tp
    notes = [note] if note and not (planning and plan.mesh_sizes) else []
    notes += unpromised_tp_note(plan, tp) if not (planning and options.tp is None) else []
    if options.device not in ("auto", "cpu"):
        notes.append(f"--device {options.device} is not used: a dry run needs no device")
    factory = load_callable(options.model, "--model")  # a usage error before any work
    if options.save:
        raise ApplyOptionsError("save", "needs-ranks", "saving writes real weights: it needs real ranks (torchrun)")
    memory: MemoryPlan | None = None
    runs: list[_Run] = []
    try:
        source = None
        if options.checkpoint:  # headers / metadata only, before building anything
            from ..checkpoint.run import open_checkpoint

            source = open_checkpoint(options.checkpoint)
        if planning:
            from ..memory.memory_dryrun import dry_run_memory, unused_size_note

            notes += unused_size_note(options)
            if plan.version == 2 and plan.spec.pipeline is not None:
                _check_microbatches(plan, options.train.batch)  # --batch's (the plan's global batch: its checks, TP153)
            memory = dry_run_memory(options, plan, factory, event, lambda tp: dry_run_dims(options, plan, tp))
            notes += training_note(options.train, memory.chosen.mesh)
            if source is not None:
                runs.append(_Run(notes=("the checkpoint is not checked against the model with memory planning: dry-run it without the memory options",)))
            if options.check:
                checked = _check_pass(options, plan, _reference(options, factory), memory.chosen.tp, event, _Shapes.GIVEN)
                runs.append(checked.run)
                if checked.verdict is _Verdict.VALUES_FAILED:
                    runs.append(checked.values_failure(plan, tp))
        else:
            runs = _passes(options, plan, tp, factory, event, source)
    except PlanError as exc:
        runs.append(_Run(failure=exc))
    return _assembled(options, plan, tp, notes, runs, memory)


def _check_microbatches(plan: Plan, batch: int | None) -> None:
    """A usage error where --batch does not split into the pipeline's microbatches."""
    from ..core.stages import split_batch

    try:
        split_batch(plan, batch)
    except ValueError as exc:
        raise ApplyOptionsError("batch", "microbatches", str(exc), batch=batch) from None


@simulation_remarks_off()
def dry_run_with(options: ApplyOptions, plan: Plan, factory: Callable[[], Any],
                 on_event: Callable[[str], None] | None = None) -> ApplyReport:
    """The dry run of a plan already loaded, with the model's factory already loaded, at
    `options.tp` (no memory planning, no checkpoint): what `tpplan init` proves its plans
    with, the same passes as `dry_run`."""
    return _assembled(options, plan, options.tp, [], _passes(options, plan, options.tp, factory, on_event or (lambda text: None), None))


def _assembled(options: ApplyOptions, plan: Plan, tp: int, notes: list[str], runs: Sequence[_Run],
               memory: MemoryPlan | None = None) -> ApplyReport:
    """The report, built once from what the memory plan and each pass returned, in the
    order they ran: the last application of the plan gives the modules and parameters
    (the peft note once, where it first arose), the last one that matched a checkpoint
    its entry; notes and problems come in the order they arose, a failure last."""
    chosen = memory.chosen if memory is not None else None
    notes = [*notes, *(memory.notes if memory is not None else ())]
    applied = None
    checkpoint, comms, device, check = None, chosen.comms if chosen else None, "fake", None
    problems: list[Problem] = []
    for run in runs:
        for application in run.applied:
            applied = application
            note = application.sharded.note
            notes += [note] if note and note not in notes else []  # the dry run may shard twice (fake tensors, then values)
            checkpoint = application.checkpoint if application.checkpoint is not None else checkpoint
            problems += application.load_problems
        notes += run.notes
        comms = run.comms if run.comms is not None else comms
        device = run.device or device
        check = run.check or check
        problems += [*run.problems, *(run.failure.problems if run.failure else ())]
    return ApplyReport(
        mode="dry-run",
        plan_file=options.plan,
        model=options.model,
        world_size=chosen.tp * chosen.dp if chosen else tp,
        tp=chosen.tp if chosen else tp,
        dp=chosen.dp if chosen else 1,
        plan_name=plan.name,
        device=device,
        backend="fake",
        modules=applied.sharded.modules if applied else chosen.modules if chosen else {},
        rule_of=applied.sharded.rule_of if applied else chosen.rule_of if chosen else {},
        rule_where=applied.sharded.rule_where if applied else chosen.rule_where if chosen else {},
        params=list(applied.params if applied else chosen.params if chosen else ()),
        comms=comms,
        check=check,
        problems=problems,
        memory=chosen.memory if chosen else None,
        comm_bytes=chosen.comm_bytes if chosen else None,
        optimizer_comms=chosen.optimizer_comms if chosen else None,
        memory_sweep=list(memory.sweep) if memory is not None else [],
        notes=notes,
        checkpoint=checkpoint,
        mesh=dict(chosen.mesh) if chosen else None,
        comms_by_axis=chosen.comms_by_axis if chosen else None,
        ranks=list(chosen.ranks) if chosen else [],
        pipeline=chosen.pipeline.to_json() if chosen and chosen.pipeline is not None else None,
    )


@dataclass
class _Built:
    """The one build of the model for this degree: on fake tensors (`fake_mode` the mode
    they belong to), or on the meta device (`failure`: why fake tensors could not, if they were tried)."""

    model: Any
    mode: str
    fake_mode: Any = None
    failure: PlanError | None = None


def _build(options: ApplyOptions, factory, event, mode: str) -> _Built:
    from ..simulation.simulate import fake_tensors

    if mode == "meta":
        event("building the model on the meta device")
        return _Built(build_model(options.model, "meta", factory, real_buffers=True), "meta")  # for a checkpoint to fill
    event("building the model on fake tensors")
    # Fake tensors rather than bare meta ones: no memory either, and code that
    # checks for tracing (transformers' attention masks) skips the data-dependent
    # branches that meta tensors cannot run.
    try:
        with fake_tensors() as fake_mode:
            return _Built(build_model(options.model, "cpu", factory), "fake", fake_mode)
    except PlanError as exc:
        if exc.problems[0].code != "TP500":
            raise
        failure = exc
    try:  # a constructor fake tensors cannot run (it reads a value): the meta device may do
        return _Built(build_model(options.model, "meta", factory), "meta", failure=failure)
    except PlanError:
        raise failure from None  # the factory fails anyway: its own problem stands


def _passes(options: ApplyOptions, plan: Plan, tp: int, factory, event, source) -> list[_Run]:
    """The passes of one degree, in the order they ran, each with its result; a pass
    that failed is the last."""
    from ..simulation.ladder import values_allowed, values_short_of_memory

    loaded = bool(options.check and options.checkpoint)
    try:
        built = _build(options, factory, event, "meta" if loaded else "fake")
    except PlanError as exc:
        return [_Run(failure=exc)]
    if options.check and built.mode == ("meta" if loaded else "fake") and values_allowed(built.model):
        if loaded and _load_problems(built.model, source, options.allow_missing):
            checked = _Checked(_Run(), _Verdict.MISMATCH)  # both sides would fail to load it: the fake pass reports why
        else:
            checked = _check_pass(options, plan, _reference(options, factory, built), tp, event, _Shapes.HERE, source)
        if checked.verdict is _Verdict.RAN:
            return [checked.run]
        runs = [checked.run]  # the fake pass tells what is wrong, or that only the values run fails
        if loaded:
            try:
                built = _build(options, factory, event, "fake")
            except PlanError as exc:
                return [*runs, _Run(failure=exc)]
        shapes = _fake_pass(options, plan, tp, factory, event, built, source)
        runs.append(shapes)
        if checked.verdict is _Verdict.VALUES_FAILED and shapes.failure is None:
            runs.append(checked.values_failure(plan, tp))
        return runs
    try:
        fake = built if built.mode == "fake" or not loaded else _build(options, factory, event, "fake")
    except PlanError as exc:
        return [_Run(failure=exc)]
    shapes = _fake_pass(options, plan, tp, factory, event, fake, source)
    runs = [shapes]
    # above the values limit, or not buildable on fake tensors: a second pass (none when the checkpoint does not fit)
    if options.check and shapes.failure is None and not any(a.load_problems for a in shapes.applied):
        short = values_short_of_memory(built.model)
        if short is not None:  # the pass would be killed for memory: said, and the check is null, not passed
            runs.append(_Run(notes=(f"--check was not run: {short}; the shapes and collectives above are from fake tensors "
                                    "(check a smaller configuration, or under torchrun)",)))
            return runs
        checked = _check_pass(options, plan, _reference(options, factory, built), tp, event, _Shapes.GIVEN)
        runs.append(checked.run)
        if checked.verdict is _Verdict.VALUES_FAILED:
            runs.append(checked.values_failure(plan, tp))
    return runs


def _load_problems(model, source, allow_missing) -> list:
    """The problems of loading the checkpoint `source` into the unsharded `model` (its metadata only)."""
    from ..checkpoint.run import inspect_into

    return inspect_into(model, source, allow_missing, 1, {})[1]


def _reference(options: ApplyOptions, factory, built: _Built | None = None) -> Callable[[], Any]:
    """How `check_parity` gets its single-device model: built with real values (and the
    seed), or for `--checkpoint` the meta model built already, which both sides load."""
    if options.checkpoint:
        return (lambda: built.model) if built is not None and built.mode == "meta" else (lambda: build_model(options.model, "meta", factory))
    return lambda: build_model(options.model, "cpu", factory)


def _apply(plan: Plan, model, mesh, tp: int, event, source, allow_missing) -> tuple[_Applied, FailureLocator]:
    """Apply the plan to `model`: what it gives the report (modules, rules, parameters,
    the checkpoint matched against the sharded model), and the failure locator of its run."""
    sharded = shard_with_progress(plan, model, mesh, event)
    params = tuple(param_layouts(model, tp))
    checkpoint, found = None, []
    if source is not None:  # the checkpoint's metadata against the sharded model
        from ..checkpoint.run import inspect_into

        checkpoint, found = inspect_into(model, source, allow_missing, tp, {plan.mesh_axis: tp})
    return _Applied(sharded, params, checkpoint, tuple(found)), FailureLocator(plan, model, sharded.rules, tp)


def _fake_pass(options: ApplyOptions, plan: Plan, tp: int, factory, event, built: _Built, source=None) -> _Run:
    from ..simulation.ladder import running, values_allowed
    from ..simulation.simulate import forward_backward, simulated_world, tp_mesh

    if built.mode == "meta":  # fake tensors could not build it: the ladder's next rung
        assert built.failure is not None
        size = sum(p.numel() * p.element_size() for p in built.model.parameters())
        if not values_allowed(built.model):
            return _Run(failure=built.failure)
        event("building the model with real values (fake tensors cannot build it)")
        values = _values_pass(options, plan, tp, factory, event, unsharded_first=False)
        if values.failure is not None:
            return values
        return dataclasses.replace(values, notes=(*values.notes, (
            f"fake tensors could not build the model ({built.failure.problems[0].message}); the shapes and collectives "
            f"come from real values of rank 0 ({human_bytes(size)} model)"
        )))
    with simulated_world(tp):
        mesh = tp_mesh(tp, plan.mesh_axis)  # outside fake mode: the mesh needs real rank lists
        model = built.model
        with running("fake", model, built.fake_mode):
            try:
                inputs = make_inputs(options.inputs, model, "cpu")
                applied, locator = _apply(plan, model, mesh, tp, event, source, options.allow_missing)
            except PlanError as exc:
                return _Run(failure=exc)
            event("forward and backward on fake tensors")
            try:
                _, comms = run_located(locator, lambda: forward_backward(model, inputs))
                return _Run(applied=(applied,), comms=comms)
            except PlanError as exc:  # the model or torch, on fake tensors: located, or retried with values below
                failure, problem = exc.__cause__, exc.problems[0]
    # Above the limit, a model fake tensors cannot run is not retried with real
    # values: the retry would hold the whole model in memory. Whether it fails
    # without the plan too is decided shape-only, on fake tensors.
    if not values_allowed(model):
        located = PlanError([dataclasses.replace(problem, message=problem.message + (
            f" (on fake tensors; a run with real values would need {human_bytes(sum(p.global_bytes for p in applied.params))}: "
            "try --check on a smaller configuration, or torchrun)"
        ))])
        return _Run(applied=(applied,), failure=blamed(located, lambda: one_device_failure(options, factory)))
    # Some kernels have no fake implementation, or a stricter one than the real
    # kernel: a small model is run again on one rank's real values instead.
    values = _values_pass(options, plan, tp, factory, event, unsharded_first=True)
    notes = values.notes
    if values.failure is None:
        total = sum(p.global_bytes for p in values.applied[-1].params)
        notes += (f"fake tensors could not run the forward and backward ({first_line(failure)}); "
                  f"the collectives were counted with real values of rank 0 ({human_bytes(total)} model)",)
    return dataclasses.replace(values, applied=(applied, *values.applied), notes=notes)


def _values_pass(options: ApplyOptions, plan: Plan, tp: int, factory, event, unsharded_first: bool) -> _Run:
    """The ladder's last rung: one build with real CPU values under the fake process
    group (collectives are no-ops: values are wrong, control flow is real) gives the
    shapes and collectives. A forward that fails sharded is the plan's only if the
    model runs without it, and a failure there is the model's TP500, at the line of its
    code that raised: `unsharded_first` (the sharded forward failed on fake tensors
    already), a copy runs first without the plan; otherwise a fresh build does, once
    the sharded forward failed."""
    import torch

    from ..simulation.simulate import forward_backward, simulated_world, tp_mesh

    def fresh_unsharded() -> PlanError | None:  # not looked at yet: a fresh build, the same seed, without the plan
        torch.manual_seed(options.seed)
        return unsharded_failure(options, build_model(options.model, "cpu", factory), inputs)

    with simulated_world(tp):
        torch.manual_seed(options.seed)
        try:
            model = build_model(options.model, "cpu", factory)
            inputs = make_inputs(options.inputs, model, "cpu")
            if unsharded_first:
                event("forward and backward without the plan")
                own = unsharded_failure(options, copy.deepcopy(model), inputs)
                if own is not None:
                    return _Run(failure=own)
            event("forward and backward with real values")
            applied, locator = _apply(plan, model, tp_mesh(tp, plan.mesh_axis), tp, event, None, ())
        except PlanError as exc:
            return _Run(failure=exc)
        try:
            _, comms = run_located(locator, lambda: forward_backward(model, inputs))
        except PlanError as exc:
            return _Run(applied=(applied,), failure=exc if unsharded_first else blamed(exc, fresh_unsharded))
    return _Run(applied=(applied,), comms=comms, device="cpu")


def _check_pass(options: ApplyOptions, plan: Plan, build, tp: int, event, shapes: _Shapes, source=None) -> _Checked:
    """`--check` with real per-rank values against one device (`check_parity`, the one
    engine; with `--checkpoint`, both sides load it). `shapes`: whether this pass also
    gives the report the shapes, parameters and collectives (`source`: the checkpoint
    to match against the sharded model first, or None)."""
    import torch

    from ..check.verify import check_parity
    from ..simulation.simulate import NoDefaultInputs

    event(f"checking {tp} ranks with real values against a single device")
    try:
        inputs = make_inputs(options.inputs, None, "cpu") if options.inputs else None
    except PlanError as exc:
        return _Checked(_Run(failure=exc))
    applied: list[_Applied] = []

    def shard(model, mesh) -> None:
        if shapes is _Shapes.GIVEN:
            shard_with_progress(plan, model, mesh, event)
            return
        applied.append(_apply(plan, model, mesh, tp, event, source, options.allow_missing)[0])
        if applied[-1].load_problems:  # the load would fail on what inspect found
            raise _Mismatch()

    try:
        result = check_parity(build, plan, tp, inputs, seed=options.seed, steps=options.steps, shard=shard,
                              dtype=None if options.checkpoint else torch.float32,
                              checkpoint=options.checkpoint, allow_missing=options.allow_missing)
    except _Mismatch:  # its problems are the fake pass's to report
        return _Checked(_Run(applied=(dataclasses.replace(applied[-1], load_problems=()),)), _Verdict.MISMATCH)
    except PlanError as exc:
        return _Checked(_Run(applied=tuple(applied), failure=exc))
    except NoDefaultInputs as exc:  # the reference's inputs, made inside check_parity: a usage error, as without --check
        raise ModelRefError(str(exc)) from None
    except Exception as exc:  # value-dependent code in the model, or a run only real values cannot simulate
        if raised_by_tpplan(exc):
            raise  # tpplan's own code: a bug, shown as one
        return _Checked(_Run(applied=tuple(applied)), _Verdict.VALUES_FAILED, first_line(exc))
    problems = check_problems(result, plan, tp, f"--check failed at TP {tp}: {result.problems[0]}") if not result.passed else []
    return _Checked(_Run(
        applied=tuple(applied),
        comms=result.comms if shapes is _Shapes.HERE else None,
        notes=tuple(result.notes),
        check=dataclasses.replace(result, problems=result.problems[:10], comms=None),
        problems=tuple(problems),
    ))
