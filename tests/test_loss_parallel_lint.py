"""TP370: `loss_parallel: true` needs a head rule that returns vocabulary-sharded DTensor logits."""

from __future__ import annotations

import pytest
from lint_helpers import found, lint, only

LLAMA = "tpplan.models.llama:tiny"
BODY = """
    layers.*.attention.w{q,k,v}: colwise
    layers.*.attention.wo: rowwise
    layers.*.feed_forward.w{1,3}: colwise
    layers.*.feed_forward.w2: rowwise
"""


def plan(head: str | None, loss_parallel: bool = True) -> str:
    rules = BODY + (f"    output: {head}\n" if head else "")
    return f"version: 1\nloss_parallel: {str(loss_parallel).lower()}\nrules:{rules}"


def test_a_head_that_gathers_its_logits_contradicts_loss_parallel_at_its_rule():
    problems = lint(plan("{style: colwise, output_layouts: replicate, use_local_output: false}"), LLAMA, select=["TP370"])
    problem = only(problems, "TP370")
    assert (problem.line, problem.column) == (8, 5)
    assert "output_layouts: replicate" in problem.message and "set loss_parallel: false" in problem.message


def test_a_head_that_returns_a_local_shard_contradicts_loss_parallel():
    problem = only(lint(plan("colwise"), LLAMA, select=["TP370"]), "TP370")
    assert "use_local_output: true, colwise's default" in problem.message


def test_a_head_without_a_rule_is_reported_at_the_rules_key():
    problems = lint(plan(None), LLAMA, select=["TP370"])
    assert found(problems, "TP370") == [(3, 1)]
    assert "no rule shards the head 'output'" in problems[0].message


@pytest.mark.parametrize("head", ["{style: colwise, use_local_output: false}", "{style: colwise, output_layouts: shard(-1), use_local_output: false}"])
def test_a_vocabulary_sharded_dtensor_head_is_not_reported(head):
    assert found(lint(plan(head), LLAMA, select=["TP370"]), "TP370") == []


def test_without_loss_parallel_the_head_may_gather():
    assert found(lint(plan("{style: colwise, output_layouts: replicate}", loss_parallel=False), LLAMA, select=["TP370"]), "TP370") == []
