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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.loader import load_plan
from ..core.plan import Plan
from ..core.problems import PlanError, error, first_line, raised_by_tpplan
from ..core.quiet import simulation_remarks_off
from ..core.degrees import tp_degrees
from ..core.units import human_bytes
from .report import ApplyReport
from ..check.check_problems import check_problems
from ..simulation.layouts import param_layouts
from ..simulation.locate import FailureLocator, run_located, shard_with_progress, unpromised_tp_note
from ..simulation.modelref import ModelRefError, build_model, load_callable, make_inputs
from ..simulation.one_device import one_device_failure, unsharded_failure
from .options import ApplyOptions, ApplyOptionsError


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


@simulation_remarks_off()
def dry_run(options: ApplyOptions, on_event: Callable[[str], None] | None = None) -> ApplyReport:
    """Simulate `options.tp` ranks in this process; the report (with problems, if
    any) of applying the plan and running one forward and backward."""
    event = on_event or (lambda text: None)
    if options.steps and not options.check:
        raise ApplyOptionsError("steps", "needs-ranks", "training steps need real ranks (torchrun), or real per-rank values "
                                "(--check); a dry run runs on fake tensors without values")
    report = ApplyReport(mode="dry-run", plan_file=options.plan, model=options.model, device="fake", backend="fake")
    try:
        plan = load_plan(options.plan)
    except PlanError as exc:
        report.problems = exc.problems
        return report
    tp, note = dry_run_tp(options, plan)
    report.plan_name, report.world_size, report.tp = plan.name, tp, tp
    planning = options.train.plans_memory  # memory planning picks its own degrees without --tp
    report.notes += [note] if note and not (planning and plan.mesh_sizes) else []
    report.notes += unpromised_tp_note(plan, tp) if not (planning and options.tp is None) else []
    if options.device not in ("auto", "cpu"):
        report.notes.append(f"--device {options.device} is not used: a dry run needs no device")
    factory = load_callable(options.model, "--model")  # a usage error before any work
    if options.save:
        raise ApplyOptionsError("save", "needs-ranks", "saving writes real weights: it needs real ranks (torchrun)")
    try:
        source = None
        if options.checkpoint:  # headers / metadata only, before building anything
            from ..checkpoint.run import open_checkpoint

            source = open_checkpoint(options.checkpoint)
        if planning:
            from .memory_dryrun import dry_run_memory

            dry_run_memory(options, plan, factory, report, event)
            if source is not None:
                report.notes.append("the checkpoint is not checked against the model with memory planning: dry-run it without the memory options")
            if options.check:
                try:
                    _check_pass(options, plan, _reference(options, factory), report, event)
                except _ValuesFailed as exc:
                    raise exc.problem(plan, tp) from None
        else:
            _passes(options, plan, factory, report, event, source)
    except PlanError as exc:
        report.problems += exc.problems
    return report


@simulation_remarks_off()
def dry_run_with(options: ApplyOptions, plan: Plan, factory: Callable[[], Any],
                 on_event: Callable[[str], None] | None = None) -> ApplyReport:
    """The dry run of a plan already loaded, with the model's factory already loaded, at
    `options.tp` (no memory planning, no checkpoint): what `tpplan init` proves its plans
    with, the same passes as `dry_run`."""
    report = ApplyReport(mode="dry-run", plan_file=options.plan, model=options.model, device="fake", backend="fake")
    report.plan_name, report.world_size, report.tp = plan.name, options.tp, options.tp
    try:
        _passes(options, plan, factory, report, on_event or (lambda text: None), None)
    except PlanError as exc:
        report.problems += exc.problems
    return report


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


class _Mismatch(Exception):
    """The checkpoint does not fit the sharded model: nothing to load, so nothing to check."""


class _ValuesFailed(Exception):
    """The run with real values raised where no plan error was found (its cause)."""

    def problem(self, plan: Plan, tp: int) -> PlanError:
        return PlanError([error("TP502", f"the --check run with real values fails at TP {tp}: {self}", plan.file)])


def _passes(options: ApplyOptions, plan: Plan, factory, report: ApplyReport, event, source) -> None:
    from ..simulation.ladder import values_allowed, values_short_of_memory

    loaded = bool(options.check and options.checkpoint)
    built = _build(options, factory, event, "meta" if loaded else "fake")
    if options.check and built.mode == ("meta" if loaded else "fake") and values_allowed(built.model):
        try:
            if loaded and _load_problems(built.model, source, options.allow_missing):
                raise _Mismatch()  # both sides would fail to load it: the fake pass reports why
            _check_pass(options, plan, _reference(options, factory, built), report, event, source)
            return
        except (_Mismatch, _ValuesFailed) as exc:
            failed = exc  # the fake pass tells what is wrong, or that only the values run fails
        if loaded:
            built = _build(options, factory, event, "fake")
        _fake_pass(options, plan, factory, report, event, built, source)
        if isinstance(failed, _ValuesFailed):
            raise failed.problem(plan, report.tp) from None
        return
    fake = built if built.mode == "fake" or not loaded else _build(options, factory, event, "fake")
    _fake_pass(options, plan, factory, report, event, fake, source)
    if options.check and not report.problems:  # above the values limit, or not buildable on fake tensors: a second pass (none when the checkpoint does not fit)
        short = values_short_of_memory(built.model)
        if short is not None:  # the pass would be killed for memory: said, and the check is null, not passed
            report.notes.append(f"--check was not run: {short}; the shapes and collectives above are from fake tensors "
                                "(check a smaller configuration, or under torchrun)")
            return
        try:
            _check_pass(options, plan, _reference(options, factory, built), report, event)
        except _ValuesFailed as exc:
            raise exc.problem(plan, report.tp) from None


def _load_problems(model, source, allow_missing) -> list:
    """The problems of loading the checkpoint `source` into the unsharded `model` (its metadata only)."""
    from ..checkpoint.run import inspect_into

    return inspect_into(model, source, allow_missing, 1)[1]


def _reference(options: ApplyOptions, factory, built: _Built | None = None) -> Callable[[], Any]:
    """How `check_parity` gets its single-device model: built with real values (and the
    seed), or for `--checkpoint` the meta model built already, which both sides load."""
    if options.checkpoint:
        return (lambda: built.model) if built is not None and built.mode == "meta" else (lambda: build_model(options.model, "meta", factory))
    return lambda: build_model(options.model, "cpu", factory)


def _fill(report: ApplyReport, plan: Plan, model, mesh, event, source, allow_missing) -> FailureLocator:
    """Apply the plan to `model`; the report's modules, rules, parameters and checkpoint
    entry from it. The failure locator of its run."""
    tp = report.tp
    sharded = shard_with_progress(plan, model, mesh, event)
    report.add_sharding(sharded)
    report.params = param_layouts(model, tp)
    if source is not None:  # the checkpoint's metadata against the sharded model
        from ..checkpoint.run import inspect_into

        report.checkpoint, found = inspect_into(model, source, allow_missing, tp)
        report.problems += found
    return FailureLocator(plan, model, sharded.rules, tp)


def _fake_pass(options: ApplyOptions, plan: Plan, factory, report: ApplyReport, event, built: _Built, source=None) -> None:
    from ..simulation.ladder import running, values_allowed
    from ..simulation.simulate import forward_backward, simulated_world, tp_mesh

    tp = report.tp
    if built.mode == "meta":  # fake tensors could not build it: the ladder's next rung
        assert built.failure is not None
        size = sum(p.numel() * p.element_size() for p in built.model.parameters())
        if not values_allowed(built.model):
            raise built.failure
        event("building the model with real values (fake tensors cannot build it)")
        _values_pass(options, plan, factory, report, event, unsharded_first=False)
        report.notes.append(
            f"fake tensors could not build the model ({built.failure.problems[0].message}); the shapes and collectives "
            f"come from real values of rank 0 ({human_bytes(size)} model)"
        )
        return
    with simulated_world(tp):
        mesh = tp_mesh(tp, plan.mesh_axis)  # outside fake mode: the mesh needs real rank lists
        model = built.model
        with running("fake", model, built.fake_mode):
            inputs = make_inputs(options.inputs, model, "cpu")
            locator = _fill(report, plan, model, mesh, event, source, options.allow_missing)
            event("forward and backward on fake tensors")
            with locator.tracking():
                try:
                    _, report.comms = forward_backward(model, inputs)
                    return
                except Exception as exc:  # the model or torch, on fake tensors: located below, or retried with values
                    if raised_by_tpplan(exc):
                        raise  # tpplan's own code: a bug, shown as one
                    failure, problem = exc, locator.problem(exc)
    # Above the limit, a model fake tensors cannot run is not retried with real
    # values: the retry would hold the whole model in memory. Whether it fails
    # without the plan too is decided shape-only, on fake tensors.
    if not values_allowed(model):
        blame = one_device_failure(options, factory)
        if blame is not None:
            raise blame
        raise PlanError([dataclasses.replace(problem, message=problem.message + (
            f" (on fake tensors; a run with real values would need {human_bytes(report.total_bytes)}: "
            "try --check on a smaller configuration, or torchrun)"
        ))])
    # Some kernels have no fake implementation, or a stricter one than the real
    # kernel: a small model is run again on one rank's real values instead.
    _values_pass(options, plan, factory, report, event, unsharded_first=True)
    report.notes.append(
        f"fake tensors could not run the forward and backward ({first_line(failure)}); "
        f"the collectives were counted with real values of rank 0 ({human_bytes(report.total_bytes)} model)"
    )


def _values_pass(options: ApplyOptions, plan: Plan, factory, report: ApplyReport, event, unsharded_first: bool) -> None:
    """The ladder's last rung: one build with real CPU values under the fake process
    group (collectives are no-ops: values are wrong, control flow is real) gives the
    shapes and collectives. A forward that fails sharded is the plan's only if the
    model runs without it, and a failure there is the model's TP500, at the line of its
    code that raised: `unsharded_first` (the sharded forward failed on fake tensors
    already), a copy runs first without the plan; otherwise a fresh build does, once
    the sharded forward failed."""
    import torch

    from ..simulation.simulate import forward_backward, simulated_world, tp_mesh

    tp = report.tp
    with simulated_world(tp):
        torch.manual_seed(options.seed)
        model = build_model(options.model, "cpu", factory)
        inputs = make_inputs(options.inputs, model, "cpu")
        if unsharded_first:
            event("forward and backward without the plan")
            _raise_if_unsharded_fails(options, copy.deepcopy(model), inputs)
        event("forward and backward with real values")
        locator = _fill(report, plan, model, tp_mesh(tp, plan.mesh_axis), event, None, ())
        try:
            _, report.comms = run_located(locator, lambda: forward_backward(model, inputs))
        except PlanError:
            if not unsharded_first:  # not looked at yet: a fresh build, the same seed, without the plan
                torch.manual_seed(options.seed)
                _raise_if_unsharded_fails(options, build_model(options.model, "cpu", factory), inputs)
            raise
    report.device = "cpu"


def _raise_if_unsharded_fails(options: ApplyOptions, model, inputs: tuple) -> None:
    failure = unsharded_failure(options, model, inputs)
    if failure is not None:
        raise failure


def _check_pass(options: ApplyOptions, plan: Plan, build, report: ApplyReport, event, source: Any = False) -> None:
    """`--check` with real per-rank values against one device (`check_parity`, the one
    engine; with `--checkpoint`, both sides load it). `source`: a checkpoint source or
    None when this pass also fills the report (the shapes, parameters and collectives
    come from it); False when an earlier pass did."""
    import torch

    from ..simulation.simulate import NoDefaultInputs
    from ..check.verify import check_parity

    tp = report.tp
    event(f"checking {tp} ranks with real values against a single device")
    inputs = make_inputs(options.inputs, None, "cpu") if options.inputs else None

    def shard(model, mesh) -> None:
        if source is False:
            shard_with_progress(plan, model, mesh, event)
            return
        before = len(report.problems)
        _fill(report, plan, model, mesh, event, source, options.allow_missing)
        if len(report.problems) > before:  # the load would fail on what inspect found
            del report.problems[before:]
            raise _Mismatch()

    try:
        result = check_parity(build, plan, tp, inputs, seed=options.seed, steps=options.steps, shard=shard,
                              dtype=None if options.checkpoint else torch.float32,
                              checkpoint=options.checkpoint, allow_missing=options.allow_missing)
    except (PlanError, _Mismatch):
        raise
    except NoDefaultInputs as exc:  # the reference's inputs, made inside check_parity: a usage error, as without --check
        raise ModelRefError(str(exc)) from None
    except Exception as exc:  # value-dependent code in the model, or a run only real values cannot simulate
        if raised_by_tpplan(exc):
            raise  # tpplan's own code: a bug, shown as one
        raise _ValuesFailed(first_line(exc)) from None
    if source is not False:
        report.comms = result.comms
    report.check = dataclasses.replace(result, problems=result.problems[:10], comms=None)
    report.notes += result.notes
    if not result.passed:
        report.problems += check_problems(result, plan, report.tp, f"--check failed at TP {report.tp}: {result.problems[0]}")
