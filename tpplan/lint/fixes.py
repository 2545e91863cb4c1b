"""Fixes the lint can compute for a plan, for tools that write plans (import-hf)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def partial_gradient_rules(plan_text: str, model: "nn.Module") -> dict[str, Any]:
    """`local_params` for each module whose replicated parameters the layout flow finds
    computing on sharded activations under the plan `plan_text` (TP325: their gradients
    would be partial), keyed by the module's glob: Apertus's xIELU `act_fn` between
    up_proj and down_proj, say."""
    from ..core.globs import generalize
    from ..core.loader import load_plan
    from .context import LintContext
    from .rules.replicated_partial_grad import findings

    context = LintContext(load_plan(text=plan_text), model, [2])
    return {generalize(leak.fqn): "local_params" for leak, _ in findings(context)}
