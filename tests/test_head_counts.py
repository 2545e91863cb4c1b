"""One reader of head counts (tpplan.core.head_counts): the lint (TP311 and the edit
init applies for it) and `{style: colwise, heads: auto}` read the same counts, so the
lint approves a plan exactly where the style can apply it, whatever the model calls
its counts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app
from tpplan.core.head_counts import head_counts, head_dim_of

MODEL = "head_count_models:model"  # tests/head_count_models.py: num_heads 4, num_kv_heads 2, head_size 4
WITH_HEADS = ["attn.q_proj: colwise", "attn.{k_proj,v_proj}: {style: colwise, heads: auto}", "attn.o_proj: rowwise"]
WITHOUT_HEADS = ["attn.{q_proj,k_proj,v_proj}: colwise", "attn.o_proj: rowwise"]


def _plan(tmp_path, rules: list[str]) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n" + "".join(f"  {rule}\n" for rule in rules))
    return str(path)


def _run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, [*args, "--format", "json"], env={"TPPLAN_DEBUG": None})
    return result.exit_code, json.loads(result.output)


def test_every_spelling_of_a_count_is_read_from_the_module_or_its_config():
    attention = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=8)
    found = head_counts(attention)
    assert (found.query, found.kv, found.head_dim) == (4, 2, 8)
    # transformers: counts on the config, the head size on the attention itself
    hf = SimpleNamespace(head_dim=16, config=SimpleNamespace(num_attention_heads=8, multi_query_group_num=2, hidden_size=64))
    found = head_counts(hf)
    assert (found.query, found.kv, found.head_dim) == (8, 2, 16)
    # no head size given: the hidden size over the query heads, not over the KV heads
    found = head_counts(SimpleNamespace(config=SimpleNamespace(num_kv_heads=2, n_head=4, d_model=32)))
    assert (found.query, found.kv, found.head_dim) == (4, 2, 8)
    assert head_counts(SimpleNamespace(hidden_size=32)) is None
    assert head_dim_of(SimpleNamespace(head_dim=4)) == 4  # a head size alone is enough for heads: auto


@pytest.mark.parametrize("tp, accepted", [(2, True), (4, True), (3, False)])
def test_the_lint_approves_heads_auto_exactly_where_the_style_applies_it(tmp_path, tp, accepted):
    plan = _plan(tmp_path, WITH_HEADS)
    lint_exit, linted = _run("validate", plan, "--model", MODEL, "--tp", str(tp))
    run_exit, ran = _run("apply", "--plan", plan, "--model", MODEL, "--tp", str(tp), "--dry-run")
    codes = [p["code"] for p in linted["problems"]]
    assert (lint_exit == 0, run_exit == 0) == (accepted, accepted), (linted, ran)
    assert ("TP311" in codes) == (not accepted)
    if accepted:  # TP 4: each of the 2 KV heads replicated on 2 ranks, read from num_kv_heads and head_size
        assert not ran["problems"], ran


def test_the_lint_finding_and_its_edit_agree_on_heads_auto(tmp_path):
    from tpplan.core.loader import load_plan
    from tpplan.lint.context import LintContext
    from tpplan.lint.edits import lint_edits
    from tpplan.simulation.modelref import build_model

    plan = _plan(tmp_path, WITHOUT_HEADS)
    model = build_model(MODEL, "meta")
    for tp, fixable in [(2, False), (4, True), (3, False)]:
        _, linted = _run("validate", plan, "--model", MODEL, "--tp", str(tp))
        messages = [p["message"] for p in linted["problems"] if p["code"] == "TP311"]
        suggested = any("heads: auto" in m for m in messages)
        edits = [e for e in lint_edits(LintContext(load_plan(plan), model, [tp])) if e.code == "TP311"]
        assert suggested == fixable == bool(edits), (tp, messages, edits)
        if fixable:
            assert "num_kv_heads (2)" in messages[0] and edits[0].options == {"heads": "auto"}
