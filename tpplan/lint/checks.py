"""Checks of a plan against a model (what `tpplan validate --model` runs).

`check_model(plan, model, tp_sizes)` returns every problem as data and never
raises on a bad plan or model: strict resolution (TP200, TP201), a version 2
plan's sections against the model (lint/sections.py: TP200, TP201, TP127-TP129),
then the model-aware lint rules (TP3xx, see `tpplan rules` and tpplan/lint/).
`select` / `ignore` choose the rules (ruff's convention: codes, code prefixes
or rule names, comma-separated lists accepted); an entry that names no rule
raises `UnknownRuleError` before anything runs (`selected_codes` checks them alone).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.degrees import DEFAULT_TP_SIZES, tp_degrees
from ..core.problems import Problem
from ..core.quiet import simulation_remarks_off
from .registry import UnknownRuleError

__all__ = ["DEFAULT_TP_SIZES", "UnknownRuleError", "check_model", "selected_codes", "tp_sizes_for"]

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan

def tp_sizes_for(plan: "Plan", requested: Sequence[int] | None) -> list[int]:
    """The TP degrees to check (core/degrees.py's rule): those asked for, else those the plan
    promises, else DEFAULT_TP_SIZES: a lint costs no ranks, so it checks the common degrees
    rather than none."""
    return tp_degrees(requested, plan.mesh_sizes, DEFAULT_TP_SIZES)


def selected_codes(select: Sequence[str] | None = None, ignore: Sequence[str] | None = None) -> set[str] | None:
    """The codes of the lint rules `select` and `ignore` leave (None: every rule);
    UnknownRuleError for an entry that names no lint rule."""
    if select is None and ignore is None:
        return None
    from .registry import select_rules
    from .rules import RULES

    return select_rules(RULES, select, ignore)


@simulation_remarks_off()
def check_model(
    plan: "Plan",
    model: "nn.Module",
    tp_sizes: Sequence[int] | None,
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    inputs: str | None = None,
) -> list[Problem]:
    """Problems of `plan` applied to `model` (best built on the meta device) at each TP degree
    (none given: the plan's mesh.sizes, else DEFAULT_TP_SIZES), by the lint rules `select`
    names (default: all) less those `ignore` names; `inputs`: MOD:FN of the example inputs
    the forward is traced with (default: from the model's first module)."""
    from . import lint_model

    chosen = selected_codes(select, ignore)
    return lint_model(plan, model, tp_sizes_for(plan, tp_sizes), select=chosen, inputs=inputs)
