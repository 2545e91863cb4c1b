"""`tpplan export --to FRAMEWORK PLAN`: the command-line edge of interop.export.

Prints the framework's config on standard output (or --output), and what it
cannot express as located TP140 warnings on standard error (`--format json`:
one object with `config` and `not_expressed`). Imported whenever `tpplan`
starts: nothing heavy at import time.
"""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..interop.frameworks import TARGETS
from .output import exit_with, usage_error

Target = Enum("Target", {name: name for name in TARGETS}, type=str)  # typer lists and checks the choices


class ConfigFormat(str, Enum):
    text = "text"
    json = "json"


def export(
    plan: Annotated[str, typer.Argument(metavar="PLAN", help="The plan (version 1: its TP axis; version 2: every axis).", show_default=False)],
    to: Annotated[
        Target,
        typer.Option("--to", metavar="|".join(TARGETS), help="The framework whose config to print: torchtitan (a job TOML's parallelism and training tables, in the fields 0.3 and 0.2.2 share), "
                     "transformers (5.25 DistributedConfig JSON, with tp_plan/ep_plan/fsdp_plan in its own style strings) or "
                     "accelerate (1.16 ParallelismConfig keyword arguments, JSON).", show_default=False),
    ],
    world: Annotated[
        Optional[int],
        typer.Option(metavar="N", min=1, help="World size: resolves a -1 axis (or an unset tp) for a framework that needs every size "
                     "as a number (torchtitan keeps dp_shard -1 itself).", show_default=False),
    ] = None,
    tp: Annotated[
        Optional[int],
        typer.Option(metavar="N", min=1, help="The TP degree, where the plan promises several (mesh.tp as a list, mesh.sizes) or leaves it open.",
                     show_default=False),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", metavar="FILE", help="Write the config here instead of standard output.", show_default=False),
    ] = None,
    format: Annotated[
        ConfigFormat,
        typer.Option(help="text: the config as the framework reads it, the keys it cannot express on standard error; "
                     "json: one object {ok, to, config, not_expressed, problems}."),
    ] = ConfigFormat.text,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a key is not expressed (TP140) too.")] = False,
) -> None:
    """Print a plan as torchtitan's, transformers' or accelerate's parallelism config.

    Sizes, and the glob plans where the framework has them (transformers' tp_plan,
    ep_plan, fsdp_plan). Whatever the framework cannot express is listed, located at
    the plan's key (TP140), never dropped silently.
    """
    import json

    from ..core.loader import load_plan
    from ..interop.export import NOT_EXPRESSED, export_plan
    from ..render.problems import CheckedPlan, Outcome, render_text

    loaded = load_plan(plan)  # a PlanError prints as validate's problems (cli/app.py)
    exported = export_plan(loaded, to.value, world=world, tp=tp)
    outcome = Outcome([CheckedPlan(loaded.file, loaded.text, len(loaded.rules))], exported.problems, strict=strict)
    if format is ConfigFormat.json:
        sys.stdout.write(json.dumps({
            "ok": outcome.ok, "to": to.value, "config": exported.config if exported.text else None,
            "not_expressed": [p.to_dict() for p in exported.not_expressed],
            "problems": [p.to_dict() for p in exported.problems if p.code != NOT_EXPRESSED],
        }, indent=2) + "\n")
    else:
        if exported.text:
            _write(exported.text, output)
        if exported.problems:
            render_text(outcome, file=sys.stderr)
    exit_with(outcome.exit_code)


def _write(text: str, output: Optional[Path]) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        usage_error(f"cannot write {output}: {exc.strerror or exc}")
