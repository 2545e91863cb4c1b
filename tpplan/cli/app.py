"""The `tpplan` command line: the typer app, its global options and `main()`.

A thin layer over the library: commands (cli/commands.py, one module each)
turn arguments into library calls and print by the contract of cli/output.py.
Plan-only `validate` must not import torch and starts in a benchmarked time
(bench/bench_validate_startup.py), so anything heavy is imported inside the
command that needs it. The CLI modules avoid `from __future__ import
annotations`: typer would compile every option's annotation string at start-up
(~4 ms of the benchmark).

`_Commands.invoke` is the one handler of what commands let through: typer's
exits and usage errors pass; a `PlanError` is printed as problems and a
`ModelRefError` as a usage error (the user's, wherever raised); any other
exception is a bug in tpplan and is reported as one (exit 3), with the
traceback under `--debug` or TPPLAN_DEBUG=1.
"""

import errno
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .commands import COMMANDS
from .output import internal_error, print_outcome, usage_error

try:  # typer >= 0.28 carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import ClickException

# What commands raise on purpose: exits, typer's own usage errors, Ctrl-C.
_NOT_A_BUG = (typer.Exit, typer.Abort, ClickException, KeyboardInterrupt)


class _Commands(TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _NOT_A_BUG:
            raise
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # output piped into `head`: typer's main handles it
                raise
            raise typer.Exit(internal_error(exc, debug=bool(ctx.params.get("debug")))) from exc
        except Exception as exc:
            code = _user_error(exc)
            if code is None:
                code = internal_error(exc, debug=bool(ctx.params.get("debug")))
            raise typer.Exit(code) from exc


def _user_error(exc: Exception) -> "int | None":
    """The exit code of a user-facing error that a command let through, printed as
    commands print it (problems; a usage error for a bad MOD:FN); None for a bug."""
    from ..core.problems import PlanError
    from ..simulation.modelref import ModelRefError  # no torch at import

    if isinstance(exc, PlanError):
        from ..render.problems import Outcome

        return print_outcome(Outcome([], exc.problems))
    if isinstance(exc, ModelRefError):
        usage_error(str(exc))
    return None


app = typer.Typer(
    name="tpplan",
    cls=_Commands,
    help="Declarative tensor-parallel plans for PyTorch DTensor: validate, compile, apply, dry-run.\n\n"
    "Exit codes (every command): 0 ok, 1 the plan or model has errors (or warnings under --strict), "
    "2 usage error or unreadable input, 3 an internal error (a bug in tpplan, not in your plan).",
    add_completion=False,
    no_args_is_help=True,
    # Internal errors are reported by _Commands, their traceback only under --debug.
    pretty_exceptions_enable=False,
)


@app.callback()
def _global_options(
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="TPPLAN_DEBUG", help="On an internal error (exit 3), print its traceback."),
    ] = False,
) -> None:
    # Read back by _Commands.invoke from ctx.params; the app's help is Typer(help=...) above.
    pass


for _name, _command in COMMANDS:
    app.command(_name)(_command)


def main() -> None:
    app(prog_name="tpplan")
