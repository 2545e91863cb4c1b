"""TP329: the forward cannot be traced, so the flow checks did not run."""

from __future__ import annotations

from ..registry import Finding, LintRule


def check(ctx):
    if ctx.trace is None:
        yield Finding(ctx.plan_location(), (
            f"cannot trace the model's forward on example inputs ({ctx.trace_error}), so the checks that follow "
            "tensors through it were skipped: layout flow (TP320-TP324), observed arity (TP303, TP304) and "
            "communication (TP340)" + (", and context parallelism's attention (TP128)" if ctx.plan.context_parallel is not None else "")
        ))


RULE = LintRule(
    code="TP329",
    name="trace-unavailable",
    severity="warning",
    summary="The model's forward cannot be traced, so the layout-flow checks were skipped.",
    what="""
        The flow checks run the unparallelized model's forward once with default
        example inputs (token ids for a model that starts with an Embedding,
        floats for one that starts with a Linear) and record what each module
        receives: on the meta device, else under FakeTensorMode, else (a small
        model) on random values. This rule says when that is impossible: no
        default input for the first module, or a forward that fails in every
        one of these ways (data-dependent control flow, `.item()`).
    """,
    why="""
        A skipped check must not look like a passed one: under `--strict` this
        warning fails the run.
    """,
    model="tpplan.models.mlp:tiny",
    failing_model="tpplan.models.rule_examples:conv_first",
    failing="""
        version: 1
        rules:
          proj: colwise
    """,
    passing="""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
