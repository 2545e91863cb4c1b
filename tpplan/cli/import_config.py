"""`tpplan import-config FILE`: the command-line edge of interop.import_config.

Prints the version 2 plan read from a torchtitan, transformers or accelerate
config (or writes it to --output), the fields left out (TP144) and any problem
of the input (TP001, TP142, TP143) located in FILE on standard error.
"""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..interop.frameworks import TARGETS
from .export import ConfigFormat, Target, _write
from .output import exit_with


def import_config(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A torchtitan job TOML (its parallelism and training tables), a transformers "
                                        "DistributedConfig JSON or an accelerate ParallelismConfig JSON.", show_default=False)],
    source_format: Annotated[
        Optional[Target],
        typer.Option("--from", metavar="|".join(TARGETS), help="The framework FILE is from; default: told by the file (a JSON object by its fields, "
                     "TOML by its parallelism table).", show_default=False),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", metavar="PLAN", help="Write the plan here instead of standard output.", show_default=False),
    ] = None,
    format: Annotated[
        ConfigFormat,
        typer.Option(help="text: the plan, the fields left out on standard error; json: one object {ok, from, plan, problems}."),
    ] = ConfigFormat.text,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a field is left out (TP144) too.")] = False,
) -> None:
    """Read a framework's parallelism config back into a version 2 plan.

    The plan written is one `tpplan validate` accepts (its own checks run on it);
    fields a plan has no key for are listed (TP144), never dropped silently.
    """
    import json

    from ..interop.import_config import import_config as run_import
    from ..render.problems import CheckedPlan, Outcome, render_text

    imported = run_import(file, source_format.value if source_format is not None else None, output=output)
    outcome = Outcome([CheckedPlan(file)], imported.problems, strict=strict)
    if format is ConfigFormat.json:
        sys.stdout.write(json.dumps({"ok": outcome.ok, "from": imported.format, "plan": imported.text or None,
                                     "problems": [p.to_dict() for p in outcome.ordered_problems()]}, indent=2) + "\n")
    else:
        if imported.text:
            _write(imported.text, output)
        if imported.problems:
            render_text(outcome, file=sys.stderr)
    exit_with(outcome.exit_code)
