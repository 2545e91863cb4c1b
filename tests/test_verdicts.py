"""The lint's verdicts, proven by `--check`: on the shipped plans, the rule docs'
examples, fuzzed plans and the family sweep's tiny models, a plan the lint finds
no error in passes `apply --dry-run --check`, and a plan with a TP32x error fails
it (tests/verdicts.py). The disagreements that remain are listed in
verdict_cases.KNOWN with their reasons, and the list must stay true.

By default (about 30 s): two reference plans and the layout-flow rules' examples
(TP32x) at one degree, a few fuzzed plans and one family; `-m slow` adds every
degree, every shipped plan and rule example, more fuzzed plans and every family (its
imported plan, and its `--minimal` plan where that differs; a family whose tiny model
does not run on the default inputs is skipped). `python tests/test_verdicts.py`
prints every verdict and the counts.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from lint_helpers import lint, only
from test_lint_fuzz import mutated
from families import family_params
from verdict_cases import KNOWN, degrees, rule_examples, shipped, swept
from verdicts import Verdict, judge, tally

from tpplan import PlanError, load_plan
from tpplan.lint import RULES

FAMILIES = ["apertus"]  # by default: its TP325 confirmed by TP506 (test_hf_sweep runs llama's plan)
DEFAULT_PLANS = ["plans/llama_tp.yaml", "plans/mlp_tp.yaml"]  # at their first degree
# by default, the examples of the rules whose verdicts --check proves or refutes: the layout flow (TP32x)
DEFAULT_EXAMPLES = re.compile(r"TP32\d")


def expected(key: str) -> str:
    return KNOWN.get(key, ("agree", ""))[0]


def assert_verdict(case_id: str, path: str, model: str, tp: int) -> Verdict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict = judge(path, model, tp)
    assert verdict.kind == expected(f"{case_id}@{tp}"), verdict.describe()
    return verdict


# -- the harness's own verdicts ------------------------------------------------------------


@pytest.mark.parametrize("lint_codes, check_codes, kind", [
    ((), (), "agree"),
    ((), ("TP505",), "miss"),
    (("TP320",), ("TP502",), "agree"),
    (("TP321", "TP311"), (), "false-alarm"),
    (("TP370",), (), "unconfirmed"),
    (("TP320",), ("not run",), "not-run"),
])
def test_a_verdict_is_a_miss_or_a_false_alarm_only_where_lint_and_check_disagree(lint_codes, check_codes, kind):
    assert Verdict("p.yaml", "m:f", 2, lint_codes, check_codes).kind == kind


def test_the_tally_counts_each_kind_and_the_plans_compared():
    verdicts = [Verdict("p", "m", 2, (), ()), Verdict("p", "m", 2, (), ("TP505",)), Verdict("p", "m", 2, (), ("not run",))]
    assert dict(tally(verdicts)) == {"agree": 1, "miss": 1, "false-alarm": 0, "unconfirmed": 0, "not-run": 1, "plans": 2}


def test_every_known_disagreement_names_a_case_and_a_reason():
    kinds = {"miss", "false-alarm", "unconfirmed", "not-run"}
    assert all(kind in kinds and len(reason) > 40 for kind, reason in KNOWN.values())
    assert all(key.rpartition("@")[2].isdigit() for key in KNOWN)


# -- the shipped plans ---------------------------------------------------------------------------


def _shipped_params():
    for case_id, path, model in shipped():
        for index, tp in enumerate(degrees(path)):
            default = case_id.removeprefix("shipped:") in DEFAULT_PLANS and index == 0
            yield pytest.param(case_id, path, model, tp, marks=() if default else (pytest.mark.slow,), id=f"{case_id}@{tp}")


@pytest.mark.usefixtures("no_process_group_leaks")
@pytest.mark.parametrize("case_id, path, model, tp", _shipped_params())
def test_a_shipped_plan_the_lint_finds_clean_passes_check(case_id, path, model, tp):
    if "tpplan.models.hf:" in model:
        pytest.importorskip("transformers")
    verdict = assert_verdict(case_id, path, model, tp)
    assert verdict.kind != "agree" or verdict.lint == verdict.check == ()


# -- the rule docs' examples -------------------------------------------------------------------


def _example_params():
    for code, rule in RULES.items():
        for which in ("failing", "passing"):
            for index, tp in enumerate(load_plan(text=getattr(rule, which)).mesh_sizes or [2]):
                default = index == 0 and DEFAULT_EXAMPLES.fullmatch(code)
                yield pytest.param(code, which, tp, marks=() if default else (pytest.mark.slow,), id=f"{code}-{which}@{tp}")


@pytest.mark.usefixtures("no_process_group_leaks")
@pytest.mark.parametrize("code, which, tp", _example_params())
def test_a_rule_example_gets_the_verdict_of_check(code, which, tp, tmp_path):
    case_id, path, model = next(c for c in rule_examples(tmp_path) if c[0] == f"rules:{code}:{which}")
    if "tpplan.models.hf:" in model:
        pytest.importorskip("transformers")
    assert_verdict(case_id, path, model, tp)


# -- fuzzed plans --------------------------------------------------------------------------------


def _judge_fuzzed(case, directory: Path) -> None:
    text, ref, tps = case
    path = directory / "fuzz.yaml"
    path.write_text(text)
    try:
        load_plan(path)
    except PlanError:
        return  # a plan that does not load has no verdict to compare (test_lint_fuzz checks its problems)
    assert_verdict("fuzz", str(path), ref, tps[0])


def _fuzz_test(examples: int):
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(mutated())
    def run(case):
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            _judge_fuzzed(case, Path(directory))

    return run


@pytest.mark.usefixtures("no_process_group_leaks")
def test_fuzzed_plans_get_the_verdict_of_check():
    _fuzz_test(4)()


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group_leaks")
def test_many_fuzzed_plans_get_the_verdict_of_check():
    _fuzz_test(60)()


# -- the family sweep ----------------------------------------------------------------------------


@pytest.mark.usefixtures("no_process_group_leaks")
@pytest.mark.parametrize("model_type", family_params(FAMILIES))
def test_a_familys_plan_gets_the_verdict_of_check(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = swept(model_type, tmp_path)
    if isinstance(cases, str):
        pytest.skip(f"{model_type}: {cases[:200]}")
    for case_id, path, model in cases:  # its plan, and its --minimal plan where that differs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdict = judge(path, model, 2)
        if verdict.kind == "not-run" and f"{case_id}@2" not in KNOWN:  # the sweep's "needs --inputs" and "does not run"
            pytest.skip(f"{model_type}: its tiny model does not run on the default inputs: {verdict.check_text[:200]}")
        assert verdict.kind == expected(f"{case_id}@2"), verdict.describe()


# -- what the fixes found by the differential changed --------------------------------------------


def test_an_uneven_shard_passes_check_after_the_fake_pass(tmp_path):
    # DTensor's sharding-propagation caches kept rank 0's local shapes from the fake
    # pass: at TP 3 rank 2's 42 features were viewed as 43 (TP502, where torchrun passes)
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n  blocks.*.in_proj: {style: colwise, use_local_output: false}\n  blocks.*.out_proj: rowwise\n")
    report = dry_run(ApplyOptions(plan=str(path), model="tpplan.models.mlp:tiny", tp=3, check=True))
    assert report.problems == [] and report.check.passed


@pytest.mark.usefixtures("no_process_group_leaks")
def test_a_model_that_fails_on_one_device_too_is_not_run_not_a_miss(tmp_path):  # tests/drafter_model.py
    # found by the family sweep: gemma4_unified_assistant's tiny model needs the target model's
    # states; the dry run's TP500 (the model fails without the plan) checked no plan
    (tmp_path / "plan.yaml").write_text("version: 1\nrules:\n  up: colwise\n")
    verdict = judge(tmp_path / "plan.yaml", "drafter_model:build", 2)
    assert (verdict.kind, verdict.lint, verdict.check, verdict.disclosed) == ("not-run", (), ("not run",), ("TP329",))
    assert "TP500 the model fails on one device too" in verdict.check_text


def test_layout_flow_errors_apply_only_at_degrees_that_split_tensors():
    plan = """
        version: 1
        rules:
          blocks.*.in_proj: colwise
    """
    # at TP 1 the local shard(-1) is the whole tensor: --check passes, so the lint is clean
    assert [p.code for p in lint(plan, "tpplan.models.mlp:tiny", tp=(1,)) if p.severity == "error"] == []
    assert only(lint(plan, "tpplan.models.mlp:tiny", tp=(1, 2)), "TP321").line == 3


@pytest.mark.usefixtures("no_process_group_leaks")
def test_a_whole_gate_meeting_a_local_shard_is_tp325_confirmed_by_tp506_and_sum_output_grad_fixes_it(tmp_path):
    # found by the fuzzed plans' sum_output_grad: the gate's output gradient is each rank's share
    without, fixed = tmp_path / "without.yaml", tmp_path / "fixed.yaml"
    without.write_text("version: 1\nrules:\n  up: colwise\n  down: rowwise\n")
    fixed.write_text("version: 1\nrules:\n  gate: sum_output_grad\n  up: colwise\n  down: rowwise\n")
    verdict = assert_verdict("gate", str(without), "tpplan.models.rule_examples:gated_mlp", 2)
    assert (verdict.lint, set(verdict.check)) == (("TP325",), {"TP506"})
    assert verdict.lint_text.startswith(f"{without}:3:3: TP325 the local shard(-1) (2, 8, 64) that colwise 'up' ")
    assert "meets, in 'mul', a whole tensor computed from parameters (returned by 'gate')" in verdict.lint_text
    assert verdict.lint_text.endswith("add the rule 'gate: sum_output_grad' (its output's gradient summed over the mesh)")
    assert assert_verdict("gate", str(fixed), "tpplan.models.rule_examples:gated_mlp", 2).lint == ()


def test_a_dtensor_meeting_a_plain_tensor_is_reported_at_tp_1_too():
    rule = RULES["TP323"]
    assert "TP323" in [p.code for p in lint(rule.failing, rule.model, tp=(1,))]


if __name__ == "__main__":  # python tests/test_verdicts.py [fuzzed-count]: every verdict, then the counts
    import tempfile

    verdicts: list[Verdict] = []

    def record(case_id: str, path: str, model: str, tp: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdict = judge(path, model, tp)
        verdicts.append(verdict)
        known = f" [known: {KNOWN[f'{case_id}@{tp}'][1]}]" if f"{case_id}@{tp}" in KNOWN else ""
        print(f"{case_id}@{tp}: {verdict.describe()}{known}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for case_id, path, model in shipped() + rule_examples(directory):
            for tp in degrees(path):
                record(case_id, path, model, tp)
        fuzzed = int(sys.argv[1]) if len(sys.argv) > 1 else 100
        for index in range(fuzzed):
            text, ref, tps = mutated().example()
            path = directory / f"fuzz{index}.yaml"
            path.write_text(text)
            try:
                load_plan(path)
            except PlanError:
                continue
            record(f"fuzz:{index}", str(path), ref, tps[0])
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            family = directory / model_type
            family.mkdir()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cases = swept(model_type, family)
            if isinstance(cases, str):
                print(f"sweep:{model_type}: skipped ({cases.splitlines()[0][:120]})", flush=True)
                continue
            for case in cases:
                record(*case, 2)
    print(dict(tally(verdicts)))
