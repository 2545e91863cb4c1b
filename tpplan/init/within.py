"""Within the model's own plan: a model that ships a TP plan (transformers' `tp_plan`)
had its trade of bytes for collectives chosen by its authors. `init` shards all it
proves; where that would run more backward collectives than the shipped plan at some
degree (a pair, the head or experts that plan leaves whole each add one: their input's
gradient, all-reduced), it keeps to the shipped plan's choice: a group that plan does
not shard at all is left whole, and the rest proven again. So the inferred plan runs
no more backward collectives than the shipped one, and holds no more bytes per rank
(what init adds where it costs nothing: its proof, the lint's fixes, the embedding).
`--shard-more` shards every group it can prove.
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
    return {placed.module for placed in parameter_placements(ctx.modules, ctx.matched).values()
            if placed.placement is not None and placed.placement.kind == "shard"}


def costlier(ours: dict, theirs: dict) -> str | None:
    """Why the plan proven with figures `ours` ({degree: Degree}) costs more backward collectives
    than the one with `theirs` (None when it does not, or when theirs failed: nothing to keep to)."""
    if any(theirs.get(d) is None or (theirs[d].check is not None and theirs[d].check.get("passed") is False) for d in ours):
        return None
    for degree, mine in ours.items():
        a, b = _backward(mine.comms), _backward(theirs[degree].comms)
        if a > b:
            return f"sharding all init proves runs {a} backward collectives at TP {degree} where that plan runs {b}"
    return None


def _backward(comms: dict) -> int:
    return sum((comms or {}).get("backward", {}).values())


def within(proposal: Proposal, sharded: set[str], label: str, cost: str) -> Proposal:
    """`proposal` without the groups that `label`'s plan (sharding `sharded`) leaves
    wholly unsharded and that cost a backward collective; their modules go to the
    unplanned, with why (`cost`: what sharding them costs)."""
    kept, unplanned = [], list(proposal.unplanned)
    for group in proposal.groups:
        if group.kind in _COSTS_BACKWARD and not sharded & set(group.rules):
            why = f"{label} leaves it whole: {cost} (--shard-more shards it)"
            unplanned += [Unplanned(fqn, why) for fqn in group.rules]
        else:
            kept.append(group)
    return Proposal(kept, unplanned, proposal.loss_parallel and any(g.kind == "head" for g in kept))
