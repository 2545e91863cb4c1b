"""A style's contract (core/contract.py) is the one truth of what it does: the compiled
torch style, the lint's verdicts and the table's derived facts all follow it."""

from __future__ import annotations

import dataclasses

import pytest
from lint_helpers import lint
from torch.distributed.tensor import Replicate, Shard

from tpplan.core.contract import Option, Port
from tpplan.core.placements import PlacementSpec
from tpplan.core.schema import rule_spec
from tpplan.core.style_table import STYLE_SPECS, ColwiseSpec
from tpplan.sharding.compile import compile_style

MLP_PLAN = """
version: 1
name: mlp
mesh: {axis: tp, sizes: [2]}
rules:
  blocks.*.in_proj: colwise
  blocks.*.out_proj: rowwise
"""
_R, _LAST = PlacementSpec("replicate"), PlacementSpec("shard", -1)


def _errors(problems):
    return sorted({p.code for p in problems if p.severity == "error"})


def test_a_changed_contract_changes_the_compiled_style_and_the_lints_verdict(monkeypatch):
    """colwise whose contract hands its output on replicated, not as a feature shard: the
    compiled ColwiseParallel gathers its output, and the lint now finds the rowwise after it
    fed a whole tensor where it declares a shard."""
    assert compile_style(rule_spec("colwise")).output_layouts == (Shard(-1),)
    assert _errors(lint(MLP_PLAN, "tpplan.models.mlp:tiny")) == []

    table = ColwiseSpec.semantics
    axis = table.contract.tp
    gathered = dataclasses.replace(axis, outputs=(Port(src=_LAST, dst=Option("output_layouts", _R)),))
    monkeypatch.setattr(ColwiseSpec, "semantics", dataclasses.replace(
        table, contract=dataclasses.replace(table.contract, axes={"tp": gathered})))

    assert compile_style(rule_spec("colwise")).output_layouts == (Replicate(),)
    assert not ColwiseSpec.semantics.feature_sharded_output  # a derived fact follows too
    assert _errors(lint(MLP_PLAN, "tpplan.models.mlp:tiny")) == ["TP320"]  # a replicated input where a shard is declared


def test_a_rule_fills_its_contract_from_its_options():
    colwise = rule_spec({"style": "colwise", "input_layouts": "shard(1)"}).contract()
    assert (colwise.inputs[0].src, colwise.inputs[0].dst, colwise.inputs[0].grad) == (PlacementSpec("shard", 1), _R, "sum")
    assert colwise.outputs[0].dst == _LAST  # torch's default, the option left out
    sp = rule_spec({"style": "sequence_parallel", "sequence_dim": 0}).contract()
    assert sp.inputs[0].src == sp.outputs[0].dst == PlacementSpec("shard", 0)
    a2a = rule_spec({"style": "expert_parallel", "dispatch": "all_to_all"}).contract()
    assert a2a.inputs[0].src == a2a.outputs[0].dst == PlacementSpec("shard", 0)
    assert a2a.inputs[0].grad == "reverse"  # tokens travel back: nothing summed
    all_reduce = rule_spec("expert_parallel").contract()
    assert all_reduce.inputs[0].grad == "sum"  # tokens whole on every rank: each rank's share of the gradient summed
    assert all_reduce.outputs[0] == Port(src=PlacementSpec("partial"), dst=_R)


def test_prepare_module_input_has_one_port_per_argument_and_keyword():
    spec = rule_spec({
        "style": "prepare_module_input",
        "input_layouts": ["shard(1)", None], "desired_input_layouts": ["replicate", None],
        "input_kwarg_layouts": {"mask": "replicate"}, "desired_input_kwarg_layouts": {"mask": "shard(0)"},
    })
    assert spec.contract().inputs == (
        Port(PlacementSpec("shard", 1), _R), Port(None, None),
        Port(_R, PlacementSpec("shard", 0), keyword="mask"),
    )


@pytest.mark.parametrize("name", sorted(n for n, c in STYLE_SPECS.items() if c.semantics.contract.tp.body == "sharded"))
def test_the_compiled_style_lays_out_what_the_contract_says(name):
    """A rule that leaves its layouts out gets the contract's (torch's defaults, stated once)."""
    spec = STYLE_SPECS[name].model_construct(style=name)
    contract, style = spec.contract(), compile_style(spec)
    first_in, first_out = contract.inputs[0], contract.outputs[0]
    expected = {
        "input_layouts": first_in.src, "input_layout": first_in.src, "sequence_sharding": first_in.src,
        "desired_input_layout": first_in.dst, "output_layouts": first_out.dst, "output_layout": first_out.dst,
    }
    found = {attr: getattr(style, attr) for attr in expected if hasattr(style, attr)}
    assert found, name
    for attr, value in found.items():
        assert (value if isinstance(value, tuple) else (value,)) == (expected[attr].to_torch(),), (name, attr)


def test_like_may_name_the_styles_whose_contract_lays_out_by_options_alone():
    """`like:` (the loader's and the JSON Schema's list alike) is read from the contracts: a
    style that lays out an input or output and places no parameter by the module."""
    from tpplan.core.contract import tp
    from tpplan.core.expert_styles import SumOutputGradSpec
    from tpplan.core.external_styles import like_names
    from tpplan.core.json_schema import LIKE_NAMES as SCHEMA_LIKES
    from tpplan.core.schema import LIKE_NAMES

    assert LIKE_NAMES == SCHEMA_LIKES == like_names(STYLE_SPECS) == (
        "colwise", "rowwise", "sequence_parallel", "prepare_module_input", "prepare_module_output",
        "prepare_module_input_output", "no_parallel",
    )

    class LaidOut(SumOutputGradSpec):  # sum_output_grad whose contract also hands its output on replicated
        semantics = dataclasses.replace(SumOutputGradSpec.semantics, contract=tp(outputs=(Port(dst=_R, grad="sum"),)))

    assert like_names({"sum_output_grad": SumOutputGradSpec, "laid_out": LaidOut}) == ("laid_out",)


def test_the_cross_field_rules_allow_the_layouts_the_contract_gives():
    """colwise with heads hands its output on as the module leaves it, and expert_parallel's
    all_to_all takes its tokens as its ports say: the loader refuses any other option value."""
    from tpplan.core.schema import rule_spec

    colwise = rule_spec({"style": "colwise", "heads": 2})
    assert colwise.cross_field_problems() == []
    assert rule_spec({"style": "colwise", "heads": 2, "output_layouts": "replicate"}).cross_field_problems()
    a2a = rule_spec({"style": "expert_parallel", "dispatch": "all_to_all", "input_layouts": "shard(0)"})
    assert a2a.cross_field_problems() == [] and a2a.contract().inputs[0].src == PlacementSpec("shard", 0)
    bad = rule_spec({"style": "expert_parallel", "dispatch": "all_to_all", "output_layouts": "replicate"})
    assert [path for path, _ in bad.cross_field_problems()] == [("output_layouts",)]
