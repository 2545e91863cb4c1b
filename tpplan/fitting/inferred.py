"""The TP rules of a search given no base plan (SPEC §9: "from `init` on the model"):
`tpplan init`'s plan, inferred from the model's data flow and proven at the tp degrees
the search weighs, written to a file the layouts' plans extend (their `extends:`), as a
given base plan would be."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable

from .space import divisors


def tp_degrees(world: int, gpus_per_node: int, axes: tuple[str, ...]) -> list[int]:
    """The tp degrees the search weighs above 1 (space.layouts' rule: tensor parallelism inside a node)."""
    return [d for d in divisors(world) if 1 < d <= gpus_per_node] if "tp" in axes else []


def inferred_rules(model: str, degrees: list[int], event: Callable[[str], None]) -> tuple[str, str]:
    """(the plan's text, the file it is written to, removed when the process ends): `init`'s
    plan for `model` proven at `degrees`; with none (tp is not searched, or no degree fits
    in a node), a plan of no rules."""
    if degrees:
        from ..init import run_init
        from ..simulation.modelref import load_callable

        event(f"tpplan init: the TP rules of {model} at tp {', '.join(map(str, degrees))}")
        text = run_init(load_callable(model), ref=model, tp=degrees, on_event=event).text
    else:
        text = "version: 1\nname: no-tp\ndescription: no tensor parallelism weighed (tp is not searched)\nrules: {}\n"
    folder = tempfile.mkdtemp(prefix="tpplan-fit-")
    atexit.register(shutil.rmtree, folder, True)  # the search's worker processes read it while the search runs
    path = os.path.join(folder, "rules.yaml")
    with open(path, "w") as file:
        file.write(text)
    return text, path
