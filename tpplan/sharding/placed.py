"""A rule's parameter placements as torch placements: tpplan's own styles place a
module's parameters by the one answer of the style table, `StyleSpec.own_placements`
(the style's contract, or its per-module placements), which the lint follows and the
memory and checkpoint shard math see as the DTensors these styles make."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ..core.placements import PlacementSpec, parse_placement, placement_text

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor import Placement

    from ..core.style_model import StyleSpec


def own_placements(spec: "StyleSpec", module: "nn.Module", kind: str | None = None) -> "dict[str, Placement]":
    """{own parameter name: torch placement} of `module` (of `kind`) under `spec`."""
    return {name: placement.to_torch() for name, placement in spec.own_placements(module, kind).items()}


def plan_placements(placements: "Mapping[str, Placement]") -> dict[str, PlacementSpec]:
    """Torch placements a style was constructed with (its options, compiled from the plan's
    words) in the plan's terms again, for the table's spec of the same options."""
    return {name: parse_placement(placement_text(placement)) for name, placement in placements.items()}
