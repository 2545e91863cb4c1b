"""`tpplan validate PLAN...`: schema and plan-only checks; with --model, the model-aware lint.

Plan-only validation must not import torch and starts in a benchmarked time
(bench/bench_validate_startup.py): everything beyond typer is imported inside
the command, and only what its options need.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from .output import Format, exit_with, print_outcome, usage_error

if TYPE_CHECKING:
    from ..core.plan import Plan
    from ..core.problems import Problem
    from ..render.problems import CheckedPlan


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
    inputs: Annotated[
        Optional[str],
        typer.Option(
            metavar="MOD:FN",
            help="With --model, example inputs to trace the forward with (as apply's --inputs); default: "
            "from the model's first module (token ids for an Embedding, floats for a Linear).",
            show_default=False,
        ),
    ] = None,
    world: Annotated[
        Optional[int],
        typer.Option(
            metavar="N",
            min=1,
            help="World size: check that a version 2 plan's mesh axes multiply to N (the -1 axis resolved to a whole "
            "number) and the checks that read the resolved axis.",
            show_default=False,
        ),
    ] = None,
    format: Annotated[Format, typer.Option(help="Output format: text (for people), json (one object; cli.md lists its keys), github (annotations).")] = Format.text,
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
    if inputs is not None and model is None:
        usage_error("--inputs needs --model: the inputs are traced through that model's forward")
    factory = None
    if model is not None:
        from ..simulation.modelref import ModelRefError, load_callable

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
        problems += _axis_problems(plan, world)

    if factory is not None:
        problems += _check_against_model(model, factory, loaded, tp, rules, inputs)

    exit_with(print_outcome(Outcome(checked, problems, strict), format))


def _axis_problems(plan: "Plan", world: int | None) -> "list[Problem]":
    """A version 2 plan's checks beyond the loader's: against the world size, and its warnings."""
    if plan.version != 2:
        return []
    from ..core.axes import section_warnings, world_problems

    return (world_problems(plan, world) if world is not None else []) + section_warnings(plan)


def _check_against_model(
    ref: str, factory: Callable[[], Any], loaded: "list[tuple[CheckedPlan, Plan]]", tp: list[int] | None,
    rules: "set[str] | None" = None, inputs: str | None = None,
) -> "list[Problem]":
    """Build the model once, on the meta device, and check every loaded plan against it."""
    from ..core.problems import PlanError
    from ..lint.checks import check_model, tp_sizes_for
    from ..simulation.modelref import build_model

    try:
        built = build_model(ref, "meta", factory)
    except PlanError as exc:
        for entry, _ in loaded:
            entry.checked = False
        return exc.problems
    problems: list[Problem] = []
    for entry, plan in loaded:
        entry.model, entry.tp_sizes = ref, tp_sizes_for(plan, tp)
        selection = {} if rules is None else {"select": sorted(rules)}
        problems += check_model(plan, built, entry.tp_sizes, inputs=inputs, **selection)
    return problems
