"""Model-aware lint: the checks `tpplan validate --model` runs, as an explicit
list of rules with stable TP3xx codes (rules/__init__.py; see `tpplan rules`
and docs/rules.md).

    problems = lint_model(plan, model, tp_sizes=[2, 4, 8])

Importing this package does not import torch; running the rules does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .registry import Finding, LintRule, run_rules
from .rules import RULES

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan
    from ..core.problems import Problem


def ordered_rules() -> list[LintRule]:
    return sorted(RULES.values(), key=lambda rule: (rule.runs_last, rule.code))


def lint_model(plan: "Plan", model: "nn.Module", tp_sizes: Sequence[int], select: Sequence[str] | None = None,
               inputs: str | None = None) -> list["Problem"]:
    """Strict resolution (TP200, TP201), a version 2 plan's sections (TP127-TP129) and every lint rule (or those whose codes are
    in `select`), for `model` (best built on the meta device) at each TP degree;
    `inputs`: MOD:FN of the example inputs to trace with."""
    from .context import LintContext
    from .sections import section_problems

    ctx = LintContext(plan, model, tp_sizes, inputs=inputs)
    chosen = [rule for rule in ordered_rules() if select is None or rule.code in select]
    before = ctx.resolution_problems + section_problems(ctx)  # version 2's sections: always, as resolution
    return before + run_rules(ctx, chosen, earlier=before)


__all__ = ["RULES", "Finding", "LintRule", "lint_model", "ordered_rules"]
