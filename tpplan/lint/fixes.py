"""The rules the lint's fixes add to a plan, for tools that write plans (import-hf)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def added_rules(plan_text: str, model: "nn.Module", codes: Sequence[str]) -> dict[str, Any]:
    """{glob: rule value} for each rule the findings of the lint's `codes` add to the plan
    `plan_text` on `model` at TP 2 (lint/edits.py; one glob for all layers where the same rule
    goes on each): TP340's prepare_module_input on a parent whose colwise children share one
    plain input, TP325's local_params on Apertus's xIELU `act_fn` between up_proj and down_proj."""
    from ..core.loader import load_plan
    from .context import LintContext
    from .edits import apply_edits, lint_edits

    edits = [e for e in lint_edits(LintContext(load_plan(text=plan_text), model, [2]), codes) if e.add]
    return apply_edits({}, edits, [name for name, _ in model.named_modules()])
