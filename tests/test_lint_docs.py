"""The rules' documentation is executable and complete: each rule's failing
example is reported and its passing one is an error-free plan; every code the
package can report is documented; docs/rules.md is generated from the same
text; `tpplan rules` prints it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from lint_helpers import lint
from typer.testing import CliRunner

from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.lint import RULES
from tpplan.lint.codes import catalog
from tpplan import docs
from tpplan.docs import REGENERATE, rules_markdown

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


def _sizes(text: str) -> list[int]:
    return load_plan(text=textwrap.dedent(text)).mesh_sizes or [2]


@pytest.mark.parametrize("code", sorted(RULES))
def test_the_failing_example_is_reported(code):
    rule = RULES[code]
    problems = lint(rule.failing, rule.failing_model or rule.model, tp=_sizes(rule.failing))
    assert code in [p.code for p in problems], [str(p) for p in problems]
    assert all(p.file == "plan.yaml" for p in problems if p.code == code)


@pytest.mark.parametrize("code", sorted(RULES))
def test_the_passing_example_is_a_plan_without_errors(code):
    rule = RULES[code]
    problems = lint(rule.passing, rule.model, tp=_sizes(rule.passing))
    assert code not in [p.code for p in problems], [str(p) for p in problems]
    assert not [str(p) for p in problems if p.severity == "error"]


@pytest.mark.parametrize("code", sorted(RULES))
def test_every_rule_is_documented_in_the_ruff_style(code):
    rule = RULES[code]
    assert re.fullmatch(r"TP3\d\d", code) and re.fullmatch(r"[a-z]+(-[a-z]+)*", rule.name)
    doc = rule.doc()
    for heading in ("**What it does**", "**Why is this bad?**", "**Example**", "**Use instead**"):
        assert heading in doc
    assert doc.startswith(f"## {code} {rule.name} ({rule.severity})\n\n{rule.summary}\n")


def test_rule_names_are_unique():
    names = [entry.name for entry in catalog()]
    assert len(names) == len(set(names))


def test_every_code_the_package_reports_is_documented():
    source = "\n".join(path.read_text() for path in (ROOT / "tpplan").rglob("*.py"))
    reported = set(re.findall(r"[\"'](TP\d{3})[\"']", source))
    documented = {entry.code for entry in catalog()}
    assert reported - documented == set()
    assert {"TP001", "TP200", "TP300", "TP502"} <= reported  # the scan itself works


def test_docs_rules_md_is_generated_from_the_registry():
    assert (docs.ROOT / docs.RULES_MD).read_text(encoding="utf-8") == rules_markdown(), f"docs/rules.md is stale: run `{REGENERATE}`"


def test_rules_lists_every_code_with_its_severity():
    result = run("rules")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert re.match(r"TP311  head-divisibility +error +A TP degree does not divide the attention heads", next(l for l in lines if l.startswith("TP311")))
    assert {line.split()[0] for line in lines if line.startswith("TP")} == {entry.code for entry in catalog()}


@pytest.mark.parametrize("query", ["TP324", "tp324", "uneven-handoff"])
def test_rules_code_prints_that_codes_documentation(query):
    result = run("rules", query)
    assert result.exit_code == 0
    assert result.stdout == RULES["TP324"].doc().rstrip("\n") + "\n"


def test_rules_prints_core_codes_too():
    result = run("rules", "TP201")
    assert result.exit_code == 0 and result.stdout.startswith("## TP201 module-matched-twice (error)\n")


def test_an_unknown_code_is_a_usage_error_with_suggestions():
    result = run("rules", "TP3111")
    assert result.exit_code == 2
    assert "unknown code or rule name 'TP3111'; did you mean TP311" in result.output
