"""`tpplan import-hf`: the command-line edge of hf.importer.import_hf.

Imported whenever `tpplan` starts (cli/commands.py lists the command), so nothing
here imports torch or transformers at import time. Only the typed error for bad
input (`HfConfigError`, of which the importer's `HfImportError` is one) is the
user's; anything else is a bug.
"""

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .output import usage_error


def import_hf(
    source: Annotated[
        str,
        typer.Argument(
            metavar="MODEL_TYPE_OR_CONFIG",
            help="A transformers model type (llama, qwen2, ...: its default config) or a local config.json / "
            "config directory. Nothing is downloaded.",
            show_default=False,
        ),
    ],
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", metavar="PLAN", help="Write the plan here instead of standard output.", show_default=False),
    ] = None,
    minimal: Annotated[
        bool,
        typer.Option(
            "--minimal",
            help="Add the rules the lint's fixes add on the model: a prepare_module_input on each parent whose "
            "column-parallel children share one plain input, so backward all-reduces once per parent instead of "
            "once per child (TP340), and local_params on each module whose parameters compute on sharded "
            "activations (TP325).",
        ),
    ] = False,
    ep: Annotated[
        bool,
        typer.Option(
            "--ep",
            help="Import transformers' expert-parallel plan (base_model_ep_plan: whole experts per rank) "
            "over its TP plan for the rest of the model. Without it, experts that transformers plans for "
            "expert parallelism only (every MoE family's from transformers 5.25) get expert_tp: each expert "
            "sharded on its intermediate dim.",
        ),
    ] = False,
) -> None:
    """Turn the TP plan transformers defines for a model into tpplan YAML.

    Maps transformers' style strings to tpplan styles; entries with no sound
    equivalent are listed on standard error (and as comments in the plan), never
    dropped silently. The model is built on the meta device from the config so
    every rule is checked to match a module.
    """
    from ..core.torch_range import warn_once
    from ..hf.config import HfConfigError
    from ..hf.importer import import_hf as run_import

    warn_once()  # one line, once, for a torch outside the tested range

    try:
        import transformers  # noqa: F401  (the importer needs it: say how to get it)
    except ModuleNotFoundError as exc:
        usage_error(f"import-hf needs transformers ({exc}): pip install 'tpplan[hf]'")
    try:
        from ..lint.fixes import added_rules

        imported = run_import(source, minimal=minimal, ep=ep, lint_fixes=added_rules, output=output)
    except HfConfigError as exc:  # an unreadable config, or one with no plan to import (HfImportError)
        usage_error(str(exc))
    if output is None:
        sys.stdout.write(imported.text)
    else:
        try:
            output.write_text(imported.text)
        except OSError as exc:
            usage_error(f"cannot write {output}: {exc.strerror or exc}")
    for skipped in imported.skipped:
        typer.echo(f"left out: {skipped.key}: {skipped.hf_style} -- {skipped.reason}", err=True)
    for key, why in imported.added:
        typer.echo(f"added: {key}: {why}", err=True)
