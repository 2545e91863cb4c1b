"""Bad input to a style is the plan's or the model's error: every style raises a
StyleInputError (what is wrong, and the fix), reported at the rule that names the
style with exit 1, through `apply --dry-run` and `validate --model`; an exception
that tpplan's own code raises otherwise is still a bug (exit 3)."""

from __future__ import annotations

import json
import pickle

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app
from tpplan.core.problems import StyleInputError
from tpplan.core.problems import raised_by_tpplan

MLP = "tpplan.models.mlp:tiny"
OWN = "style_error_models"  # tests/style_error_models.py

# (model, the bad rule (line 3 of the plan), other rules, tp, code of apply --dry-run, the fix it gives)
CASES = [
    (f"{OWN}:moe_3_experts", "experts: expert_parallel", [], 2, "TP501",
     "3 experts of Experts do not divide over TP degree 2; degrees that work: 1, 3, or expert_tp"),
    (f"{OWN}:moe", "experts: {style: expert_tp, params: {nope: shard(0)}}", [], 2, "TP501",
     "params names no parameter of Experts: 'nope'; name its own parameters: gate_up_proj, down_proj"),
    (MLP, "blocks.0.in_proj: expert_tp", [], 2, "TP501", "; put the rule on the experts module itself (transformers: mlp.experts)"),
    (f"{OWN}:moe_unrouted", "experts: expert_parallel", [], 2, "TP502",
     "it is called as experts(hidden_states, top_k_index, top_k_weights), not with 1 positional input(s); put the rule on"),
    (f"{OWN}:moe_tuple_experts", "experts: expert_parallel", [], 2, "TP502",
     "needs its forward to return one tensor, the experts' output; it returned tuple; put the rule on"),
    (f"{OWN}:moe_tuple_experts", "experts: expert_tp", [], 2, "TP502", "expert_tp on Experts needs its forward to return one tensor"),
    (MLP, "blocks.0.act: {style: colwise, heads: 2}", [], 2, "TP501", "GELU is not one; put the rule on the attention's q/k/v projections"),
    (MLP, "blocks.0.in_proj: {style: colwise, heads: 3}", ["blocks.0.out_proj: rowwise"], 2, "TP501",
     "the 128 output features of Linear are not 3 whole heads; give the projection's head count"),
    (MLP, "blocks.0.in_proj: {style: colwise, heads: auto}", ["blocks.0.out_proj: rowwise"], 2, "TP501",
     "or the hidden size over the query heads); MLPBlock has none; give the head count (heads: N)"),
    (f"{OWN}:attention_6_heads", "k_proj: {style: colwise, heads: 2}", [], 4, "TP501",
     "6 query heads of Attention do not divide over TP degree 4; use a TP degree that divides 6"),
    (f"{OWN}:attention_without_head_count", "k_proj: {style: colwise, heads: 2}", [], 4, "TP501",
     "gives a query-head count (n_heads, num_heads, num_attention_heads, n_head); use a TP degree that divides the 2 KV heads"),
    (f"{OWN}:attention_kwargs_call", "k_proj: {style: colwise, heads: 2}", [], 4, "TP502",
     "needs a tensor as its first positional input, got none; put the rule on a projection"),
    (f"{OWN}:kwargs_norm", "norm: no_parallel", [], 2, "TP502", "got no positional input; put the rule on a module called with a tensor first"),
    (MLP, "blocks.0.in_proj: {style: sum_output_grad, last: 1000}", [], 2, "TP502",
     "last: 1000 is more than the 128 features of Linear's output; give last: N with N at most 128"),
    (MLP, "blocks.0.act: {style: local_params, params: {w: replicate}}", [], 2, "TP501",
     "GELU has no parameter 'w' (its own parameters: none); name the module's own parameters in params"),
    (MLP, "blocks.0.in_proj: {style: local_params, params: {weight: 'packed_shard(0, 3)'}}", [], 2, "TP501",
     "dim 0 of size 128 does not split into 3 blocks of 2 shards; the dim must hold 3 equal blocks"),
]
IDS = [f"{model.partition(':')[2]}-{rule.partition(':')[2].strip()[:40]}" for model, rule, *_ in CASES]


def _plan(tmp_path, rule: str, others: list[str]) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n" + "".join(f"  {r}\n" for r in (rule, *others)))
    return str(path)


def _run(*args: str):
    result = CliRunner().invoke(app, [*args, "--format", "json"], env={"TPPLAN_DEBUG": None})
    return result.exit_code, result.output


@pytest.mark.parametrize("model, rule, others, tp, code, fix", CASES, ids=IDS)
def test_bad_style_input_is_located_at_its_rule_by_the_dry_run_with_exit_1(tmp_path, model, rule, others, tp, code, fix):
    plan = _plan(tmp_path, rule, others)
    exit_code, output = _run("apply", "--plan", plan, "--model", model, "--tp", str(tp), "--dry-run")
    assert exit_code == 1, output
    (problem,) = json.loads(output)["problems"]
    assert (problem["code"], problem["file"], problem["line"], problem["column"]) == (code, plan, 3, 3)
    assert fix in problem["message"]


@pytest.mark.parametrize("model, rule, others, tp, code, fix", CASES, ids=IDS)
def test_bad_style_input_is_located_at_its_rule_by_validate_model_with_exit_1(tmp_path, model, rule, others, tp, code, fix):
    plan = _plan(tmp_path, rule, others)
    exit_code, output = _run("validate", plan, "--model", model, "--tp", str(tp))
    assert exit_code == 1, output
    at_rule = [p for p in json.loads(output)["problems"] if p["severity"] == "error" and (p["line"], p["column"]) == (3, 3)]
    assert at_rule, output
    # The lint finds some statically (TP3xx); the rest its dry run finds, with the style's fix.
    assert all(p["code"] != "TP330" or fix in p["message"] for p in at_rule)


@pytest.mark.parametrize("command", ["apply", "validate"])
def test_a_genuine_tpplan_bug_in_a_style_still_exits_3(tmp_path, monkeypatch, command):
    # A TypeError raised from C inside the all_reduce dispatch: tpplan's frame is innermost.
    monkeypatch.setattr("tpplan.sharding.expert_parallel.route_local", {}.__getitem__)
    plan = _plan(tmp_path, "experts: expert_parallel", [])
    args = ["--plan", plan, "--dry-run"] if command == "apply" else [plan]
    result = CliRunner().invoke(app, [command, *args, "--model", f"{OWN}:moe", "--tp", "2"], env={"TPPLAN_DEBUG": None})
    assert result.exit_code == 3, result.output
    assert result.output.startswith("tpplan: internal error (a bug in tpplan, not in your plan): TypeError: ")


def _raised(source: str, module_globals: dict) -> BaseException:
    try:
        exec(compile(source, "<module>", "exec"), module_globals)
    except Exception as exc:  # the exception under test
        return exc
    raise AssertionError("nothing raised")


def test_a_bug_is_told_by_the_errors_type_and_the_module_that_raised_it():
    raise_key_error = "raise KeyError('x')"
    assert raised_by_tpplan(_raised(raise_key_error, {"__name__": "tpplan.sharding.experts", "__package__": "tpplan.sharding"}))
    assert not raised_by_tpplan(_raised(raise_key_error, {"__name__": "user_model", "__package__": ""}))
    assert not raised_by_tpplan(_raised(raise_key_error, {"__name__": "tpplanner.x", "__package__": "tpplanner"}))
    # a reference model shipped in tpplan (tpplan.models, by where it lives) is a model like the user's
    assert not raised_by_tpplan(_raised(raise_key_error, {"__name__": "tpplan.models.x", "__package__": "tpplan.models"}))
    assert raised_by_tpplan(_raised(raise_key_error, {"__name__": "tpplan.models_x", "__package__": "tpplan"}))
    # a typed error raised in tpplan's code is the plan's or the model's
    typed = "from tpplan.core.problems import StyleInputError\nraise StyleInputError('bad', 'fix it')"
    assert not raised_by_tpplan(_raised(typed, {"__name__": "tpplan.sharding.experts", "__package__": "tpplan.sharding"}))


def test_a_torch_op_failing_on_a_line_of_a_shipped_models_forward_is_the_models_error():
    import torch
    from torch import nn

    from tpplan.models.rule_examples import GlobalHeadsAttention

    attention = GlobalHeadsAttention(dim=32, n_heads=4)
    attention.wq = nn.Linear(32, 16, bias=False)  # a TP-2 shard: 2 heads' width, viewed by the global 4 heads
    with pytest.raises(RuntimeError, match="shape") as info:
        attention(torch.randn(1, 3, 32))
    assert info.traceback[-1].path.name == "rule_examples.py"  # the model's own line: its `view`
    assert not raised_by_tpplan(info.value)


def test_a_style_input_error_carries_what_is_wrong_and_the_fix_through_pickling():
    error = pickle.loads(pickle.dumps(StyleInputError("3 experts do not divide over TP degree 2", "degrees that work: 1, 3")))
    assert (error.what, error.fix) == ("3 experts do not divide over TP degree 2", "degrees that work: 1, 3")
    assert str(error) == "3 experts do not divide over TP degree 2; degrees that work: 1, 3"
    assert isinstance(error, ValueError)
