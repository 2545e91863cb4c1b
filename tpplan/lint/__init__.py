"""Model-aware lint: the checks `tpplan validate --model` runs, as a registry of
rules with stable TP3xx codes (see `tpplan rules` and docs/rules.md).

    problems = lint_model(plan, model, tp_sizes=[2, 4, 8])

Importing this package does not import torch; running the rules does.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Sequence

from . import rules as _rules  # noqa: F401  (registers every rule)
from .registry import RULES, Finding, LintRule, run_rules

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan
    from ..core.problems import Problem


def ordered_rules() -> list[LintRule]:
    return sorted(RULES.values(), key=lambda rule: (rule.runs_last, rule.code))


def lint_model(plan: "Plan", model: "nn.Module", tp_sizes: Sequence[int], select: Sequence[str] | None = None) -> list["Problem"]:
    """Strict resolution (TP200, TP201) and every lint rule (or those in `select`),
    for `model` (best built on the meta device) at each TP degree."""
    from .context import LintContext

    # The trace and the flow analysis allocate a few objects per tensor op and free
    # none until the end: the cyclic collector would rescan them all, over and over,
    # which makes deep models superlinear. Nothing here makes cycles worth collecting.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ctx = LintContext(plan, model, tp_sizes)
        chosen = [rule for rule in ordered_rules() if select is None or rule.code in select]
        return ctx.resolution_problems + run_rules(ctx, chosen)
    finally:
        if was_enabled:
            gc.enable()


__all__ = ["RULES", "Finding", "LintRule", "lint_model", "ordered_rules"]
