"""TP330: the plan fails a shape-level dry run at a TP degree."""

from __future__ import annotations

from ..registry import Finding, LintRule, register


def _sequence_length(tp: int) -> int:
    # At least the default 8, and a multiple of the degree: sequence parallelism
    # needs one (as it will at run time), and nothing else cares.
    return tp * max(1, -(-8 // tp))


def check(ctx):
    if ctx.trace is None or any(p.severity == "error" for p in (*ctx.resolution_problems, *ctx.problems_so_far)):
        return  # no way to run the model (TP329 says so), or it would only fail on what is reported already
    import torch.distributed as dist

    if dist.is_initialized():
        return  # a real process group (under torchrun): simulating would need to replace it
    from ..simulation import available

    modes = available(ctx.model)
    modes = modes[modes.index(ctx.trace_mode):]
    for tp in ctx.tp_sizes:
        failure = None
        for mode in modes:
            failure = _simulate(ctx, tp, mode)
            if failure is None:
                break
        # A failure in every way the model can run is the plan's; the most faithful run says why.
        for problem in failure or ():
            yield Finding((problem.file, problem.line, problem.column), f"at tp ({tp}) the shape-level dry run fails: {problem.message}")


def _simulate(ctx, tp: int, mode: str):
    """None when the plan applies and a forward and backward run at `tp`; else the problems."""
    from ...core.problems import PlanError
    from ...runtime.locate import FailureLocator, apply_plan, run_located
    from ...runtime.simulate import default_inputs, scalar_loss, simulated_world, tp_mesh
    from ..collapse import collapsed_copy, plan_for
    from ..simulation import prepared, running

    model = prepared(collapsed_copy(ctx), mode, owned=True)
    plan = plan_for(ctx, model)
    try:
        with simulated_world(tp):
            mesh = tp_mesh(tp, ctx.plan.mesh_axis)  # outside fake mode: the mesh needs real rank lists
            with running(mode, model):
                rules = apply_plan(plan, model, mesh)
                inputs = default_inputs(model, seq=_sequence_length(tp))
                run_located(FailureLocator(plan, model, rules, tp), lambda: scalar_loss(model(inputs)).backward())
    except PlanError as exc:
        return exc.problems
    return None


RULE = register(LintRule(
    code="TP330",
    name="dry-run",
    severity="error",
    summary="The parallelized model fails a shape-level forward and backward at a TP degree.",
    what="""
        When no other error was found, applies the plan at each TP degree in one
        process (torch's fake process group, meta tensors: no memory, no
        devices) and runs a forward and backward on default inputs, as
        `tpplan apply --dry-run` does; a failure is reported at the rule that
        shards the module where it happened. Repeated blocks are simulated
        twice, not once per layer, so that deep models stay fast; the sequence
        length is a multiple of the degree.
    """,
    why="""
        Static checks see the plan and the module tree; the forward code can
        still assume what TP changes, most often a view by the global head
        count (`view(bsz, seq, self.n_heads, self.head_dim)`) where each rank
        holds `n_heads / tp` heads. The dry run finds it before a job is
        launched, at the plan's own line.
    """,
    model="tpplan.lint.examples:global_heads_lm",
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
))
