"""Importing what the user names by `MODULE:ATTRIBUTE` (`--model`, `--inputs`, a
plan's `style: PKG.MOD:Class`): from the current directory first, as `python -m`
and uvicorn do. The `tpplan` console script puts its own bin/ directory first on
sys.path, not the directory it runs in; without this, `tpplan init --model
mymodels:build` would not find the mymodels.py beside it that `python -m tpplan`
finds."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_module(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with the current directory first on sys.path
    (put there once, for the user's module's own later imports too)."""
    here = os.getcwd()
    if sys.path[:1] not in ([""], [here]):  # "": `python -c` and the REPL already look here
        sys.path.insert(0, here)
    return importlib.import_module(name)
