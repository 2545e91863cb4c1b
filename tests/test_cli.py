"""`tpplan validate` and `tpplan schema`: exit codes, the three output formats, --model.

Most tests run the typer app in-process; a few run `python -m tpplan` for real
(start-up without torch, no traceback on bad input).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.lint import checks
from tpplan.cli.app import app
from tpplan.docs import schema_text
from tpplan.core.problems import error, warning
from tpplan.render.problems import CheckedPlan, Outcome, render_github
from tpplan.core.schema import plan_json_schema

ROOT = Path(__file__).resolve().parent.parent
MLP_PLAN = str(ROOT / "plans" / "mlp_tp.yaml")
MLP_FIRST_RULE_LINE = Path(MLP_PLAN).read_text().splitlines().index("  blocks.*.in_proj: colwise") + 1

GOOD = """\
version: 1
rules:
  blocks.*.up: colwise
  blocks.*.down: rowwise
"""

THREE_MISTAKES = """\
version: 1
mesh: {axis: tp, sizez: [2]}
rules:
  blocks.*.up: colwse
  blocks.*.down: {style: rowwise, output_layouts: shard(x)}
"""


def run(*args: str):
    # Not a terminal and no FORCE_COLOR: the text format must come out plain.
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Plans written here are named by their bare file names in the output."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, text: str | bytes) -> str:
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return name

    return write


# -- plan-only validate: exit codes ---------------------------------------------------


def test_a_valid_plan_exits_0_and_says_ok_with_its_rule_count(workdir):
    result = run("validate", workdir("plan.yaml", GOOD))
    assert result.exit_code == 0, result.output
    assert result.stdout == "plan.yaml: ok, 2 rules\n"


def test_the_shipped_mlp_plan_validates():
    result = run("validate", MLP_PLAN)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{MLP_PLAN}: ok, 2 rules\n"


def test_a_plan_with_three_mistakes_prints_all_three_at_their_positions_and_exits_1(workdir):
    result = run("validate", workdir("plan.yaml", THREE_MISTAKES))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "plan.yaml:2:18: TP100 unknown key 'sizez' in 'mesh'; did you mean 'sizes'?"
    assert lines[3].startswith("plan.yaml:4:16: TP103 unknown style 'colwse' in rule 'blocks.*.up'; did you mean 'colwise'?")
    assert lines[6].startswith("plan.yaml:5:51: TP104 'shard(x)' is not a placement")
    assert lines[-1] == "3 errors in 1 file"
    assert len(lines) == 10  # each problem: its line, the source line, the caret


def test_text_format_shows_the_source_line_with_a_caret_under_the_column(workdir):
    result = run("validate", workdir("plan.yaml", THREE_MISTAKES))
    lines = result.stdout.splitlines()
    assert lines[4:6] == [
        "4 |   blocks.*.up: colwse",
        "  | " + " " * 15 + "^ error",  # column 16
    ]
    assert lines[7:9] == [
        "5 |   blocks.*.down: {style: rowwise, output_layouts: shard(x)}",
        "  | " + " " * 50 + "^ error",  # column 51
    ]


def test_colour_changes_no_character_of_the_text_output(workdir):
    # rich renders it then: long lines must not wrap, and '[0-9]' in a glob is not markup.
    plan = workdir("plan.yaml", "version: 1\nrules:\n  layers.[0-9].feed_forward.w{1,3}: colwse\n")
    plain = run("validate", plan)
    coloured = CliRunner().invoke(app, ["validate", plan], env={"FORCE_COLOR": "1", "NO_COLOR": None})
    assert "\x1b[" in coloured.stdout
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured.stdout) == plain.stdout
    assert "rule 'layers.[0-9].feed_forward.w{1,3}'" in plain.stdout


def test_a_caret_past_the_end_of_its_line_still_points_at_the_column():
    outcome = Outcome([CheckedPlan("p.yaml", text="a: b\n", rules=None)], [error("TP999", "m", "p.yaml", 1, 7)])
    from tpplan.render.problems import text_lines

    rendered = ["".join(text for text, _ in line) for line in text_lines(outcome)]
    assert rendered[1:3] == ["1 | a: b", "  |       ^ error"]


def test_a_yaml_syntax_error_is_a_located_problem_not_a_traceback(workdir):
    result = run("validate", workdir("plan.yaml", "version: 1\nrules: [a\n"))
    assert result.exit_code == 1
    assert result.stdout.startswith("plan.yaml:2:8: TP010 YAML syntax error: this '[' is never closed")
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_every_plan_given_is_validated_and_problems_are_grouped_by_file(workdir):
    good, bad = workdir("good.yaml", GOOD), workdir("bad.yaml", THREE_MISTAKES)
    result = run("validate", bad, good, workdir("bad2.yaml", "version: 3\nrules: {}\n"))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    located = [line.split(": ", 1)[0] for line in lines if line.startswith("bad")]
    assert located == ["bad.yaml:2:18", "bad.yaml:4:16", "bad.yaml:5:51", "bad2.yaml:1:10"]
    assert "good.yaml: ok, 2 rules" in lines
    assert lines[-1] == "4 errors in 2 files"


def test_a_missing_file_is_TP001_and_exits_2_even_next_to_a_bad_plan(workdir):
    result = run("validate", workdir("bad.yaml", THREE_MISTAKES), "missing.yaml")
    assert result.exit_code == 2
    assert "missing.yaml:1:1: TP001 cannot read the plan: No such file or directory" in result.stdout.splitlines()
    assert "bad.yaml:2:18: TP100" in result.stdout  # the readable plan is still checked


def test_a_binary_file_is_TP001_and_exits_2(workdir):
    result = run("validate", workdir("model.bin", b"\x7fELF\x00\x01\x02"))
    assert result.exit_code == 2
    assert result.stdout.splitlines()[0] == "model.bin:1:1: TP001 this is a binary file, not a YAML plan"


def test_a_non_utf8_file_is_TP001_at_the_bad_byte(workdir):
    result = run("validate", workdir("plan.yaml", b"version: 1\nname: caf\xe9\n"))
    assert result.exit_code == 2
    assert result.stdout.startswith("plan.yaml:2:10: TP001 the plan is not UTF-8 text (byte 0xe9)")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="no-plan"),
        pytest.param(["--format", "xml"], id="unknown-format"),
        pytest.param(["--tp", "0"], id="tp-below-1"),
        pytest.param(["--bogus"], id="unknown-option"),
    ],
)
def test_usage_errors_exit_2(workdir, args):
    plan = [workdir("plan.yaml", GOOD)] if args else []
    result = run("validate", *plan, *args)
    assert result.exit_code == 2
    assert result.stdout == ""


# -- json and github -----------------------------------------------------------------


def test_json_is_one_spec_object_for_several_plans(workdir):
    result = run("validate", workdir("bad.yaml", THREE_MISTAKES), workdir("good.yaml", GOOD), "--format", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert [(p["file"], p["line"], p["column"], p["code"]) for p in report["problems"]] == [
        ("bad.yaml", 2, 18, "TP100"),
        ("bad.yaml", 4, 16, "TP103"),
        ("bad.yaml", 5, 51, "TP104"),
    ]
    assert report["problems"][0] == {
        "code": "TP100",
        "severity": "error",
        "message": "unknown key 'sizez' in 'mesh'; did you mean 'sizes'?",
        "file": "bad.yaml",
        "line": 2,
        "column": 18,
    }


def test_json_of_a_valid_plan_is_ok_with_no_problems(workdir):
    result = run("validate", workdir("plan.yaml", GOOD), "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"ok": True, "problems": []}


def test_json_of_a_missing_file_still_prints_the_object_and_exits_2(workdir):
    result = run("validate", "nope.yaml", "--format", "json")
    assert result.exit_code == 2
    (problem,) = json.loads(result.stdout)["problems"]
    assert (problem["code"], problem["file"], problem["severity"]) == ("TP001", "nope.yaml", "error")


def test_github_format_prints_one_error_annotation_per_problem(workdir):
    result = run("validate", workdir("plan.yaml", THREE_MISTAKES), "--format", "github")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "::error file=plan.yaml,line=2,col=18,title=TP100::unknown key 'sizez' in 'mesh'; did you mean 'sizes'?"
    assert [line.split("::")[1] for line in lines] == [
        "error file=plan.yaml,line=2,col=18,title=TP100",
        "error file=plan.yaml,line=4,col=16,title=TP103",
        "error file=plan.yaml,line=5,col=51,title=TP104",
    ]


def test_github_warnings_are_warning_annotations_and_special_characters_are_escaped():
    problems = [warning("TP300", "50% of heads\nper rank", "dir,a:b.yaml", 3, 4)]
    assert render_github(Outcome([], problems)) == "::warning file=dir%2Ca%3Ab.yaml,line=3,col=4,title=TP300::50%25 of heads%0Aper rank\n"


# -- --strict: warnings --------------------------------------------------------------


@pytest.fixture
def a_model_check_warns(monkeypatch):
    """No shipped check warns yet, so the model-check seam is made to return a warning."""

    def check_model(plan, model, tp_sizes, inputs=None):
        rule = plan.rules[0]
        return [warning("TP399", f"sharding at TP {tp_sizes[0]} looks odd", rule.file, rule.line, rule.column)]

    monkeypatch.setattr(checks, "check_model", check_model)


def test_warnings_exit_0_but_exit_1_under_strict(a_model_check_warns):
    args = ["validate", MLP_PLAN, "--model", "tpplan.models.mlp:tiny", "--tp", "2"]
    relaxed, strict = run(*args), run(*args, "--strict")
    assert (relaxed.exit_code, strict.exit_code) == (0, 1)
    assert f"{MLP_PLAN}:{MLP_FIRST_RULE_LINE}:3: TP399 sharding at TP 2 looks odd" in relaxed.stdout.splitlines()
    assert relaxed.stdout.splitlines()[-1] == "1 warning in 1 file"
    assert "^ warning" in relaxed.stdout


def test_json_ok_follows_strict(a_model_check_warns):
    args = ["validate", MLP_PLAN, "--model", "tpplan.models.mlp:tiny", "--format", "json"]
    assert json.loads(run(*args).stdout)["ok"] is True
    strict = json.loads(run(*args, "--strict").stdout)
    assert strict["ok"] is False and strict["problems"][0]["severity"] == "warning"


def test_exit_code_is_2_for_unreadable_input_then_1_for_errors_then_strict_warnings():
    unreadable, bad, odd = error("TP001", "m", "f"), error("TP200", "m", "f"), warning("TP399", "m", "f")
    assert Outcome([], [odd, bad, unreadable]).exit_code == 2
    assert Outcome([], [odd, bad]).exit_code == 1
    assert Outcome([], [odd]).exit_code == 0
    assert Outcome([], [odd], strict=True).exit_code == 1
    assert Outcome([], [], strict=True).exit_code == 0


# -- --model ---------------------------------------------------------------------------


def test_inputs_let_validate_trace_a_model_whose_first_module_makes_none(workdir):
    """A Conv1d stem has no default inputs: without --inputs the flow checks are skipped
    (TP329, naming --inputs); with them the trace and the shape run happen."""
    plan = workdir("empty.yaml", "version: 1\nrules: {}\n")
    args = ["validate", plan, "--model", "zoo:convnet", "--tp", "2", "--format", "json"]  # tests/zoo.py
    without = {p["code"] for p in json.loads(run(*args).stdout)["problems"]}
    given = {p["code"] for p in json.loads(run(*args, "--inputs", "zoo:convnet_inputs").stdout)["problems"]}
    assert {"TP329", "TP330"} <= without and not {"TP329", "TP330"} & given
    alone = run("validate", plan, "--inputs", "zoo:convnet_inputs")
    assert alone.exit_code == 2 and "--inputs needs --model" in alone.output


FACTORIES = '''\
from torch import nn

BUILT_ON = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return x + self.down(self.up(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        BUILT_ON.append(self.blocks[0].up.weight.device.type)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def good():
    return Model()


def broken():
    raise ValueError("no such config: 'huge'")


def not_a_module():
    return {"blocks": []}


def a_number():
    return 3
'''
BROKEN_LINE = FACTORIES.splitlines().index("    raise ValueError(\"no such config: 'huge'\")") + 1


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    """An importable module of model factories: `cli_test_factories:NAME`."""
    root = tmp_path_factory.mktemp("factories")
    (root / "cli_test_factories.py").write_text(FACTORIES)
    sys.path.insert(0, str(root))
    yield root / "cli_test_factories.py"
    sys.path.remove(str(root))
    sys.modules.pop("cli_test_factories", None)


def test_mlp_plan_resolves_against_the_mlp_model_at_its_mesh_sizes():
    result = run("validate", MLP_PLAN, "--model", "tpplan.models.mlp:tiny")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{MLP_PLAN}: ok, 2 rules, checked against tpplan.models.mlp:tiny at TP 2, 4, 8\n"


def test_the_model_is_built_on_the_meta_device_and_tp_overrides_the_sizes(workdir, factories):
    result = run("validate", workdir("plan.yaml", GOOD), "--model", "cli_test_factories:good", "--tp", "4", "--tp", "16")
    assert result.exit_code == 0, result.output
    assert result.stdout == "plan.yaml: ok, 2 rules, checked against cli_test_factories:good at TP 4, 16\n"
    assert sys.modules["cli_test_factories"].BUILT_ON[-1] == "meta"


def test_without_tp_or_mesh_sizes_the_default_degrees_are_checked(workdir, factories):
    result = run("validate", workdir("plan.yaml", GOOD), "--model", "cli_test_factories:good")
    assert result.stdout.endswith(f"at TP {', '.join(map(str, checks.DEFAULT_TP_SIZES))}\n")


def test_rules_that_match_nothing_or_overlap_are_located_errors(workdir, factories):
    plan = workdir("plan.yaml", GOOD + "  blocks.*.upp: colwise\n  blocks.1.*: no_parallel\n")
    result = run("validate", plan, "--model", "cli_test_factories:good")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan.yaml:5:3: TP200 rule 'blocks.*.upp' matches no module")
    assert "did you mean 'blocks.*.up'" in lines[0]
    assert [line[:20] for line in lines if "TP201" in line] == ["plan.yaml:6:3: TP201"] * 2
    assert lines[-1] == "3 errors in 1 file"


def test_a_factory_that_raises_is_reported_at_the_raising_line(workdir, factories):
    result = run("validate", workdir("plan.yaml", GOOD), "--model", "cli_test_factories:broken")
    assert result.exit_code == 1
    location = f"{factories}:{BROKEN_LINE}:1: TP500 building the model (cli_test_factories:broken) failed: "
    assert location + "ValueError: no such config: 'huge'" in result.stdout.splitlines()
    assert f"{BROKEN_LINE} |     raise ValueError(\"no such config: 'huge'\")" in result.stdout
    assert "Traceback" not in result.output


@pytest.mark.parametrize("factory, returned", [("not_a_module", "a dict"), ("a_number", "an int")])
def test_a_factory_that_returns_no_module_is_an_error(workdir, factories, factory, returned):
    result = run("validate", workdir("plan.yaml", GOOD), "--model", f"cli_test_factories:{factory}")
    assert result.exit_code == 1  # tpplan.simulation.modelref: a factory that runs is a model problem (TP500)
    assert f"TP500 --model cli_test_factories:{factory} returned {returned}, not a torch.nn.Module" in result.stdout


@pytest.mark.parametrize("factory", ["broken", "not_a_module"])
def test_no_plan_is_reported_ok_when_the_model_it_was_to_be_checked_against_did_not_build(workdir, factories, factory):
    plans = workdir("plan.yaml", GOOD), workdir("other.yaml", GOOD)
    result = run("validate", *plans, "--model", f"cli_test_factories:{factory}")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert [line for line in lines if ": ok" in line] == []
    assert lines[0].startswith(f"{factories}:") and " TP500 " in lines[0]
    assert lines[-1] == "1 error in 1 file"


@pytest.mark.parametrize(
    "ref, message",
    [
        ("tpplan.models.mlp", "must be MODULE:FUNCTION"),
        ("no_such_module_xyz:tiny", "no module named 'no_such_module_xyz'"),
        ("tpplan.models.mlp:tinyy", "has no attribute 'tinyy'"),
    ],
)
def test_a_model_reference_that_names_no_callable_is_a_usage_error(workdir, ref, message):
    result = run("validate", workdir("plan.yaml", GOOD), "--model", ref, "--format", "json")
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stdout == ""


# -- schema ------------------------------------------------------------------------------


def test_schema_prints_the_plan_json_schema_with_sorted_keys():
    result = run("schema")
    assert result.exit_code == 0
    assert result.stdout == schema_text()
    assert json.loads(result.stdout) == plan_json_schema()
    assert list(json.loads(result.stdout)) == sorted(plan_json_schema())


# -- real processes --------------------------------------------------------------------


def test_plan_only_validate_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tpplan", "validate", MLP_PLAN],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{MLP_PLAN}: ok, 2 rules\n"
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "tpplan.core.loader" in imported  # the probe sees our own imports
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}


def test_bad_inputs_in_a_real_process_exit_2_with_json_and_no_traceback(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01")
    result = subprocess.run(
        [sys.executable, "-m", "tpplan", "validate", "weights.bin", "missing.yaml", "--format", "json"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert result.returncode == 2
    assert [(p["file"], p["code"]) for p in json.loads(result.stdout)["problems"]] == [
        ("weights.bin", "TP001"),
        ("missing.yaml", "TP001"),
    ]
    assert result.stderr == ""


def test_json_problems_carry_the_fix_their_rule_is_sure_of(workdir):
    """TP340's finding carries its edit (a prepare_module_input on the attention, per layer):
    the same edit init --from applies; problems without a certain fix have no `fixes` key."""
    from tpplan import load_plan
    from tpplan.lint.context import LintContext
    from tpplan.lint.edits import lint_edits
    from tpplan.models import llama

    text = "version: 1\nrules:\n  layers.*.attention.w{q,k,v}: colwise\n  layers.*.attention.wo: rowwise\n"
    result = run("validate", workdir("plan.yaml", text), "--model", "tpplan.models.llama:tiny", "--tp", "2", "--format", "json")
    problems = json.loads(result.stdout)["problems"]
    shared = [p for p in problems if p["code"] == "TP340"]
    assert len(shared) == 1 and all("fixes" not in p for p in problems if p["code"] != "TP340")
    fixes = shared[0]["fixes"]
    assert [f["key"] for f in fixes] == [f"layers.{i}.attention" for i in range(len(llama.tiny().layers))]
    assert all(f["add"] and f["options"]["style"] == "prepare_module_input" and f["options"]["use_local_output"] is False for f in fixes)
    edits = lint_edits(LintContext(load_plan(text=text), llama.tiny(), [2]), ["TP340"])
    assert [(e.key, e.options, e.add, e.why) for e in edits] == [(f["key"], f["options"], f["add"], f["why"]) for f in fixes]
