"""Fused projections (one Linear whose output is q, k and v, or gate and up, side by
side): plain colwise is wrong and the lint says so at the fused rule (TP326);
colwise `packed` matches one device at TP 2 and 4 (equal blocks as packed shards,
unequal GQA blocks), loads from a checkpoint, and a failed --check blames the
fused rule, not the next one."""

from __future__ import annotations

import pytest
import torch
from lint_helpers import found, lint, only
from safetensors.torch import save_file

from tpplan import PlanError, load_plan
from tpplan.simulation.simulated_load import simulated_load
from tpplan.models import fused
from tpplan.simulation.simulate import allowed_diff, max_abs_diff, tolerance
from tpplan.check.verify import check_parity

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

PLAN = """
version: 1
rules:
  blocks.*.attn.qkv: {qkv}
  blocks.*.attn.proj: rowwise
  blocks.*.mlp.gate_up: {gate_up}
  blocks.*.mlp.down: rowwise
"""
PACKED = {"qkv": "{style: colwise, packed: 3}", "gate_up": "{style: colwise, packed: 2}"}
GQA_PACKED = {"qkv": "{style: colwise, packed: [32, 16, 16]}", "gate_up": "{style: colwise, packed: 2}"}
# per layer: proj and down all-reduce their output; qkv and gate_up their input's gradient
COMMS = {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}


def plan(**rules):
    return load_plan(text=PLAN.format(**rules).lstrip("\n"), file="plan.yaml")


@pytest.mark.parametrize(("factory", "rules", "tp"), [
    pytest.param(fused.tiny, PACKED, 2, id="equal-2"),
    pytest.param(fused.tiny, PACKED, 4, id="equal-4", marks=pytest.mark.slow),
    pytest.param(fused.tiny_gqa, GQA_PACKED, 2, id="gqa-2", marks=pytest.mark.slow),
    pytest.param(fused.tiny_gqa, GQA_PACKED, 4, id="gqa-4"),
])
def test_packed_colwise_matches_one_device(factory, rules, tp):
    result = check_parity(factory, plan(**rules), tp)
    assert result.passed, result.problems
    assert result.max_abs_diff < 1e-6
    assert result.comms == COMMS
    assert result.replicas == []


def test_equal_blocks_are_packed_shards_and_unequal_ones_replicated_with_local_rows():
    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.check.verify import _apply
    from torch.distributed._local_tensor import LocalTensorMode

    for factory, rules, placement in [(fused.tiny, PACKED, "packed_shard(0, 3)"), (fused.tiny_gqa, GQA_PACKED, "replicate")]:
        model = factory()
        with simulated_world(2), LocalTensorMode(2):
            _apply(plan(**rules), model, tp_mesh(2, "tp"))
            from tpplan.core.placements import placement_text

            qkv = model.blocks[0].attn.qkv
            assert [placement_text(p) for p in qkv.weight.placements] == [placement]
            assert [placement_text(p) for p in qkv.bias.placements] == [placement]
            assert placement_text(model.blocks[0].mlp.gate_up.weight.placements[0]) == "packed_shard(0, 2)"


def test_plain_colwise_on_a_fused_qkv_fails_check_and_blames_the_fused_rule():
    result = check_parity(fused.tiny, plan(qkv="colwise", gate_up=PACKED["gate_up"]), 2)
    assert not result.passed
    assert result.located.first.module == "blocks.0.attn.proj"  # the first output that differs ...
    assert result.located.rule.pattern == "blocks.*.attn.qkv"  # ... but attn computes wrong from right inputs
    assert result.located.relation == (
        "the rule of 'blocks.0.attn.qkv', the first planned module inside 'blocks.0.attn'; given the single-device "
        "run's own inputs, 'blocks.0.attn' still computes wrong values, 'blocks.0.attn.proj' right ones"
    )


def test_lint_reports_plain_colwise_cut_into_kinds_at_the_fused_rules():
    problems = lint(PLAN.format(qkv="colwise", gate_up="colwise"), "tpplan.models.fused:tiny", tp=(2, 4))
    assert found(problems, "TP326") == [(3, 3), (5, 3)]
    qkv, gate_up = [p.message for p in problems if p.code == "TP326"]
    assert "by 'unbind' in 'blocks.0.attn'" in qkv and "give 'blocks.*.attn.qkv' {style: colwise, packed: 3}" in qkv
    assert "by 'chunk' in 'blocks.0.mlp'" in gate_up and "{style: colwise, packed: 2}" in gate_up
    assert qkv.endswith("(and 1 more like it)")


def test_lint_suggests_the_unequal_blocks_of_a_gqa_split():
    problem = only(lint(PLAN.format(qkv="colwise", gate_up="{style: colwise, packed: 2}"), "tpplan.models.fused:tiny_gqa", tp=(2,)), "TP326")
    assert (problem.line, problem.column) == (3, 3)
    assert "by 'split'" in problem.message and "{style: colwise, packed: [32, 16, 16]}" in problem.message


@pytest.mark.parametrize(("model", "rules"), [("tpplan.models.fused:tiny", PACKED), ("tpplan.models.fused:tiny_gqa", GQA_PACKED)])
def test_packed_plans_are_lint_clean(model, rules):
    assert [str(p) for p in lint(PLAN.format(**rules), model, tp=(2, 4))] == []


def test_packed_blocks_that_do_not_fit_and_cuts_that_do_not_follow_them():
    problems = lint(PLAN.format(qkv="{style: colwise, packed: 2}", gate_up="{style: colwise, packed: 3}"), "tpplan.models.fused:tiny", tp=(2,))
    assert sorted(found(problems, "TP326")) == [(3, 3), (5, 3)]
    qkv, gate_up = sorted((p for p in problems if p.code == "TP326"), key=lambda p: p.line)
    assert "is packed ([48, 48]), but a 'view' that does not split out its blocks" in qkv.message
    assert "'blocks.0.mlp.gate_up' (128 output features): colwise packed 3: 128 output features are not 3 equal blocks" in gate_up.message


def test_a_packed_output_handed_on_as_one_shard():
    text = """
        version: 1
        rules:
          blocks.*.in_proj: {style: colwise, packed: 2}
          blocks.*.out_proj: rowwise
    """
    problem = only(lint(text, "tpplan.models.mlp:tiny", tp=(2,)), "TP326")
    assert (problem.line, problem.column) == (3, 3)
    assert "holds this rank's slice of every packed block, but 'blocks.0.out_proj' (blocks.*.out_proj) takes it as one contiguous shard" in problem.message


@pytest.mark.parametrize(("options", "message"), [
    ("packed: 3, heads: auto", "colwise takes 'packed' or 'heads', not both"),
    ("packed: 3, output_layouts: replicate", "colwise with 'packed' hands on each rank's slice of every block: drop output_layouts"),
    ("packed: 1", "greater than or equal to 2"),
    ("packed: [32]", "at least 2 items"),
])
def test_bad_packed_options_are_located_schema_errors(options, message):
    with pytest.raises(PlanError) as info:
        load_plan(text=f"version: 1\nrules:\n  blocks.*.attn.qkv: {{style: colwise, {options}}}\n", file="plan.yaml")
    assert message in str(info.value) and info.value.problems[0].line == 3


@pytest.mark.parametrize(("factory", "rules"), [(fused.tiny, PACKED), (fused.tiny_gqa, GQA_PACKED)], ids=["equal", "gqa"])
def test_checkpoint_loads_a_fused_qkv_model_at_tp_2(tmp_path, factory, rules):
    torch.manual_seed(3)
    model = factory().eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    with simulated_load(factory, plan(**rules), 2, str(tmp_path / "model.safetensors")) as sim:
        with torch.no_grad():
            outputs = sim.run(x)
    for rank, got in enumerate(outputs):
        assert max_abs_diff(got, want) <= allowed_diff(want, *tolerance(torch.float32)), f"rank {rank}"


# -- Phi-3: fused qkv_proj ([q | k | v], GQA, sliced at fixed offsets) and gate_up_proj (chunk) --

PHI3 = """
version: 1
rules:
  model.layers.*.self_attn.qkv_proj: {qkv}
  model.layers.*.self_attn.o_proj: {o}
  model.layers.*.mlp.gate_up_proj: {gate_up}
  model.layers.*.mlp.down_proj: rowwise
"""


@pytest.fixture(scope="module")
def phi3():
    pytest.importorskip("transformers")
    from tpplan.models import hf_any

    with torch.device("meta"):
        return hf_any.phi3()


def test_phi3_plain_colwise_is_reported_at_qkv_proj_and_gate_up_proj(phi3):
    problems = lint(PHI3.format(qkv="colwise", o="rowwise", gate_up="colwise"), phi3, tp=(2,))
    assert found(problems, "TP326") == [(3, 3), (5, 3)]
    assert "by 'getitem' in 'model.layers.0.self_attn'" in problems[0].message


def test_phi3_packed_qkv_proj_sliced_at_fixed_offsets_is_reported(phi3):
    text = PHI3.format(qkv="{style: colwise, packed: [64, 32, 32]}", o="rowwise", gate_up="{style: colwise, packed: 2}")
    problem = only(lint(text, phi3, tp=(2,)), "TP326")
    assert (problem.line, problem.column) == (3, 3) and "a slice at fixed offsets" in problem.message


def test_phi3_gathered_qkv_and_packed_gate_up_are_lint_clean_and_match_one_device(phi3):
    from tpplan.models import hf as hf_models

    text = PHI3.format(qkv="{style: colwise, output_layouts: replicate}", o="{style: rowwise, input_layouts: replicate}",
                       gate_up="{style: colwise, packed: 2}")
    assert [str(p) for p in lint(text, phi3, tp=(2,))] == []
    result = check_parity(lambda: hf_models.phi3("eager"), load_plan(text=text), 2)
    assert result.passed, result.problems


@pytest.mark.slow
def test_phi3_plain_colwise_gate_up_fails_check_at_its_own_rule():
    from tpplan.models import hf as hf_models

    text = PHI3.format(qkv="{style: colwise, output_layouts: replicate}", o="{style: rowwise, input_layouts: replicate}", gate_up="colwise")
    result = check_parity(lambda: hf_models.phi3("eager"), load_plan(text=text), 2)
    assert not result.passed
    assert result.located.first.module == "model.layers.0.mlp.down_proj"
    assert result.located.rule.pattern == "model.layers.*.mlp.gate_up_proj"
