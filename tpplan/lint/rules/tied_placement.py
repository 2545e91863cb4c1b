"""TP350: tied parameters that the plan lays out differently."""

from __future__ import annotations

from ...sharding.tied import shared_parameters
from ..registry import Finding, LintRule
from ..text import rule_ref


def tied_groups(ctx) -> list[list[str]]:
    """Names of the parameters that are one tensor (an embedding and a tied head)."""
    return [[f"{fqn}.{name}" if fqn else name for fqn, name in group] for group in shared_parameters(ctx.model)]


def _describe(name: str, placed) -> str:
    if placed.rule is None:
        return f"'{name}' stays a plain tensor (no rule)"
    return f"'{name}' becomes {placed.placement} ({placed.rule.spec.style}, {rule_ref(placed.rule)})"


def _anchor(ctx, group, placed):
    ruled = [placed[n] for n in group if placed[n].rule is not None]
    return ctx.at(ruled[-1].rule) if ruled else ctx.plan_location()


def check(ctx):
    placed = ctx.placements
    for group in tied_groups(ctx):
        # a module reachable under two paths is known (and matched) by its first one only
        group = [name for name in group if name in placed]
        kinds = {placed[n].placement for n in group}
        if len(kinds) < 2:
            continue
        described = "; ".join(_describe(n, placed[n]) for n in group)
        yield Finding(_anchor(ctx, group, placed), (
            f"{' and '.join(repr(n) for n in group)} are one tied tensor, but the plan gives them different "
            f"placements: {described}; a tensor has one placement: shard both the same way (a vocabulary-parallel "
            "embedding, rowwise with input_layouts: replicate, is shard(0) like a colwise head), or untie them"
        ))


RULE = LintRule(
    code="TP350",
    name="tied-placement",
    severity="error",
    summary="Tied parameters (one tensor under two names) get different placements.",
    what="""
        Groups the model's parameters by tensor (`named_parameters(remove_duplicate=False)`)
        and checks that every name of a tied tensor gets the same placement under
        the plan: the weight placement of its module's style, replicate under
        sequence_parallel or no_parallel, or plain when no rule covers it.
    """,
    why="""
        A tied embedding and output head are one tensor. Sharding the embedding
        by embedding dim (colwise, shard(1)) and the head by vocabulary
        (colwise, shard(0)) asks for two layouts of one tensor: torch's styles
        would make it two parameters, each receiving part of the gradient.
        `Plan.apply` re-ties tied parameters after sharding and refuses (TP210)
        when their layouts differ; this rule finds it before launch.
    """,
    model="tpplan.models.rule_examples:tied_lm",
    failing="""
        version: 1
        rules:
          embed: {style: colwise, output_layouts: replicate}
          up: colwise
          down: rowwise
          head: {style: colwise, output_layouts: replicate}
    """,
    passing="""
        version: 1
        rules:
          up: colwise
          down: rowwise
    """,
    check=check,
)
