"""The `tpplan` command line (SPEC §4): a thin typer layer over the library.

Commands turn arguments into library calls and hand the problems to
`report`; they hold no checks of their own. Plan-only `validate` must not
import torch and starts in a benchmarked time (bench/bench_validate_startup.py),
so anything heavy is imported inside the command that needs it. The CLI modules
avoid `from __future__ import annotations`: typer would compile every option's
annotation string at start-up (~4 ms of the benchmark).
"""

import sys
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer

if TYPE_CHECKING:
    from ..core.plan import Plan
    from ..core.problems import Problem
    from ..render.problems import CheckedPlan, Outcome

app = typer.Typer(
    name="tpplan",
    help="Declarative tensor-parallel plans for PyTorch DTensor: validate, compile, apply, dry-run.\n\n"
    "Exit codes (every command): 0 ok, 1 the plan or model has errors (or warnings under --strict), "
    "2 usage error or unreadable input.",
    add_completion=False,
    no_args_is_help=True,
    # A bug in tpplan should show its traceback plainly; user input never raises.
    pretty_exceptions_enable=False,
)


class Format(str, Enum):
    text = "text"
    json = "json"
    github = "github"


def usage_error(message: str) -> NoReturn:
    """Exit 2 with a one-line message, as typer does for its own usage errors."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def validate(
    plans: Annotated[list[str], typer.Argument(metavar="PLAN", help="Plan files (YAML) to validate.", show_default=False)],
    model: Annotated[
        Optional[str],
        typer.Option(
            metavar="MOD:FN",
            help="Also check the plans against this model: an importable callable returning an nn.Module, "
            "built on the meta device (imports torch).",
        ),
    ] = None,
    tp: Annotated[
        Optional[list[int]],
        typer.Option(
            metavar="N",
            min=1,
            help="TP degree to check the model at; default: the plan's mesh.sizes, else 2, 4 and 8.",
            show_default=False,
        ),
    ] = None,
    format: Annotated[Format, typer.Option(help="Output format: text (for people), json (SPEC §4), github (annotations).")] = Format.text,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too.")] = False,
    select: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="CODE",
            help="With --model, run only these lint rules: TP3xx codes, prefixes (TP31) or names "
            "(head-divisibility); repeatable, comma-separated lists accepted.",
            show_default=False,
        ),
    ] = None,
    ignore: Annotated[
        Optional[list[str]],
        typer.Option(
            metavar="CODE",
            help="With --model, skip these lint rules (as --select); applied after --select.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Validate plans: schema and plan-only checks; with --model, strict resolution and model checks."""
    from ..core.loader import load_plan, read_plan_text
    from ..core.problems import PlanError
    from ..render.problems import CheckedPlan, Outcome

    rules = None
    if select is not None or ignore is not None:
        from ..lint.checks import UnknownRuleError, selected_codes

        try:
            selected_codes(select)
        except UnknownRuleError as exc:
            usage_error(f"--select: {exc}")
        try:
            rules = selected_codes(select, ignore)
        except UnknownRuleError as exc:
            usage_error(f"--ignore: {exc}")
    factory = None
    if model is not None:
        from ..runtime.modelref import ModelRefError, load_callable

        try:
            factory = load_callable(model, "--model")
        except ModelRefError as exc:
            usage_error(str(exc))

    checked: list[CheckedPlan] = []
    loaded: list[tuple[CheckedPlan, Plan]] = []
    problems: list[Problem] = []
    for path in plans:
        entry = CheckedPlan(path)
        checked.append(entry)
        try:
            entry.text = read_plan_text(path)
            plan = load_plan(text=entry.text, file=path)
        except PlanError as exc:
            problems += exc.problems
            continue
        entry.rules = len(plan.rules)
        loaded.append((entry, plan))

    if factory is not None:
        problems += _check_against_model(model, factory, loaded, tp, rules)

    _print(Outcome(checked, problems, strict), format)


def _check_against_model(
    ref: str, factory: Callable[[], Any], loaded: "list[tuple[CheckedPlan, Plan]]", tp: list[int] | None,
    rules: "set[str] | None" = None,
) -> "list[Problem]":
    """Build the model once, on the meta device, and check every loaded plan against it."""
    from ..lint.checks import check_model, tp_sizes_for
    from ..runtime.modelref import build_model
    from ..core.problems import PlanError

    try:
        built = build_model(ref, "meta", factory)
    except PlanError as exc:
        return exc.problems
    problems: list[Problem] = []
    for entry, plan in loaded:
        entry.model, entry.tp_sizes = ref, tp_sizes_for(plan, tp)
        selection = {} if rules is None else {"select": sorted(rules)}
        problems += check_model(plan, built, entry.tp_sizes, **selection)
    return problems


def _print(outcome: "Outcome", format: Format) -> NoReturn:
    from ..render import problems as report

    if format is Format.text:
        report.render_text(outcome)
    else:
        render = report.render_json if format is Format.json else report.render_github
        sys.stdout.write(render(outcome))
    raise typer.Exit(outcome.exit_code)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the plan format (what schemas/plan.schema.json holds)."""
    from ..docs import schema_text

    sys.stdout.write(schema_text())


def main() -> None:
    app(prog_name="tpplan")


# -- command registration --------------------------------------------------------------
# Commands defined in other modules register here, one line each, e.g.
#     from .cli_apply import apply; app.command()(apply)
# They are imported whenever `tpplan` starts, so such a module must not import
# torch (or anything heavy) at import time. cli.md covers every registered
# command: regenerate it with `python -m tpplan.docs`.
from .apply import apply  # noqa: E402
app.command()(apply)
from .import_hf import import_hf  # noqa: E402
app.command("import-hf")(import_hf)
from .rules import rules  # noqa: E402
app.command()(rules)
