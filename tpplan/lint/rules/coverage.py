"""TP360: a plan that leaves much of the model unsharded."""

from __future__ import annotations

from collections import defaultdict

from ..registry import Finding, LintRule
from ..text import generalize

# Warn when more than this share of the parameters stays whole on every rank,
# or when one group of them (a glob over blocks) alone holds more than GROUP_SHARE.
UNSHARDED_SHARE = 0.25
GROUP_SHARE = 0.10


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(int(n))


def _over_ep(ctx) -> set[str]:
    """The parameters of the modules a version 2 plan's `experts` rules place over ep
    (whole experts per ep rank: sharded, on an axis the TP placements do not show)."""
    from ...core.sections import claim_section

    plan = ctx.plan
    if plan.version != 2 or not plan.experts or plan.mesh.sizes["ep"] == 1:
        return set()
    tree, under = plan.module_tree(ctx.modules)
    claimed, _ = claim_section(plan, tree, under, "experts")  # its problems are section_problems'
    return {f"{fqn}.{name}" if fqn else name for fqn in claimed for name, _ in ctx.modules[fqn].named_parameters(recurse=False)}


def check(ctx):
    placed = ctx.placements
    sizes = {name: param.numel() for name, param in ctx.model.named_parameters()}  # a tied parameter once
    total = sum(sizes.values())
    if not total:
        return
    unsharded = defaultdict(int)
    over_ep = _over_ep(ctx)
    for name, size in sizes.items():
        placement = placed[name].placement
        if name not in over_ep and (placement is None or placement.kind != "shard"):
            unsharded[generalize(name)] += size
    whole = sum(unsharded.values())
    largest = sorted(unsharded.items(), key=lambda item: -item[1])
    if whole / total <= UNSHARDED_SHARE and (not largest or largest[0][1] / total <= GROUP_SHARE):
        return
    shown = ", ".join(f"{name} ({_count(size)}, {size / total:.0%})" for name, size in largest[:3])
    yield Finding(ctx.plan_location(), (
        f"the plan shards {1 - whole / total:.0%} of the parameters ({_count(total - whole)} of {_count(total)}); "
        f"every rank holds the other {_count(whole)} whole. Largest unsharded: {shown}; shard them with colwise/rowwise "
        f"rules if they are Linears or Embeddings, or accept the memory"
    ))


RULE = LintRule(
    code="TP360",
    name="coverage",
    severity="warning",
    summary="The plan leaves a large share of the parameters unsharded.",
    what=f"""
        Counts the parameters (tied ones once) that colwise and rowwise shard
        (and those a version 2 plan's `experts` rules place over ep), and
        warns when more than {UNSHARDED_SHARE:.0%} of them stay whole on every
        rank, or when one group of them (the same parameter across blocks)
        alone is more than {GROUP_SHARE:.0%} of the model. The message names the
        largest unsharded groups.
    """,
    why="""
        Replicated parameters cost their full size on every rank: a forgotten
        MLP or vocabulary leaves most of the memory tensor parallelism was meant
        to save. Biases of rowwise Linears and norms are small and expected.
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        rules:
          blocks.0.in_proj: colwise
          blocks.0.out_proj: rowwise
    """,
    passing="""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
