"""Where the plan JSON Schema file is, and the `$schema` pointer a written plan carries.

A plan tpplan writes starts with `# yaml-language-server: $schema=...` so that an
editor checks it as it is edited; the pointer is the path of schemas/plan.schema.json
relative to the directory the plan is written to, so it resolves from there.
"""

from __future__ import annotations

import os
from pathlib import Path

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "schemas" / "plan.schema.json"
POINTER_PREFIX = "# yaml-language-server: $schema="


def schema_pointer(plan_path: str | os.PathLike | None = None) -> str:
    """The schema's path relative to the directory of `plan_path` (None: a plan printed
    to standard output, which the user redirects into the current directory), with '/'
    separators; a file:// URI when no relative path exists (another drive)."""
    directory = Path(plan_path).resolve().parent if plan_path is not None else Path.cwd()
    try:
        relative = os.path.relpath(SCHEMA_FILE, directory)
    except ValueError:  # Windows: the plan is on another drive
        return SCHEMA_FILE.as_uri()
    return Path(relative).as_posix()


def schema_comment(plan_path: str | os.PathLike | None = None) -> str:
    return POINTER_PREFIX + schema_pointer(plan_path)
