"""colwise and rowwise on the module kinds torch's styles do not shard: transformers'
Conv1D (GPT-2's Linear, weight stored [in, out]) and stacked expert Linears (JetMoE's,
weight [E, out, in]). The style table's placements are what the compiled styles do, a
column -> row pair of Conv1Ds computes what one device does, and init pairs them
(JetMoE's pairs: tests/test_init.py, slow)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from tpplan.cli.app import app  # noqa: E402
from tpplan.core.placements import PlacementSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")
MODEL = "conv1d_model:build"
PAIR = "version: 1\nrules:\n  blocks.*.c_fc: colwise\n  blocks.*.c_proj: rowwise\n"


def _conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(8, 4)  # nf 8 outputs, nx 4 inputs: weight [4, 8]


def _stacked():
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts

    return JetMoeParallelExperts(4, 6, 8)  # 4 experts, 6 inputs, 8 outputs: weight [4, 8, 6]


@pytest.mark.parametrize("style, make, kind, expected", [
    ("colwise", _conv1d, "Conv1D", {"weight": PlacementSpec("shard", 1), "bias": PlacementSpec("shard", 0)}),
    ("rowwise", _conv1d, "Conv1D", {"weight": PlacementSpec("shard", 0), "bias": PlacementSpec("replicate")}),
    ("colwise", _stacked, "StackedLinears", {"weight": PlacementSpec("shard", 1)}),
    ("rowwise", _stacked, "StackedLinears", {"weight": PlacementSpec("shard", 2)}),
])
def test_the_tables_placements_of_each_kind_are_what_the_compiled_style_does(style, make, kind, expected):
    from tpplan.core.schema import rule_spec
    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.sharding.compile import compile_for
    from tpplan.sharding.styles import module_kind

    spec, module = rule_spec(style), make()
    assert module_kind(module) == kind
    assert {name: spec.semantics.contract.tp.placement(kind, name) for name in expected} == expected
    with simulated_world(2):
        compile_for(spec, module)._apply(module, tp_mesh(2, "tp"))
    assert {name: p.placements for name, p in module.named_parameters()} == {
        name: (placement.to_torch(),) for name, placement in expected.items()}


def test_a_conv1d_column_row_pair_computes_what_one_device_does(tmp_path):
    plan = tmp_path / "conv1d.yaml"
    plan.write_text(PAIR)
    runner = CliRunner()
    assert runner.invoke(app, ["validate", str(plan), "--model", MODEL, "--tp", "2"]).exit_code == 0
    result = runner.invoke(app, ["apply", "--dry-run", "--check", "--tp", "2", "--plan", str(plan), "--model", MODEL,
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["check"]["passed"], report["check"]
    # 2 blocks: c_fc [32, 64] + [64] and c_proj [64, 32] halved, c_proj's bias [32] whole; the rest whole
    whole = 4 * (64 * 32 + 2 * (2 * 32 + 32 * 64 + 64 + 64 * 32 + 32) + 32 * 64)
    halved = 4 * 2 * (32 * 64 + 64 + 64 * 32) // 2
    assert (report["params"]["total_bytes"], report["params"]["per_rank_bytes"]) == (whole, whole - halved)
    assert report["comms"]["forward"] == {"all_reduce": 2}  # one per block: c_proj's partial output
    assert report["comms"]["backward"] == {"all_reduce": 2}  # c_fc's replicated input's gradient


def test_init_pairs_conv1d_projections_and_finds_the_embedding_of_the_viewed_input():
    from conv1d_model import build

    from tpplan import infer_plan

    import yaml

    plan = infer_plan(build, tp=[2])
    rules = yaml.safe_load(plan.text)["rules"]
    assert rules["blocks.*.c_fc"] == "colwise" and rules["blocks.*.c_proj"] == "rowwise"
    assert "# c_fc -> c_proj: 64 features, column then row parallel" in plan.text
    assert rules["embed"] == {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "replicate"}
