"""tpplan's own bugs are shown as bugs: an exception no command turned into a
result is reported in one short message that asks for a report (exit 3), the
traceback only with --debug or TPPLAN_DEBUG=1; never as the user's problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app

PLAN = str(Path(__file__).resolve().parent.parent / "plans" / "mlp_tp.yaml")
BUG = "tpplan: internal error (a bug in tpplan, not in your plan): RuntimeError: the loader broke"


@pytest.fixture
def broken_loader(monkeypatch):
    def load_plan(*args, **kwargs):
        raise RuntimeError("the loader broke\nwith a second line nobody needs here")

    monkeypatch.setattr("tpplan.core.loader.load_plan", load_plan)


def run(*args: str, env: dict[str, str | None] | None = None):
    return CliRunner().invoke(app, list(args), env={"TPPLAN_DEBUG": None, **(env or {})})


def test_an_internal_error_exits_3_with_one_short_message_and_no_traceback(broken_loader):
    result = run("validate", PLAN)
    assert result.exit_code == 3
    lines = result.output.splitlines()
    assert lines[0] == BUG
    assert "report it with the traceback" in lines[1] and "--debug" in lines[1]
    assert len(lines) == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("how", ["option", "env"])
def test_debug_prints_the_traceback_of_an_internal_error(broken_loader, how):
    result = run("--debug", "validate", PLAN) if how == "option" else run("validate", PLAN, env={"TPPLAN_DEBUG": "1"})
    assert result.exit_code == 3
    assert "Traceback (most recent call last)" in result.output
    assert 'raise RuntimeError("the loader broke' in result.output  # the frame that raised
    assert BUG in result.output


def test_user_errors_are_still_not_bugs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  a: no_such_style\n")
    assert run("validate", str(bad)).exit_code == 1
    assert run("validate", str(tmp_path / "missing.yaml")).exit_code == 2
    assert run("rules", "TP9999").exit_code == 2
    assert run("validate", "--no-such-option", PLAN).exit_code == 2


def test_a_plan_error_or_bad_reference_a_command_lets_through_is_still_the_users(monkeypatch):
    from tpplan.core.problems import PlanError, error
    from tpplan.simulation.modelref import ModelRefError

    def raises(exc):
        def find(code):
            raise exc

        return find

    monkeypatch.setattr("tpplan.lint.codes.find", raises(PlanError([error("TP201", "two rules claim 'a'", "p.yaml", 3, 5)])))
    result = run("rules", "TP201")
    assert result.exit_code == 1
    assert "p.yaml:3:5: TP201 two rules claim 'a'" in result.output and "internal error" not in result.output
    monkeypatch.setattr("tpplan.lint.codes.find", raises(ModelRefError("--model 'x' must be MODULE:FUNCTION")))
    result = run("rules", "TP201")
    assert result.exit_code == 2
    assert result.output == "Error: --model 'x' must be MODULE:FUNCTION\n"


def test_an_internal_error_in_a_real_process_exits_3_without_a_traceback():
    probe = (
        "import sys, tpplan.core.loader as loader\n"
        "def broken(*a, **k): raise RuntimeError('the loader broke')\n"
        "loader.load_plan = broken\n"
        "from tpplan.cli.app import main\n"
        f"sys.argv = ['tpplan', 'validate', {PLAN!r}]\n"
        "main()\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TPPLAN_DEBUG"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert result.returncode == 3, result.stderr
    assert result.stderr.splitlines()[0] == BUG
    assert "Traceback" not in result.stderr and result.stdout == ""
