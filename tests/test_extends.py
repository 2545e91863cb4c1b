"""Plan composition: `extends: parent.yaml` inherits the parent's rules and settings;
a child rule replaces the parent's rule of the same key, null deletes it; every
problem is located in the file it is in."""

from __future__ import annotations

import os

import pytest
from lint_helpers import found, meta_model

from tpplan import PlanError, load_plan
from tpplan.lint import lint_model

BASE = """\
version: 1
name: base
mesh: {sizes: [2, 4]}
loss_parallel: true
rules:
  blocks.*.in_proj: colwise
  blocks.*.act: no_parallel
  blocks.*.out_proj: rowwise
"""


@pytest.fixture
def plans(tmp_path, monkeypatch):
    """`plans(name, text)` writes a plan under tmp_path and returns its path relative to it (the cwd)."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return name

    return write


def problems_of(path: str) -> list[tuple[str, str, int, int]]:
    with pytest.raises(PlanError) as info:
        load_plan(path)
    return [(p.code, p.file, p.line, p.column) for p in info.value.problems]


def test_a_child_rule_replaces_the_parents_rule_of_the_same_key_in_place(plans):
    plans("base.yaml", BASE)
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.*.act: {style: no_parallel, use_local_output: false}\n"))
    assert [(r.pattern, r.file, r.line) for r in child.rules] == [
        ("blocks.*.in_proj", "base.yaml", 6),
        ("blocks.*.act", "child.yaml", 4),
        ("blocks.*.out_proj", "base.yaml", 8),
    ]
    assert child.rules[1].spec.use_local_output is False


def test_null_deletes_an_inherited_rule_and_new_rules_come_after_the_inherited_ones(plans):
    plans("base.yaml", BASE)
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.*.act: null\n  head: colwise\n"))
    assert [r.pattern for r in child.rules] == ["blocks.*.in_proj", "blocks.*.out_proj", "head"]
    assert "blocks.*.act" not in child.spec.rules


def test_settings_the_child_gives_override_and_the_others_are_inherited(plans):
    plans("base.yaml", BASE)
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nname: child\nmesh: {sizes: [8]}\nrules: {}\n"))
    assert (child.name, child.mesh_sizes, child.loss_parallel) == ("child", [8], True)
    assert child.spec.extends is None  # the merged plan stands on its own


def test_an_extended_plan_means_what_the_same_flat_plan_means(plans):
    plans("base.yaml", BASE)
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nname: base\nrules:\n  blocks.*.act: null\n"))
    flat = load_plan(text=BASE.replace("  blocks.*.act: no_parallel\n", ""))
    assert child.fingerprint() == flat.fingerprint()


def test_the_parent_path_is_relative_to_the_extending_file_and_chains_resolve(plans):
    plans("base.yaml", BASE)
    plans("team/mid.yaml", "version: 1\nextends: ../base.yaml\nrules:\n  blocks.*.act: null\n")
    leaf = load_plan(plans("team/runs/leaf.yaml", "version: 1\nextends: ../mid.yaml\nname: leaf\nrules:\n  head: colwise\n"))
    assert [(r.pattern, r.file) for r in leaf.rules] == [
        ("blocks.*.in_proj", "base.yaml"),
        ("blocks.*.out_proj", "base.yaml"),
        ("head", os.path.join("team", "runs", "leaf.yaml")),
    ]


def test_problems_in_the_parent_are_located_in_the_parent_and_reported_with_the_childs(plans):
    plans("base.yaml", BASE.replace("no_parallel", "no_paralel"))
    child = plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  head: colwse\n")
    assert sorted(problems_of(child)) == [("TP103", "base.yaml", 7, 17), ("TP103", "child.yaml", 4, 9)]


def test_a_missing_parent_is_an_error_at_the_extends_value(plans):
    problem = load_error(plans("child.yaml", "version: 1\nextends: nope.yaml\nrules: {}\n"))
    assert (problem.code, problem.file, problem.line, problem.column) == ("TP107", "child.yaml", 2, 10)
    assert problem.message == "cannot read the parent plan 'nope.yaml' (nope.yaml): No such file or directory"


def test_an_empty_extends_is_an_error(plans):
    problem = load_error(plans("child.yaml", "version: 1\nextends: ''\nrules: {}\n"))
    assert (problem.code, problem.line, problem.column) == ("TP107", 2, 10)


def test_a_cycle_is_an_error_in_the_file_that_closes_it(plans):
    plans("a.yaml", "version: 1\nextends: b.yaml\nrules: {}\n")
    plans("b.yaml", "version: 1\nextends: a.yaml\nrules: {}\n")
    problem = load_error("a.yaml")
    assert (problem.code, problem.file, problem.line, problem.column) == ("TP107", "b.yaml", 2, 10)
    assert problem.message == "'extends' makes a cycle (a.yaml -> b.yaml -> a.yaml): a plan cannot extend itself"


def test_a_plan_extending_itself_is_a_cycle(plans):
    problem = load_error(plans("a.yaml", "version: 1\nextends: ./a.yaml\nrules: {}\n"))
    assert (problem.code, problem.file) == ("TP107", "a.yaml")


def test_null_for_a_key_the_parent_does_not_have_is_an_error_with_a_suggestion(plans):
    plans("base.yaml", BASE)
    problem = load_error(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.*.actt: null\n"))
    assert (problem.code, problem.file, problem.line, problem.column) == ("TP108", "child.yaml", 4, 3)
    assert problem.message == (
        "rule 'blocks.*.actt' is null, which deletes the inherited rule of that key, but base.yaml has none; "
        "did you mean 'blocks.*.act'?"
    )


def test_null_in_a_plan_that_extends_nothing_is_a_bad_value(plans):
    assert problems_of(plans("plan.yaml", "version: 1\nrules:\n  blocks.*.act: null\n")) == [("TP101", "plan.yaml", 3, 17)]


def test_extends_must_be_a_path(plans):
    assert [p[0] for p in problems_of(plans("plan.yaml", "version: 1\nextends: 3\nrules: {}\n"))] == ["TP101"]


def test_model_checks_of_inherited_rules_point_into_the_parent(plans):
    plans("base.yaml", "version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules: {}\n"))
    problems = lint_model(child, meta_model("tpplan.models.mlp:tiny"), [2], select=["TP321"])
    assert [(p.file, p.line, p.column) for p in problems] == [("base.yaml", 3, 3)]


def test_a_finding_between_files_is_located_at_its_rule_and_names_the_other_file(plans):
    plans("base.yaml", "version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.*.act: no_parallel\n"))
    [problem] = lint_model(child, meta_model("tpplan.models.mlp:tiny"), [2], select=["TP320"])
    assert (problem.file, problem.line, problem.column) == ("child.yaml", 4, 3)
    assert "from colwise 'blocks.0.in_proj' (rule 'blocks.*.in_proj' at base.yaml:3)" in problem.message


def test_rules_that_overlap_across_files_name_the_other_file(plans):
    plans("base.yaml", "version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.0.*: no_parallel\n"))
    with pytest.raises(PlanError) as info:
        child.match(meta_model("tpplan.models.mlp:tiny"))
    [problem] = info.value.problems
    assert (problem.code, problem.file, problem.line) == ("TP201", "child.yaml", 4)
    assert "rule 'blocks.*.in_proj' (base.yaml:3)" in problem.message


def test_resolution_problems_of_inherited_rules_are_in_the_parent(plans):
    plans("base.yaml", "version: 1\nrules:\n  blocks.*.in_prj: colwise\n")
    child = load_plan(plans("child.yaml", "version: 1\nextends: base.yaml\nrules:\n  blocks.*.out_proj: rowwise\n"))
    problems = lint_model(child, meta_model("tpplan.models.mlp:tiny"), [2], select=[])
    assert found(problems, "TP200") == [(3, 3)] and problems[0].file == "base.yaml"


def load_error(path: str):
    with pytest.raises(PlanError) as info:
        load_plan(path)
    [problem] = info.value.problems
    return problem
