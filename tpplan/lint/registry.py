"""The model-aware lint rules: one `LintRule` per check, each in its own module.

In the spirit of yamllint and ruff: a rule has a stable code, a name, a
severity, and documentation (what it catches, why it matters, a failing and a
passing plan). `tpplan rules`, docs/rules.md and the tests all read the same
`LintRule` objects, and the tests run every rule's two examples, so the docs
cannot drift from what the checks do.

Importing this module does not import torch: `tpplan rules` stays fast.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.problems import Problem, Severity

if TYPE_CHECKING:
    from .context import LintContext

Location = tuple  # (file, line, column)


@dataclass(frozen=True)
class Finding:
    """One thing a rule found, located in a plan file (the runner adds code and severity)."""

    at: Location
    message: str


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
    check: Callable[["LintContext"], Iterable[Finding]]
    model: str = "tpplan.models.llama:tiny"  # what both examples are validated against
    failing_model: str | None = None  # when the failing example needs another model
    runs_last: bool = False  # sees every other rule's problems first (the dry run)

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


RULES: dict[str, LintRule] = {}


def register(rule: LintRule) -> LintRule:
    if rule.code in RULES:
        raise ValueError(f"two lint rules share the code {rule.code}")
    if not re.fullmatch(r"TP3\d\d", rule.code):
        raise ValueError(f"model-aware lint codes are TP3xx, not {rule.code}")
    RULES[rule.code] = rule
    return rule


# Per-module findings repeat for every layer of a deep model: the same message
# up to the block index. They are reported once, with a count.
_INDEX = re.compile(r"(?<=['.])\d+(?=['.])")


def _shape_of(message: str) -> str:
    return _INDEX.sub("*", message)


def run_rules(ctx: "LintContext", rules: Iterable[LintRule]) -> list[Problem]:
    """Every rule's problems, in rule order; a rule sees those of the rules before it
    in `ctx.problems_so_far` (the dry run skips itself after errors)."""
    problems = ctx.problems_so_far
    for rule in rules:
        groups: dict[tuple, list] = {}
        for finding in rule.check(ctx):
            key = (finding.at, _shape_of(finding.message))
            if key in groups:
                groups[key][1] += 1
            else:
                groups[key] = [finding, 1]
        for finding, count in groups.values():
            message = finding.message + (f" (and {count - 1} more like it)" if count > 1 else "")
            problems.append(Problem(rule.code, rule.severity, message, *finding.at))
    return problems
