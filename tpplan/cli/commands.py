"""The commands of `tpplan`, in the order `--help` and cli.md list them.

The one place a command is registered: app.py adds each (name, function) here
to the typer app. Every module listed is imported whenever `tpplan` starts, so
none may import torch (or anything heavy) at import time; each command imports
what it needs inside its function. cli.md covers every command listed:
regenerate it with `python -m tpplan.docs`.
"""

from collections.abc import Callable

from .apply import apply
from .export import export
from .fit import fit
from .import_config import import_config
from .import_hf import import_hf
from .init import init
from .rules import rules
from .schema import schema
from .validate import validate

COMMANDS: list[tuple[str, Callable[..., None]]] = [
    ("validate", validate),
    ("schema", schema),
    ("apply", apply),
    ("init", init),
    ("fit", fit),
    ("import-hf", import_hf),
    ("export", export),
    ("import-config", import_config),
    ("rules", rules),
]
