"""Fuzzing `validate --model`: mutated versions of the shipped plans (styles
swapped, options and layouts changed, rules dropped or added, other degrees)
always come back as located problems with documented codes, never as a
traceback."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lint_helpers import meta_model

from tpplan import PlanError, load_plan
from tpplan.lint.checks import check_model
from tpplan.lint.codes import catalog
from tpplan.core.schema import STYLE_NAMES

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("plans/llama_tp.yaml", "tpplan.models.llama:tiny"),
    ("plans/llama_tp_sp.yaml", "tpplan.models.llama:tiny"),
    ("plans/mlp_tp.yaml", "tpplan.models.mlp:tiny"),
]
CODES = {entry.code for entry in catalog()}

placements = st.sampled_from(["replicate", "shard(0)", "shard(1)", "shard(-1)", "shard(2)", "shard(5)", "partial"])
layout_lists = st.one_of(placements, st.lists(st.one_of(st.none(), placements), min_size=1, max_size=3))
options = {
    "input_layouts": layout_lists,
    "output_layouts": layout_lists,
    "desired_input_layouts": layout_lists,
    "desired_output_layouts": layout_lists,
    "use_local_output": st.booleans(),
    "sequence_dim": st.integers(-1, 3),
    "input_layout": placements,
    "output_layout": placements,
    "input_kwarg_layouts": st.dictionaries(st.sampled_from(["x", "rope", "mask"]), placements, max_size=2),
}


@st.composite
def rule_values(draw):
    style = draw(st.sampled_from(STYLE_NAMES))
    if draw(st.booleans()):
        return style
    chosen = draw(st.lists(st.sampled_from(sorted(options)), max_size=3, unique=True))
    return {"style": style, **{key: draw(options[key]) for key in chosen}}


def module_globs(model) -> list[str]:
    names = sorted({".".join("*" if part.isdigit() else part for part in name.split(".")) for name, _ in model.named_modules() if name})
    return names + ["**", "layers.*.attention.w{q,k}", "blocks.1.*"]


@st.composite
def mutated(draw):
    path, ref = draw(st.sampled_from(CASES))
    data = yaml.safe_load((ROOT / path).read_text())
    rules = data["rules"]
    keys = list(rules)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["restyle", "tweak", "drop", "add"]))
        if action == "drop" and keys:
            rules.pop(keys.pop(draw(st.integers(0, len(keys) - 1))), None)
        elif action == "add":
            key = draw(st.sampled_from(module_globs(meta_model(ref))))
            rules[key] = draw(rule_values())
            if key not in keys:  # re-adding a present key must not list it twice
                keys.append(key)
        elif keys:
            key = keys[draw(st.integers(0, len(keys) - 1))]
            if action == "restyle" or not isinstance(rules[key], dict):
                rules[key] = draw(rule_values())
            else:
                option = draw(st.sampled_from(sorted(options)))
                rules[key] = {**rules[key], option: draw(options[option])}
    tp = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3, unique=True))
    return yaml.safe_dump(data, sort_keys=False), ref, tp


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_validate_model_on_mutated_plans_returns_located_problems_never_a_traceback(case):
    text, ref, tp = case
    try:
        plan = load_plan(text=text, file="fuzz.yaml")
    except PlanError as exc:
        problems = exc.problems
    else:
        problems = check_model(plan, meta_model(ref), tp)
    for problem in problems:
        assert problem.code in CODES, str(problem)
        assert problem.severity in ("error", "warning")
        assert problem.line >= 1 and problem.column >= 1 and problem.message
