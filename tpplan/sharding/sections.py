"""The modules a version 2 plan's section names by glob (`fsdp.units`,
`checkpointing.modules`): strict as the TP rules' globs (SPEC §2), so a glob that
matches no module is the plan's TP200 at that glob, with why."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.globs import ModuleTree, compile_glob
from ..core.problems import PlanError, error

if TYPE_CHECKING:
    from torch import nn


def section_modules(plan: Any, model: "nn.Module", path: tuple[str, ...], globs: list[str]) -> list[str]:
    """The fqns `globs` (at the plan's key `path`, e.g. ("fsdp", "units")) match in
    `model`, in the globs' order, each once; "" is the root."""
    tree = ModuleTree(name for name, _ in model.named_modules())
    found: dict[str, None] = {}
    for index, glob in enumerate(globs):
        matched = tree.match(compiled := compile_glob(glob))
        if not matched:
            at = plan.source.locate((*path, index)) if plan.source is not None else (1, 1)
            raise PlanError([error("TP200", f"{'.'.join(path)}: '{glob}' matches no module: {tree.explain_no_match(compiled)}",
                                   plan.file, *at)])
        found.update(dict.fromkeys(matched))
    return list(found)
