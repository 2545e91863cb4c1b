"""TP327: a style sums its output's gradient over the mesh, but every rank already has all of it."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import styled


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); at TP 1 the sum is over one rank
    for found in ctx.flow.grad_sums:
        if found.shared or found.unknown:
            continue
        yield Finding(ctx.at(found.rule), (
            f"{styled(found.fqn, found.rule)} sums the gradient of its output over the mesh, but no rank computes with "
            "that output on its own slice: every use is whole on every rank (replicated ops, the model's output, or a "
            "style that sums its input's gradient itself), so each rank already holds the full gradient and the sum makes "
            f"it tp times too large; drop the rule for '{found.rule.pattern}'"
        ))


RULE = LintRule(
    code="TP327",
    name="unshared-grad-sum",
    severity="error",
    summary="A module's output gradient is summed over the mesh where every rank already has all of it.",
    what="""
        `sum_output_grad` leaves a module whole on every rank and, in backward,
        all-reduces the gradient of its output. Follows that output through the
        forward and reports the rule when no rank computes with it on its own
        slice: it only meets whole tensors, reaches the model's output, or goes
        into a style that runs its module in DTensor land (colwise, rowwise,
        no_parallel, which sum or keep their input's gradient themselves).
    """,
    why="""
        The sum is right only where each rank's gradient of the output is that
        rank's share, as for MLA's rotary key, which every rank uses against its
        own heads, or the gate of the example, which scales each rank's slice of
        the hidden features. Where every rank computes the same from the whole output, each
        already holds the full gradient: the all-reduce multiplies it by the TP
        degree, and every gradient before it is wrong, with no error.
    """,
    model="tpplan.models.rule_examples:gated_mlp",
    failing="""
        version: 1
        rules:
          gate: sum_output_grad
    """,
    passing="""
        version: 1
        rules:
          gate: sum_output_grad
          up: colwise
          down: rowwise
    """,
    check=check,
)
