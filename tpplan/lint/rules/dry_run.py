"""TP330: the plan fails a shape-level dry run at a TP degree."""

from __future__ import annotations

from ..registry import Finding, LintRule


def _sequence_length(tp: int) -> int:
    # At least the default 8, and a multiple of the degree: sequence parallelism
    # needs one (as it will at run time), and nothing else cares.
    return tp * max(1, -(-8 // tp))


def check(ctx, earlier):
    """The dry run's findings; `earlier`: the problems found before it (resolution and
    every other rule run). A dry run that cannot run says why, as a warning: a
    skipped check must not look like a passed one."""
    if any(p.severity == "error" for p in earlier):
        return  # it would only fail on what is reported already
    if ctx.trace is None:
        yield Finding(ctx.plan_location(), (
            f"the shape-level dry run was skipped: the model's forward cannot run on example inputs "
            f"({ctx.trace_error}); see TP329"
        ), severity="warning")
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield Finding(ctx.plan_location(), (
            f"the shape-level dry run was skipped: a process group ({dist.get_backend()}, world size "
            f"{dist.get_world_size()}) is already initialized in this process, and simulating {ctx.tp_sizes} ranks "
            "would need to replace it; run `tpplan validate --model` outside torchrun"
        ), severity="warning")
        return
    from ...simulation.ladder import available

    modes = available(ctx.model, start=ctx.trace_mode)
    for tp in ctx.tp_sizes:
        failure = None
        for mode in modes:
            failure = _simulate(ctx, tp, mode)
            if failure is None:
                break
        # A failure in every way the model can run is the plan's; the most faithful run says why.
        for problem in failure or ():
            at = (problem.file, problem.line, problem.column)
            if problem.code == "TP507":  # torch's limit, not the plan's failure: said as such, not as an error of the plan
                yield Finding(at, f"at tp ({tp}) the shape-level dry run stops at a limit of torch (TP507): {problem.message}", severity="warning")
            else:
                yield Finding(at, f"at tp ({tp}) the shape-level dry run fails: {problem.message}")


def _simulate(ctx, tp: int, mode: str):
    """None when the plan applies and a forward and backward run at `tp`; else the problems."""
    from ...core.problems import PlanError
    from ...simulation.locate import FailureLocator, apply_located, run_located
    from ...simulation.simulate import scalar_loss, simulated_world, tp_mesh
    from ..collapse import collapsed_copy, plan_for
    from ...simulation.ladder import prepared, running

    model = prepared(collapsed_copy(ctx.model, ctx.kept_blocks), mode, owned=True)
    plan = plan_for(ctx.plan, model)
    try:
        with simulated_world(tp):
            mesh = tp_mesh(tp, ctx.plan.mesh_axis)  # outside fake mode: the mesh needs real rank lists
            with running(mode, model):
                rules = apply_located(plan, model, mesh)
                inputs = _inputs(ctx, model, tp)
                run_located(FailureLocator(plan, model, rules, tp), lambda: scalar_loss(model(*inputs)).backward())
    except PlanError as exc:
        return exc.problems
    return None


def _inputs(ctx, model, tp: int) -> tuple:
    """The user's example inputs (`--inputs`), else the default ones with a sequence the degree divides."""
    from ...simulation.modelref import make_inputs
    from ...simulation.simulate import default_inputs

    if ctx.inputs is None:
        return (default_inputs(model, seq=_sequence_length(tp)),)
    return make_inputs(ctx.inputs, model, next((t.device for t in model.parameters()), "cpu"))


RULE = LintRule(
    code="TP330",
    name="dry-run",
    severity="error",
    summary="The parallelized model fails a shape-level forward and backward at a TP degree.",
    what="""
        When no other error was found, applies the plan at each TP degree in one
        process (torch's fake process group; the model on the meta device or
        under FakeTensorMode, or, if it is small and runs neither way, on
        random values: no devices) and runs a forward and backward on default
        inputs, as `tpplan apply --dry-run` does; a failure is reported at the
        rule that shards the module where it happened. Repeated blocks are
        simulated twice, not once per layer, so that deep models stay fast; the
        sequence length is a multiple of the degree. When the dry run cannot run
        (the forward cannot be traced, or a process group is already
        initialized), it says so in a warning.
    """,
    why="""
        Static checks see the plan and the module tree; the forward code can
        still assume what TP changes, most often a view by the global head
        count (`view(bsz, seq, self.n_heads, self.head_dim)`) where each rank
        holds `n_heads / tp` heads. The dry run finds it before a job is
        launched, at the plan's own line.
    """,
    model="tpplan.models.rule_examples:global_heads_lm",
    failing="""
        version: 1
        rules:
          attention.w{q,k,v}: colwise
          attention.wo: rowwise
          up: colwise
          down: rowwise
    """,
    passing="""
        version: 1
        rules:
          up: colwise
          down: rowwise
    """,
    check=check,
    runs_last=True,
)
