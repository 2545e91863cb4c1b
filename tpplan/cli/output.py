"""How every command prints its result and exits: one contract for the CLI.

- A printer prints one result and *returns* its exit code (`print_outcome`,
  `apply.print_report`); it never exits.
- A command ends with `exit_with(code)`; a usage error (a bad argument the
  parser cannot catch, an unreadable reference) goes through `usage_error`,
  the one route to exit code 2 besides an outcome with unreadable input
  (`Outcome.exit_code`, TP001).
- An exception no command turned into a result is a bug in tpplan:
  `internal_error` says so (exit 3) instead of blaming the user's plan.

Exit codes: SPEC §3 has 0, 1 and 2; 3 is tpplan's own, for its bugs only.
"""

import sys
import traceback
from enum import Enum
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from ..render.problems import Outcome

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3


class Format(str, Enum):
    """Output formats of problems (`validate --format`)."""

    text = "text"
    json = "json"
    github = "github"


def exit_with(code: int) -> NoReturn:
    raise typer.Exit(code)


def usage_error(message: str, *, rank: int = 0) -> NoReturn:
    """Exit 2 with a one-line message, as typer does for its own usage errors;
    `rank` (under torchrun, not 0) says which rank stops."""
    typer.echo(f"Error: rank {rank}: {message}" if rank else f"Error: {message}", err=True)
    exit_with(EXIT_USAGE)


def print_outcome(outcome: "Outcome", format: Format = Format.text) -> int:
    """Print checked plans and their problems in `format`; return the exit code."""
    from ..render import problems as render

    if format is Format.text:
        render.render_text(outcome)
    else:
        sys.stdout.write((render.render_json if format is Format.json else render.render_github)(outcome))
    return outcome.exit_code


def internal_error(exc: BaseException, *, debug: bool) -> int:
    """Report an exception no command handled as what it is, a bug in tpplan; return exit code 3."""
    lines = str(exc).strip().splitlines()
    summary = type(exc).__name__ + (f": {lines[0]}" if lines else "")
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    typer.echo(f"tpplan: internal error (a bug in tpplan, not in your plan): {summary}", err=True)
    if debug:
        typer.echo("Please report it with the traceback above.", err=True)
    else:
        typer.echo("Please report it with the traceback: rerun with --debug (or TPPLAN_DEBUG=1) to print it.", err=True)
    return EXIT_BUG
