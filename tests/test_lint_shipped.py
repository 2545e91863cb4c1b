"""The shipped plans pass model-aware validation against the models they are for:
no errors, and the communication-minimal reference plans no warnings either."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lint_helpers import meta_model
from verdict_cases import REFERENCE  # the reference plans and their models, one list for both tests

from tpplan import load_plan
from tpplan.lint.checks import check_model

ROOT = Path(__file__).resolve().parent.parent



@pytest.mark.parametrize("plan, model", REFERENCE)
def test_reference_plans_have_no_problems_at_their_degrees(plan, model):
    loaded = load_plan(ROOT / plan)
    assert [str(p) for p in check_model(loaded, meta_model(model), loaded.mesh_sizes)] == []


def test_the_sequence_parallel_plan_is_clean_on_llama3_8b_shapes():
    loaded = load_plan(ROOT / "plans/llama_tp_sp.yaml")
    assert [str(p) for p in check_model(loaded, meta_model("tpplan.models.llama:llama3_8b"), [2, 4, 8])] == []


def _hf_cases():
    for path in sorted((ROOT / "plans" / "hf").glob("*.yaml")):
        family = re.sub(r"_(tp|ep)(_sp)?$", "", path.stem)
        yield str(path.relative_to(ROOT)), f"tpplan.models.hf:{family}"
        if family == "llama":
            yield str(path.relative_to(ROOT)), "tpplan.models.hf:llama_tied"


@pytest.mark.parametrize("plan, model", list(_hf_cases()))
def test_shipped_transformers_plans_have_no_errors(plan, model):
    pytest.importorskip("transformers")
    loaded = load_plan(ROOT / plan)
    problems = check_model(loaded, meta_model(model), loaded.mesh_sizes)
    assert [str(p) for p in problems if p.severity == "error"] == []
