"""The style table is the one source of what a style does: the compiled styles and the
lint follow each entry's contract (an entry changed here changes both), the parameter
placements it states are what the compiled styles do, and the shapes and bytes each rank
holds are told alike by checkpoint inspection, the dry run's report and its text."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from tpplan.core.placements import PlacementSpec
from tpplan.core.schema import STYLE_NAMES, STYLE_SPECS

_R, _S0 = PlacementSpec("replicate"), PlacementSpec("shard", 0)


def _conv1d_plan() -> str:
    return "version: 1\nrules:\n  blocks.*.c_fc: colwise\n  blocks.*.c_proj: rowwise\n"


def test_a_changed_parameter_placement_changes_the_compiled_style_and_the_lints_placements(monkeypatch):
    """rowwise whose contract places a Conv1D's weight replicated rather than on its input
    features: the compiled style places it so, and the lint (which reads the same entry)
    sees it so, as it sees every other placement the entry states."""
    from lint_helpers import meta_model

    from tpplan import load_plan
    from tpplan.core.style_table import RowwiseSpec
    from conv1d_model import Conv1DModel

    from tpplan.lint.facts import parameter_placements
    from tpplan.simulation.simulate import simulated_world, tp_mesh

    def compiled_and_linted() -> tuple[dict, dict]:
        plan, model, meta = load_plan(text=_conv1d_plan()), Conv1DModel(), meta_model("conv1d_model:Conv1DModel")
        linted = {n: p.placement for n, p in parameter_placements(dict(meta.named_modules()), plan.match(meta)).items()
                  if n.startswith("blocks.0.c_proj")}
        with simulated_world(2):
            plan.apply(model, tp_mesh(2))
        compiled = {n: PlacementSpec("shard", p.placements[0].dim) if p.placements[0].is_shard() else _R
                    for n, p in model.named_parameters() if n.startswith("blocks.0.c_proj")}
        return compiled, linted

    assert compiled_and_linted() == ({"blocks.0.c_proj.weight": _S0, "blocks.0.c_proj.bias": _R},) * 2
    table = RowwiseSpec.semantics
    axis = table.contract.tp
    state = {**axis.state, "Conv1D": {"weight": _R, "bias": _R, "*": _R}}
    monkeypatch.setattr(RowwiseSpec, "semantics", dataclasses.replace(
        table, contract=dataclasses.replace(table.contract, axes={"tp": dataclasses.replace(axis, state=state)})))
    assert compiled_and_linted() == ({"blocks.0.c_proj.weight": _R, "blocks.0.c_proj.bias": _R},) * 2


# -- parameter placements from the table ---------------------------------------------------


def _experts(transposed: bool = False, bias: bool = True, experts: int = 4) -> torch.nn.Module:
    module = torch.nn.Module()
    e, h, i = experts, 6, 8
    module.gate_up_proj = torch.nn.Parameter(torch.randn(e, h, 2 * i) if transposed else torch.randn(e, 2 * i, h))
    module.down_proj = torch.nn.Parameter(torch.randn(e, i, h) if transposed else torch.randn(e, h, i))
    if bias:
        module.gate_up_proj_bias = torch.nn.Parameter(torch.randn(e, 2 * i))
        module.down_proj_bias = torch.nn.Parameter(torch.randn(e, h))
    return module


def _stacked_linears() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_experts, module.output_size, module.input_size = 2, 7, 5
    module.weight = torch.nn.Parameter(torch.randn(2, 7, 5))
    return module


def _conv1d() -> torch.nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(7, 5)  # weight [5, 7]


# (rule, module, TP degree): sizes the degree does not divide where the style allows an
# uneven shard (torch's chunks); a packed shard (expert_tp's gate/up) must split evenly.
_PLACED = [
    *((rule, make, 3) for rule in ("colwise", "rowwise")
      for make in (lambda: torch.nn.Linear(5, 7), lambda: torch.nn.Embedding(7, 5), _conv1d, _stacked_linears)),
    ("sequence_parallel", lambda: torch.nn.LayerNorm(5), 3),
    ("no_parallel", lambda: torch.nn.Linear(5, 7), 3),
    *(({"style": "expert_tp", **more}, lambda t=transposed: _experts(t), 2)
      for more in ({}, {"params": {"down_proj_bias": "shard(1)"}}) for transposed in (False, True)),
    ({"style": "expert_parallel"}, lambda: _experts(experts=3), 3),
    ({"style": "local_params", "params": {"down_proj": "shard(0)"}}, lambda: _experts(experts=5), 3),
]


@pytest.mark.parametrize("rule, make, tp", _PLACED)
def test_the_compiled_style_places_parameters_as_the_contract_says_and_the_shard_math_sees_it(rule, make, tp):
    """Each rank holds what `own_placements` (the rule's contract, or its per-module
    placements) says: the DTensors the compiled style makes, and so the per-rank shapes
    and bytes that checkpoint inspection and the dry run's parameter table report."""
    from tpplan.checkpoint.inspect import expected_tensors
    from tpplan.core.local_shapes import shapes_on_mesh
    from tpplan.core.schema import rule_spec
    from tpplan.simulation.layouts import param_layouts
    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.sharding.compile import compile_for
    from tpplan.sharding.styles import module_kind

    spec, module = rule_spec(rule), make()
    expected = spec.own_placements(module, module_kind(module))
    shapes = {name: shapes_on_mesh(tuple(p.shape), (tp,), [expected[name].to_torch()]) for name, p in module.named_parameters()}
    with simulated_world(tp):
        compile_for(spec, module)._apply(module, tp_mesh(tp, "tp"))
    assert {name: p.placements for name, p in module.named_parameters()} == {
        name: (placement.to_torch(),) for name, placement in expected.items()
    }
    assert any(placement.kind != "replicate" for placement in expected.values()) or spec.semantics.contract.tp.subtree
    assert {e.names[0]: tuple(e.local_shapes) for e in expected_tensors(module)} == shapes
    assert {p.name: p.local_shapes for p in param_layouts(module, tp)} == shapes


def test_expert_tp_places_a_transposed_packed_gate_up_on_its_last_dim():
    from tpplan.core.schema import rule_spec

    placed = rule_spec("expert_tp").param_placements(_experts(transposed=True))
    assert placed == {
        "gate_up_proj": PlacementSpec("shard", 2, blocks=2),
        "down_proj": PlacementSpec("shard", 1),
        "gate_up_proj_bias": PlacementSpec("shard", 1, blocks=2),
        "down_proj_bias": PlacementSpec("replicate"),
    }


def test_expert_styles_refuse_a_module_without_the_expert_dim_first():
    from tpplan.core.problems import StyleInputError
    from tpplan.core.schema import rule_spec

    for style in ("expert_tp", "expert_parallel"):
        with pytest.raises(StyleInputError, match=rf"{style} needs a module whose own parameters all have the expert dim first .*Linear has: weight \[2, 2\], bias \[2\]"):
            rule_spec(style).param_placements(torch.nn.Linear(2, 2))
    with pytest.raises(StyleInputError, match="params names no parameter of .*: 'up_proj'"):
        rule_spec({"style": "expert_tp", "params": {"up_proj": "shard(1)"}}).param_placements(_experts())


def test_only_colwise_with_heads_needs_its_parent():
    from tpplan.core.schema import rule_spec

    assert rule_spec({"style": "colwise", "heads": 2}).needs_parent()
    assert [name for name in STYLE_NAMES if STYLE_SPECS[name].model_construct(style=name).needs_parent()] == []


# -- local shapes: torch's cut ----------------------------------------------------------------


def _held(dtensor) -> tuple[tuple[int, ...], ...]:
    """Each rank's local shape, as the DTensor holds it under LocalTensorMode."""
    locals_ = dtensor._local_tensor._local_tensors
    return tuple(tuple(locals_[rank].shape) for rank in sorted(locals_))


@pytest.mark.parametrize("shape, placement, world", [
    ((6, 3), "shard(0)", 4),  # uneven: the last rank holds nothing
    ((10, 4), "shard(0)", 3),  # uneven: 4, 4, 2
    ((5, 7), "shard(-1)", 2),
    ((16, 4), "packed_shard(0, 2)", 4),  # torch's _StridedShard
    ((4, 24), "packed_shard(1, 3)", 4),
    ((4, 5), "replicate", 2),
])
def test_local_shapes_are_what_each_rank_of_a_real_dtensor_holds(shape, placement, world):
    from torch.distributed._local_tensor import LocalTensorMode

    from tpplan.core.local_shapes import local_shapes
    from tpplan.core.placements import parse_placement
    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.sharding.experts import distribute_param

    with simulated_world(world), LocalTensorMode(world):
        dtensor = distribute_param(torch.randn(shape), tp_mesh(world, "tp"), parse_placement(placement).to_torch(), 0)
        assert local_shapes(dtensor) == _held(dtensor)
    assert local_shapes(torch.randn(shape)) == (shape,)


def test_local_shapes_of_a_2d_mesh_list_its_ranks_in_order():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tpplan.core.local_shapes import local_shapes
    from tpplan.simulation.simulate import simulated_world

    with simulated_world(4), LocalTensorMode(4):
        dtensor = distribute_tensor(torch.randn(5, 3), init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
        assert local_shapes(dtensor) == _held(dtensor) == ((3, 2), (3, 1), (2, 2), (2, 1))


def test_a_plain_tensor_is_whole_on_every_rank_and_the_lint_chunks_as_torch():
    from tpplan.lint import text
    from tpplan.simulation import layouts

    assert layouts.local_shapes(torch.randn(3, 2), 4) == ((3, 2),) * 4
    assert (text.chunk_sizes(10, 4), text.chunk_sizes(6, 4)) == ([3, 3, 3, 1], [2, 2, 2, 0])


def test_an_uneven_shard_is_told_alike_by_the_contract_checkpoint_inspection_the_report_and_its_text(tmp_path):
    """130 hidden features at TP 3 are 44 + 44 + 42: the rule's contract placements cut as
    torch cuts, what checkpoint inspection expects each rank to hold of the sharded model,
    the dry run's JSON report and its text table all say so."""
    from uneven_load_worker import PLAN, odd

    from tpplan import load_plan
    from tpplan.checkpoint.inspect import expected_tensors
    from tpplan.cli.app import app
    from tpplan.core.local_shapes import shapes_on_mesh
    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.sharding.styles import module_kind

    plan, model = load_plan(text=PLAN), odd()
    contract = {}
    for fqn, rule in plan.match(model).items():
        module = model.get_submodule(fqn)
        for key, placement in rule.spec.own_placements(module, module_kind(module)).items():
            contract[f"{fqn}.{key}"] = shapes_on_mesh(tuple(getattr(module, key).shape), (3,), [placement.to_torch()])
    assert contract["blocks.0.in_proj.weight"] == ((44, 30), (44, 30), (42, 30))

    with simulated_world(3):
        plan.apply(model, tp_mesh(3))
    inspected = {e.names[0]: tuple(e.local_shapes) for e in expected_tensors(model)}

    path = tmp_path / "plan.yaml"
    path.write_text(PLAN)
    args = ["apply", "--dry-run", "--tp", "3", "--model", "uneven_load_worker:odd", "--plan", str(path)]
    report = json.loads(CliRunner().invoke(app, [*args, "--format", "json"]).stdout)
    text = CliRunner().invoke(app, args).stdout
    reported = {name: tuple(map(tuple, p["local_shapes"])) for name, p in report["parameters"].items()}
    assert inspected == reported and {n: s for n, s in reported.items() if n in contract} == contract
    row = re.search(r"blocks\.\*\.in_proj\.weight .*", text).group(0)
    assert "(44, 30) | (44, 30) | (42, 30) (uneven)" in row
