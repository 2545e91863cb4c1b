"""Within the model's own plan: a model that ships a TP plan (transformers' `tp_plan`)
has had its trade of bytes for collectives chosen by its authors. By default `init`
keeps to it where it leaves a module whole: a group the data flow finds but that plan
does not shard at all is left whole too, when sharding it would add a backward
collective (a pair's, the head's, the experts' input gradient, all-reduced). So the
inferred plan holds no more bytes per rank and runs no more backward collectives than
the shipped one (what init adds: its proof, the lint's fixes, the embedding, which
costs no backward collective). `--shard-more` shards every group it can prove.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .infer import Proposal, Unplanned

if TYPE_CHECKING:
    from torch import nn

# The groups whose rules add a backward collective when the plan does not shard them at all.
_COSTS_BACKWARD = ("pair", "head", "experts")


def sharded_modules(plan_text: str, model: "nn.Module") -> set[str]:
    """The modules with a parameter that `plan_text`'s rules shard (the lint's placements)."""
    from ..core.loader import load_plan
    from ..lint.context import LintContext
    from ..lint.facts import parameter_placements

    ctx = LintContext(load_plan(text=plan_text, file="<shipped plan>"), model, [2])
    return {placed.module for placed in parameter_placements(ctx).values()
            if placed.placement is not None and placed.placement.kind == "shard"}


def within(proposal: Proposal, sharded: set[str], label: str) -> Proposal:
    """`proposal` without the groups that `label`'s plan (sharding `sharded`) leaves
    wholly unsharded and that cost a backward collective; their modules go to the
    unplanned, with why."""
    kept, unplanned = [], list(proposal.unplanned)
    for group in proposal.groups:
        if group.kind in _COSTS_BACKWARD and not sharded & set(group.rules):
            why = f"{label} leaves it whole: sharding it saves bytes but adds a backward collective (--shard-more shards it)"
            unplanned += [Unplanned(fqn, why) for fqn in group.rules]
        else:
            kept.append(group)
    return Proposal(kept, unplanned, proposal.loss_parallel and any(g.kind == "head" for g in kept))
