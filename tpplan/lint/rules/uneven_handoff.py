"""TP324: an uneven shard handed on as a local tensor."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import chunks_text, degrees_that_work, styled


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); or TP 1 only, where every layout is the whole tensor
    for handoff in ctx.flow.handoffs:
        src = handoff.value.src
        # Only the feature dim: its size is the model's; a sequence shard's size is the input's.
        if src is None or handoff.value.dim != handoff.ndim - 1:
            continue
        if ctx.heads.split(src.fqn, src.rule) is not None:
            continue  # split by whole heads: TP311 reports the degree
        for tp in ctx.tp_sizes:
            if handoff.size % tp == 0:
                continue
            yield Finding(ctx.at(src.rule), (
                f"at tp ({tp}), {styled(src.fqn, src.rule)} hands its {handoff.size} features to "
                f"'{handoff.consumer}' as local shards of {chunks_text(handoff.size, tp)}, and DTensor.from_local "
                f"assumes even shards: each rank computes a different global shape and the forward fails; set "
                f"use_local_output: false on '{src.rule.pattern}' (a DTensor keeps the uneven layout), or use a "
                f"degree that divides {handoff.size}: {degrees_that_work(handoff.size)}"
            ))


RULE = LintRule(
    code="TP324",
    name="uneven-handoff",
    severity="error",
    summary="A local shard that the TP degree does not divide evenly is handed to the next style.",
    what="""
        For every TP degree checked, looks at each place where a style returns a
        local shard of the feature dim (`use_local_output: true`, the default)
        and the next style turns it back into a DTensor, and checks that the
        degree divides the sharded size.
    """,
    why="""
        `DTensor.from_local` (with torch's default `run_check=False`) computes
        the global shape as the local one times the degree. With uneven shards
        (100 features over 3 ranks: 34, 34, 32) the ranks disagree about the
        global shape, and the rowwise Linear after a colwise one fails or
        reads wrong features. Keeping the tensor a DTensor between the two
        (`use_local_output: false`) carries the real layout across.
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        mesh: {sizes: [3]}
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """,
    passing="""
        version: 1
        mesh: {sizes: [3]}
        rules:
          blocks.*.in_proj: {style: colwise, use_local_output: false}
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
