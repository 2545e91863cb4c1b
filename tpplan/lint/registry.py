"""What a model-aware lint rule is (`LintRule`), and the runner.

Each rule lives in its own module under rules/ and is listed, explicitly, in
`rules.RULES` (as yamllint's `_RULES`): nothing registers by being imported.

In the spirit of yamllint and ruff: a rule has a stable code, a name, a
severity, and documentation (what it catches, why it matters, a failing and a
passing plan). `tpplan rules`, docs/rules.md and the tests all read the same
`LintRule` objects, and the tests run every rule's two examples, so the docs
cannot drift from what the checks do.

Importing this module does not import torch: `tpplan rules` stays fast.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.problems import Fix, Problem, Severity

if TYPE_CHECKING:
    from .context import LintContext

Location = tuple  # (file, line, column)


@dataclass(frozen=True)
class Finding:
    """One thing a rule found, located in a plan file (the runner adds code and severity)."""

    at: Location
    message: str
    severity: Severity | None = None  # None: the rule's; a rule that could not run says so as a warning
    fixes: tuple[Fix, ...] = ()  # the edits to the plan that fix it, where the rule is sure of them


@dataclass(frozen=True)
class LintRule:
    code: str
    name: str
    severity: Severity
    summary: str  # one line: what it catches
    what: str  # What it does
    why: str  # Why is this bad?
    failing: str  # a plan this rule reports ...
    passing: str  # ... and the fixed plan it does not
    # check(ctx) -> findings; a `runs_last` rule is called check(ctx, earlier), with
    # the problems found before it (resolution and every other rule run)
    check: Callable[..., Iterable[Finding]]
    model: str = "tpplan.models.llama:tiny"  # what both examples are validated against
    failing_model: str | None = None  # when the failing example needs another model
    runs_last: bool = False  # sees every other rule's problems first (the dry run)

    def problems(self, ctx: "LintContext", earlier: Sequence[Problem] = ()) -> list[Problem]:
        """This rule's problems, findings that repeat per layer folded into one."""
        findings = self.check(ctx, list(earlier)) if self.runs_last else self.check(ctx)
        groups: dict[tuple, list] = {}
        for finding in findings:
            key = (finding.at, _shape_of(finding.message))
            if key in groups:
                groups[key][1] += 1
                groups[key][2] += [f for f in finding.fixes if f not in groups[key][2]]  # every layer's fix
            else:
                groups[key] = [finding, 1, list(finding.fixes)]
        return [
            Problem(self.code, finding.severity or self.severity, finding.message + (f" (and {count - 1} more like it)" if count > 1 else ""),
                    *finding.at, fixes=tuple(fixes))
            for finding, count, fixes in groups.values()
        ]

    def doc(self) -> str:
        """The rule's documentation as Markdown (what `tpplan rules CODE` prints)."""
        failing_model = self.failing_model or self.model

        def example(text: str) -> str:
            return "```yaml\n" + textwrap.dedent(text).strip("\n") + "\n```"

        return "\n".join([
            f"## {self.code} {self.name} ({self.severity})",
            "",
            self.summary,
            "",
            "**What it does**",
            "",
            _paragraphs(self.what),
            "",
            "**Why is this bad?**",
            "",
            _paragraphs(self.why),
            "",
            f"**Example** (`tpplan validate plan.yaml --model {failing_model}`)",
            "",
            example(self.failing),
            "",
            f"**Use instead** (`--model {self.model}`)",
            "",
            example(self.passing),
            "",
        ])


def _paragraphs(text: str) -> str:
    return textwrap.dedent(text).strip()


def rule_table(rules: Iterable[LintRule]) -> dict[str, LintRule]:
    """{code: rule}, checking that codes are TP3xx and names and codes unique."""
    table: dict[str, LintRule] = {}
    names: set[str] = set()
    for rule in rules:
        if not re.fullmatch(r"TP3\d\d", rule.code):
            raise ValueError(f"model-aware lint codes are TP3xx, not {rule.code}")
        if rule.code in table or rule.name in names:
            raise ValueError(f"two lint rules share the code {rule.code} or the name {rule.name}")
        table[rule.code] = rule
        names.add(rule.name)
    return dict(sorted(table.items()))


# Per-module findings repeat for every layer of a deep model: the same message
# up to the block index. They are reported once, with a count.
_INDEX = re.compile(r"(?<=['.])\d+(?=['.])")


def _shape_of(message: str) -> str:
    return _INDEX.sub("*", message)


def run_rules(ctx: "LintContext", rules: Iterable[LintRule], earlier: Sequence[Problem] = ()) -> list[Problem]:
    """Every rule's problems, in rule order; a `runs_last` rule is handed the problems
    before it (`earlier`, then those of the rules run before it)."""
    earlier = list(earlier)
    found: list[Problem] = []
    for rule in rules:
        found += rule.problems(ctx, earlier + found)
    return found


# -- --select / --ignore -------------------------------------------------------------


class UnknownRuleError(ValueError):
    """A --select / --ignore entry that names no lint rule (TP3xx code, code prefix or name)."""

    def __init__(self, entry: str, suggestions: list[str]):
        self.entry = entry
        self.suggestions = suggestions
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(f"{entry!r} is not a lint rule (a TP3xx code, a code prefix such as TP31, or a rule name){hint}")


def _split(entries: Iterable[str]) -> list[str]:
    # ruff's convention: repeatable, and each entry may be a comma-separated list
    return [part.strip() for entry in entries for part in entry.split(",") if part.strip()]


def _codes_of(entry: str, rules: Mapping[str, LintRule]) -> set[str]:
    upper = entry.upper()
    if re.fullmatch(r"TP\d{1,3}", upper):
        codes = {code for code in rules if code.startswith(upper)}
    else:
        codes = {code for code, rule in rules.items() if rule.name == entry.lower()}
    if not codes:
        words = [*rules, *(rule.name for rule in rules.values())]
        raise UnknownRuleError(entry, difflib.get_close_matches(entry if not upper.startswith("TP") else upper, words, n=3, cutoff=0.6))
    return codes


def select_rules(
    rules: Mapping[str, LintRule], select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
) -> set[str]:
    """The codes of the rules to run: those `select` names (all when None), less those
    `ignore` names. Entries are codes (TP311), prefixes (TP31) or names
    (head-divisibility), comma-separated lists of them accepted; UnknownRuleError
    names an entry that matches no rule and the closest valid ones."""
    chosen = set(rules) if select is None else set().union(*(_codes_of(e, rules) for e in _split(select)))
    if ignore is not None:
        chosen -= set().union(*(_codes_of(e, rules) for e in _split(ignore)))
    return chosen
