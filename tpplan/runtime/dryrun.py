"""`tpplan apply --dry-run --tp N`: one process plays N ranks.

The model is built on fake tensors (FakeTensorMode: shapes, dtypes and devices
without storage) and parallelized under torch's fake process group, so a model
of any size costs no real memory and no devices:
the report's per-rank shapes, bytes and collective counts come from the real
DTensor machinery, only the values are missing. `--check` adds a second run
with real per-rank values (`LocalTensorMode`)
compared with a single-device reference (`verify.check_parity`, the engine
torchrun's `--check` uses too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..core.loader import load_plan
from ..core.plan import Plan
from ..core.problems import PlanError, error, first_line
from .report import ApplyReport, human_bytes
from .check_problems import check_problems
from .layouts import param_layouts
from .locate import FailureLocator, apply_plan, raised_by_tpplan, run_located, shard_with_progress, unpromised_tp_note
from .modelref import build_model, load_callable, make_inputs, model_failure
from .options import ApplyOptions, ApplyOptionsError


def dry_run_tp(options: ApplyOptions, plan: Plan) -> tuple[int, str | None]:
    """The degree to simulate, and a note when it was not given on the command line."""
    if options.tp is not None:
        if options.tp < 1:
            raise ApplyOptionsError("tp", "below-one", f"{options.tp} is not at least 1", tp=options.tp)
        return options.tp, None
    if plan.mesh_sizes:
        tp = max(plan.mesh_sizes)
        return tp, f"--tp not given: simulating TP {tp}, the largest of the plan's mesh.sizes {list(plan.mesh_sizes)}"
    raise ApplyOptionsError("tp", "missing", "a dry run needs a TP degree and the plan lists no mesh.sizes to pick from")


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
        else:
            _simulate_shapes(options, plan, factory, report, event, source)
        if options.check:
            event(f"checking {tp} ranks with real values against a single device")
            _simulate_values(options, plan, factory, report)
    except PlanError as exc:
        report.problems += exc.problems
    return report


def _simulate_shapes(options: ApplyOptions, plan: Plan, factory, report: ApplyReport, event, source=None) -> None:
    from .simulate import VALUES_LIMIT_BYTES, fake_tensors, forward_backward, simulated_world, tp_mesh

    tp = report.tp
    with simulated_world(tp):
        mesh = tp_mesh(tp, plan.mesh_axis)
        # Fake tensors rather than bare meta ones: no memory either, and code that
        # checks for tracing (transformers' attention masks) skips the data-dependent
        # branches that meta tensors cannot run.
        build_failure = None
        with fake_tensors():
            event("building the model on fake tensors")
            try:
                model = build_model(options.model, "cpu", factory)
            except PlanError as exc:
                build_failure = exc
            if build_failure is None:
                inputs = make_inputs(options.inputs, model, "cpu")
                sharded = shard_with_progress(plan, model, mesh, event)
                report.modules, report.rule_of, report.rule_where = sharded.modules, sharded.rule_of, sharded.rule_where
                report.params = param_layouts(model, tp)
                if source is not None:  # the checkpoint's metadata against the sharded model
                    from ..checkpoint.run import inspect_into

                    report.checkpoint, found = inspect_into(model, source, options.allow_missing, tp)
                    report.problems += found
                event("forward and backward on fake tensors")
                locator = FailureLocator(plan, model, sharded.rules, tp)
                with locator.tracking():
                    try:
                        _, report.comms = forward_backward(model, inputs)
                        return
                    except Exception as exc:  # the model or torch, on fake tensors: located below, or retried with values
                        if raised_by_tpplan(exc):
                            raise  # tpplan's own code: a bug, shown as one
                        failure, problem = exc, locator.problem(exc)
    if build_failure is not None:  # outside FakeTensorMode: try meta, then real values
        if _built_with_values_instead(options, plan, factory, report, event, build_failure):
            return
        raise build_failure
    if report.total_bytes <= VALUES_LIMIT_BYTES:
        event("forward and backward without the plan")
        _raise_if_unsharded_fails(options, factory)
    # Above the limit, a model fake tensors cannot run is not retried with real
    # values: the retry would hold the whole model in memory.
    if report.total_bytes > VALUES_LIMIT_BYTES:
        raise PlanError([dataclasses.replace(problem, message=problem.message + (
            f" (on fake tensors; a run with real values would need {human_bytes(report.total_bytes)}: "
            "try --check on a smaller configuration, or torchrun)"
        ))])
    # Some kernels have no fake implementation, or a stricter one (grouped_mm wants
    # bfloat16): a small model is run again on one rank's real values instead.
    event("forward and backward with real values")
    report.comms = _count_with_values(options, plan, factory, tp)
    report.device = "cpu"
    report.notes.append(
        f"fake tensors could not run the forward and backward ({first_line(failure)}); "
        f"the collectives were counted with real values of rank 0 ({human_bytes(report.total_bytes)} model)"
    )


def _raise_if_unsharded_fails(options: ApplyOptions, factory) -> None:
    """A forward that fails sharded is the plan's only if the model runs without it: the
    same model and inputs on one device, with real values (a small model: fake tensors
    may fail where values would not), and a failure there is the model's TP500, at the
    line of its code that raised."""
    import torch

    from .simulate import forward_backward

    torch.manual_seed(options.seed)
    model = build_model(options.model, "cpu", factory)
    inputs = make_inputs(options.inputs, model, "cpu")
    try:
        forward_backward(model, inputs)
    except Exception as exc:  # the user's model on one device: its own problem, never the plan's
        if raised_by_tpplan(exc):
            raise
        shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
        hint = "" if options.inputs else f" (on the default inputs {shapes}: a model that needs others takes --inputs MOD:FN)"
        raise model_failure(options.model, "without the plan, one forward and backward on one device", exc,
                            f"the model fails on one device too{hint}, so the plan is not the cause: ") from None


def _built_with_values_instead(options: ApplyOptions, plan: Plan, factory, report: ApplyReport, event, failure: PlanError) -> bool:
    """Some models cannot be built on fake tensors (their constructor reads a value, or
    swaps parameters fake tensors cannot hold): when the factory fails only there (it
    builds on the meta device) and the model is small, the shapes and collectives come
    from one rank's real values instead. False when that does not apply."""
    import torch

    from .simulate import VALUES_LIMIT_BYTES, forward_backward, simulated_world, tp_mesh

    if failure.problems[0].code != "TP500":
        return False
    try:
        meta = build_model(options.model, "meta", factory)
    except PlanError:
        return False  # the factory fails anyway: its own problem stands
    size = sum(p.numel() * p.element_size() for p in meta.parameters())
    if size > VALUES_LIMIT_BYTES:
        return False
    tp = report.tp
    event("building the model with real values (fake tensors cannot build it)")
    with simulated_world(tp):
        torch.manual_seed(options.seed)
        model = build_model(options.model, "cpu", factory)
        inputs = make_inputs(options.inputs, model, "cpu")
        sharded = shard_with_progress(plan, model, tp_mesh(tp, plan.mesh_axis), event)
        report.modules, report.rule_of, report.rule_where = sharded.modules, sharded.rule_of, sharded.rule_where
        report.params = param_layouts(model, tp)
        _, report.comms = run_located(FailureLocator(plan, model, sharded.rules, tp), lambda: forward_backward(model, inputs))
    report.device = "cpu"
    report.notes.append(
        f"fake tensors could not build the model ({failure.problems[0].message}); the shapes and collectives "
        f"come from real values of rank 0 ({human_bytes(size)} model)"
    )
    return True


def _count_with_values(options: ApplyOptions, plan: Plan, factory, tp: int) -> dict:
    """Collectives of one forward and backward with real CPU values under the fake
    process group (collectives are no-ops: values are wrong, control flow is real)."""
    import torch

    from .simulate import forward_backward, simulated_world, tp_mesh

    with simulated_world(tp):
        torch.manual_seed(options.seed)
        model = build_model(options.model, "cpu", factory)
        inputs = make_inputs(options.inputs, model, "cpu")
        rules = apply_plan(plan, model, tp_mesh(tp, plan.mesh_axis))
        _, comms = run_located(FailureLocator(plan, model, rules, tp), lambda: forward_backward(model, inputs))
    return comms


def _simulate_values(options: ApplyOptions, plan: Plan, factory, report: ApplyReport) -> None:
    from .verify import check_parity

    inputs = make_inputs(options.inputs, None, "cpu") if options.inputs else None
    try:
        if options.checkpoint:
            result = _check_loaded(options, plan, factory, report.tp, inputs)
        else:
            result = check_parity(
                lambda: build_model(options.model, "cpu", factory), plan, report.tp, inputs, seed=options.seed, steps=options.steps
            )
    except PlanError:
        raise
    except Exception as exc:  # the fake-tensor run passed, so this is value-dependent code in the model
        if raised_by_tpplan(exc):
            raise  # tpplan's own code: a bug, shown as one
        raise PlanError([error("TP502", f"the --check run with real values fails at TP {report.tp}: {first_line(exc)}", plan.file)]) from None
    report.check = dataclasses.replace(result, problems=result.problems[:10], comms=None)
    report.notes += result.notes
    if not result.passed:
        report.problems += check_problems(result, plan, report.tp, f"--check failed at TP {report.tp}: {result.problems[0]}")


def _check_loaded(options: ApplyOptions, plan: Plan, factory, tp: int, inputs):
    """--check --checkpoint: every simulated rank reads its own slices of the
    checkpoint (tpplan.checkpoint.simulate); outputs and gradients against the
    single-device model loaded from the same checkpoint."""
    import torch

    from ..checkpoint.load import load_checkpoint
    from ..checkpoint.simulate import simulated_load
    from .simulate import default_inputs, forward_backward, scalar_loss
    from .verify import _with_problems, compare, run_pairs

    from .dropout import for_check

    reference = build_model(options.model, "meta", factory, real_buffers=True)
    load_checkpoint(reference, options.checkpoint, allow_missing=options.allow_missing, device="cpu")
    note = for_check(reference)  # eval mode on both sides, as check_parity
    if inputs is None:
        inputs = (default_inputs(reference, generator=torch.Generator().manual_seed(options.seed)),)
    ref_out = reference(*inputs)
    scalar_loss(ref_out).backward()
    with simulated_load(factory, plan, tp, options.checkpoint, allow_missing=options.allow_missing) as sim:
        sim.model.eval()
        out, comms = forward_backward(sim.model, inputs)
        grads = {name: p.grad for name, p in sim.model.named_parameters()}
        problems, pairs = run_pairs(out, ref_out, grads, reference, output_name=lambda i: "output")
        result = _with_problems(problems, compare(pairs))
    result.comms = comms
    result.notes = [note] if note else []
    return result
