"""Checks of a plan against a model (what `tpplan validate --model` runs).

`check_model(plan, model, tp_sizes)` returns every problem as data and never
raises on a bad plan or model: strict resolution (TP200, TP201), then the
model-aware lint rules (TP3xx, see `tpplan rules` and tpplan/lint/).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..core.problems import Problem

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan

# What `validate --model` checks when neither --tp nor the plan's mesh.sizes says.
DEFAULT_TP_SIZES = (2, 4, 8)


def tp_sizes_for(plan: "Plan", requested: Sequence[int] | None) -> list[int]:
    """The TP degrees to check: those asked for, else those the plan promises, else the default."""
    return list(requested or plan.mesh_sizes or DEFAULT_TP_SIZES)


def check_model(plan: "Plan", model: "nn.Module", tp_sizes: Sequence[int]) -> list[Problem]:
    """Problems of `plan` applied to `model` (best built on the meta device) at each TP degree
    (none given: the plan's mesh.sizes, else DEFAULT_TP_SIZES)."""
    from . import lint_model

    return lint_model(plan, model, tp_sizes_for(plan, tp_sizes))
