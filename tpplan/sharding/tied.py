"""Tied parameters (one Parameter held by two modules, as a tied embedding and LM
head) across parallelization.

torch's styles replace each module's parameters with new DTensor parameters, one
module at a time, so a shared weight would become two independent ones, each
receiving only its own module's share of the gradient.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

Owner = tuple[str, str]  # (module fqn, parameter name)


def shared_parameters(model: "nn.Module") -> list[list[Owner]]:
    """Groups of owners that hold one Parameter object."""
    owners: dict[int, list[Owner]] = defaultdict(list)
    # Each path once (a module held twice appears under both), each name once per module:
    # no (fqn, name) repeats.
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            owners[id(param)].append((fqn, name))
    return [group for group in owners.values() if len(group) > 1]


def _layout(param) -> str:
    # torch's own short spelling ([S(0)], [R]): TP210 quotes what torch made of the
    # parameters, not a plan value (core.placements.placement_text spells those).
    placements = getattr(param, "placements", None)
    return "[" + ", ".join(map(str, placements)) + "]" if placements else "a plain tensor"


def retie(model: "nn.Module", groups: list[list[Owner]]) -> list[tuple[list[Owner], str]]:
    """Make each group share one parameter again. Groups whose owners were laid
    out differently cannot be tied: they are returned with a description."""
    conflicts = []
    for group in groups:
        params = [getattr(model.get_submodule(fqn), name) for fqn, name in group]
        layouts = [_layout(p) for p in params]
        if len(set(layouts)) > 1:
            described = ", ".join(
                f"{f'{fqn}.{name}' if fqn else name} is {layout}" for (fqn, name), layout in zip(group, layouts)
            )
            conflicts.append((group, described))
            continue
        for fqn, name in group[1:]:
            setattr(model.get_submodule(fqn), name, params[0])
    return conflicts
