"""Printing problems at the edge: text (rich), JSON (SPEC §4) and GitHub annotations.

Every format carries the same records; `exit_code` is the one place that turns
them into SPEC §3's exit status. rich is imported only by `render_text`, so the
other formats, and text written to a pipe or file, do without it.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

from ..core.problems import Problem, sort_problems

# Problems that mean "could not read the input" rather than "the input is wrong".
UNREADABLE_INPUT = frozenset({"TP001", "TP142", "TP600"})  # an unreadable plan or config, a config of no known format, an unreadable --checkpoint


@dataclass
class CheckedPlan:
    """One plan file as `validate` saw it."""

    file: str
    text: str | None = None  # the source, when it could be read (for the line under each problem)
    rules: int | None = None  # None: the plan did not load
    model: str | None = None  # MOD:FN it was checked against
    tp_sizes: list[int] = field(default_factory=list)
    checked: bool = True  # False: a check asked for could not run (the --model did not build)


@dataclass
class Outcome:
    plans: list[CheckedPlan]
    problems: list[Problem]
    strict: bool = False

    @property
    def exit_code(self) -> int:
        """0 ok, 1 errors (or warnings under --strict), 2 unreadable input."""
        if any(p.code in UNREADABLE_INPUT for p in self.problems):
            return 2
        if any(p.severity == "error" or self.strict for p in self.problems):
            return 1
        return 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def by_file(self) -> dict[str, list[Problem]]:
        """Problems grouped by file: the plans in the order given, then any other file
        (a model factory's source, say) by name; sorted by position within each."""
        groups: dict[str, list[Problem]] = {plan.file: [] for plan in self.plans}
        for problem in sort_problems(self.problems):
            groups.setdefault(problem.file, []).append(problem)
        return groups

    def ordered_problems(self) -> list[Problem]:
        return [p for problems in self.by_file().values() for p in problems]


def counts(problems: list[Problem]) -> str:
    """'2 errors, 1 warning' (only the kinds present)."""
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    return ", ".join(_plural(n, word) for n, word in ((errors, "error"), (warnings, "warning")) if n)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# -- json and github ---------------------------------------------------------------


def render_json(outcome: Outcome) -> str:
    """SPEC §4: one object, `{"ok": bool, "problems": [...]}`, whatever the number of plans."""
    import json  # only this format needs it: keep plan-only start-up lean

    return json.dumps({"ok": outcome.ok, "problems": [p.to_dict() for p in outcome.ordered_problems()]}, indent=2) + "\n"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(outcome: Outcome) -> str:
    """One workflow command per problem: GitHub shows them as annotations on the diff."""
    return "".join(
        f"::{p.severity} file={_escape_property(p.file)},line={p.line},col={p.column},"
        f"title={_escape_property(p.code)}::{_escape_data(p.message)}\n"
        for p in outcome.ordered_problems()
    )


# -- text ------------------------------------------------------------------------------

_SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow"}

# A line of text output: (text, rich style) pieces. Built once, then printed with
# colour through rich on a terminal, or as plain text (without importing rich) elsewhere.
Line = list[tuple[str, str]]


def render_text(outcome: Outcome, file: TextIO | None = None) -> None:
    """Problems grouped by file, each as the SPEC's `FILE:LINE:COL: CODE message` line
    with the source line and a caret under it; then a summary. Colour only on a terminal."""
    stream = file or sys.stdout
    lines = text_lines(outcome)
    if not (stream.isatty() or os.environ.get("FORCE_COLOR")):
        stream.write("".join("".join(text for text, _ in line) + "\n" for line in lines))
        return
    from rich.console import Console
    from rich.text import Text

    # Text objects, never markup: messages quote globs like '[0-9]' that rich would
    # take for markup. soft_wrap: a wrapped location line is no longer FILE:LINE:COL.
    console = Console(file=stream, highlight=False, markup=False, emoji=False, soft_wrap=True)
    for line in lines:
        console.print(Text.assemble(*line))


def text_lines(outcome: Outcome) -> list[Line]:
    sources = {plan.file: plan.text.splitlines() for plan in outcome.plans if plan.text is not None}
    plans = {plan.file: plan for plan in outcome.plans}
    groups = outcome.by_file()
    lines: list[Line] = []
    for name, problems in groups.items():
        if not problems:
            plan = plans[name]
            # "ok" only for a plan that loaded and got every check asked for: a plan the
            # model could not be built for is not ok, whatever it holds (its error is elsewhere).
            if plan.rules is not None and plan.checked:
                lines.append([(f"{name}: ", ""), ("ok", "bold green"), (f", {_ok_detail(plan)}", "")])
            continue
        gutter = len(str(max(p.line for p in problems)))
        for problem in problems:
            lines.append(_location_line(problem))
            source_line = _source_line(sources.get(name), name, problem.line)
            if source_line is not None:
                lines += _snippet(problem, source_line, gutter)
    if outcome.problems:
        files = len([name for name, found in groups.items() if found])
        style = "bold red" if outcome.exit_code else "bold yellow"
        lines.append([(f"{counts(outcome.problems)} in {_plural(files, 'file')}", style)])
    return lines


def _ok_detail(plan: CheckedPlan) -> str:
    detail = _plural(plan.rules or 0, "rule")
    if plan.model:
        detail += f", checked against {plan.model} at TP {', '.join(map(str, plan.tp_sizes))}"
    return detail


def _location_line(problem: Problem) -> Line:
    return [
        (f"{problem.file}:{problem.line}:{problem.column}:", "bold"),
        (" ", ""),
        (problem.code, _SEVERITY_STYLE[problem.severity]),
        (f" {problem.message}", ""),
    ]


def _source_line(lines: list[str] | None, file: str, line: int) -> str | None:
    """The text of `line`: from the plan as read, else from disk (a factory's .py file)."""
    if lines is not None:
        return lines[line - 1] if 0 < line <= len(lines) else None
    text = linecache.getline(file, line)
    return text.rstrip("\r\n") if text else None


def _snippet(problem: Problem, source_line: str, gutter: int) -> list[Line]:
    # Tabs are copied into the caret's indent so the caret lines up however they render.
    before = source_line[: problem.column - 1]
    indent = "".join(c if c == "\t" else " " for c in before) + " " * (problem.column - 1 - len(before))
    return [
        [(f"{problem.line:>{gutter}} | ", "dim"), (source_line.rstrip(), "")],
        [(f"{'':>{gutter}} | ", "dim"), (indent, ""), ("^ " + problem.severity, _SEVERITY_STYLE[problem.severity])],
    ]
