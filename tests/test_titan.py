"""torchtitan 0.2.2's own models (tpplan.models.titan) with plans written from its
own parallelize functions (plans/titan/): the lint is clean, the dry run's
collectives equal those of torchtitan's function applied to the same model in
the same simulated world, and --check passes. torchtitan is a development
dependency only (docs/development.md); without it these tests skip.

The MoE plans (llama4, deepseek_v3_moe) shard the routed experts (expert_tp on
GroupedExperts) and the shared experts as torchtitan's apply_moe_ep_tp does with a
TP mesh; their cheap default tests check one MoE layer (ffn_norm and moe, between a
sequence-sharding entry and a gathering exit) against one device and against
torchtitan's own functions on the same layer; the whole models run under -m slow."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

if importlib.util.find_spec("torchtitan") is None:  # torchtitan itself needs triton: tpplan.models.titan imports it without
    pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.2.2, docs/development.md)", allow_module_level=True)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tpplan import load_plan  # noqa: E402
from tpplan.core.plan import Plan  # noqa: E402
from tpplan.lint import lint_model  # noqa: E402
from tpplan.runtime.dryrun import dry_run  # noqa: E402
from tpplan.runtime.options import ApplyOptions  # noqa: E402
from tpplan.check.verify import check_parity  # noqa: E402
from tpplan.simulation.simulate import count_collectives, default_inputs, simulated_world, tp_mesh  # noqa: E402
from tpplan.models.titan import titan  # noqa: E402

PLANS = Path(__file__).resolve().parent.parent / "plans" / "titan"
# Qwen3 (DTensor q/k/v into SDPA, the device-faithful rules) in the default suite, the rest under -m slow
MODELS = [pytest.param("llama3", marks=pytest.mark.slow), "qwen3", pytest.param("deepseek_v3", marks=pytest.mark.slow)]
MOE_MODELS = ["llama4", "deepseek_v3_moe"]
pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def _torchtitan_tp(name: str, model, mesh) -> None:
    """torchtitan's own TP function for `name`, as its parallelize_* calls it
    without float8, loss parallel, async TP or context parallel."""
    if name == "llama3":
        titan("models.llama3.infra.parallelize").apply_tp(model, mesh, False, False)
    elif name == "qwen3":
        titan("models.qwen3.infra.parallelize").apply_non_moe_tp(model, mesh, False, False, False, False)
    elif name in ("deepseek_v3", "deepseek_v3_moe"):
        titan("models.deepseek_v3.infra.parallelize").apply_non_moe_tp(model, mesh, False, False, False)
    else:
        titan("models.llama4.infra.parallelize").apply_non_moe_tp(model, mesh, False, False)
    if name in MOE_MODELS:  # deepseek_v3's parallelize calls llama4's; TP only: experts sharded on their hidden dim
        titan("models.llama4.infra.parallelize").apply_moe_ep_tp(model, mesh, None, None, None)


def _model(name: str):
    import tpplan.models.titan as models

    torch.manual_seed(0)
    return getattr(models, name)()


def torchtitan_comms(name: str, tp: int) -> dict:
    """Collectives of one forward and backward of the model parallelized by torchtitan itself."""
    with simulated_world(tp):
        model = _model(name)
        _torchtitan_tp(name, model, tp_mesh(tp))
        return count_collectives(model, default_inputs(model))


@pytest.mark.parametrize("name", MODELS + ["llama4", pytest.param("deepseek_v3_moe", marks=pytest.mark.slow)])
def test_torchtitan_plan_lints_clean_against_its_model_at_tp_2_and_4(name):
    """The layout flow follows each plan to the end, with no stop (TP328): Llama's complex
    rotary (view_as_complex, view_as_real), the MoE's partial sums (the routed experts'
    scattered into zeros, weighed by the scores, plus the shared experts')."""
    plan = load_plan(PLANS / f"{name}_tp.yaml")
    with torch.device("meta"):
        model = _model(name)
    assert [str(p) for p in lint_model(plan, model, [2, 4])] == []


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_dry_run_collectives_equal_torchtitans_own_function(name, tp):
    report = dry_run(ApplyOptions(plan=str(PLANS / f"{name}_tp.yaml"), model=f"tpplan.models.titan:{name}", tp=tp))
    assert report.ok, [str(p) for p in report.problems]
    # 2 layers: per layer 2 all-gathers and 2 reduce-scatters each way, the output
    # layer's all-gather forward, the embedding's reduce-scatter and the final norm's
    # all-gather forward; its gradient all-gather is the first layer's reduce-scatter's
    assert report.comms == torchtitan_comms(name, tp) == {
        "forward": {"all_gather": 6, "reduce_scatter": 5},
        "backward": {"all_gather": 5, "reduce_scatter": 5},
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_dry_run_check_matches_one_device(name, tp):
    report = dry_run(ApplyOptions(plan=str(PLANS / f"{name}_tp.yaml"), model=f"tpplan.models.titan:{name}", tp=tp, check=True))
    assert report.ok, [str(p) for p in report.problems]
    assert report.check is not None and report.check.passed


def test_qwen3_plan_wrong_on_gpu_too_fails_here_at_its_rule(tmp_path):
    # wk and wv hand SDPA plain tensors while wq hands it a DTensor: DTensor refuses the
    # mix on any device, so the device-faithful rules must not hide it (TP502, not TP507)
    text = (PLANS / "qwen3_tp.yaml").read_text()
    text = text.replace("layers.*.attention.w{q,k,v}: {style: colwise, use_local_output: false}",
                        "layers.*.attention.wq: {style: colwise, use_local_output: false}\n"
                        "  layers.*.attention.w{k,v}: colwise")
    text = text.replace("layers.*.attention.{q,k}_norm: {style: sequence_parallel, sequence_dim: 2}",
                        "layers.*.attention.q_norm: {style: sequence_parallel, sequence_dim: 2}")
    plan = tmp_path / "wrong.yaml"
    plan.write_text(text)
    report = dry_run(ApplyOptions(plan=str(plan), model="tpplan.models.titan:qwen3", tp=2))
    assert [(p.code, p.line) for p in report.problems] == [("TP502", 22)]
    assert "mixed torch.Tensor and DTensor" in report.problems[0].message
    assert Counter(p.code for p in report.problems)["TP507"] == 0


class _MoEHalf(nn.Module):
    """One MoE block's feed-forward half (ffn_norm, then moe) under the block's own names,
    between an entry that hands it its sequence shard (the residual stream's layout) and
    an exit that gathers the output for the comparison with one device."""

    def __init__(self, block: nn.Module):
        super().__init__()
        half = nn.Module()
        half.ffn_norm, half.moe, half.moe_enabled = block.ffn_norm, block.moe, True  # moe_enabled: torchtitan's test
        self.entry, self.layers, self.exit = nn.Identity(), nn.ModuleDict({"0": half}), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.layers["0"]
        return self.exit(half.moe(half.ffn_norm(self.entry(x))))


_BOUNDARY = """version: 1
rules:
  entry: {style: prepare_module_output, output_layouts: replicate, desired_output_layouts: shard(1)}
  exit: {style: prepare_module_input, input_layouts: shard(1), desired_input_layouts: replicate}
"""


def _moe_half(name: str) -> _MoEHalf:
    model = _model(name)
    return _MoEHalf(next(block for block in model.layers.values() if getattr(block, "moe_enabled", True)))


def _moe_half_plan(name: str) -> Plan:
    """The shipped plan's rules for the MoE half (ffn_norm and moe), with the entry and exit's."""
    plan = load_plan(PLANS / f"{name}_tp.yaml")
    rules = [rule for rule in plan.rules if rule.pattern.startswith(("layers.*.ffn_norm", "layers.*.moe"))]
    return Plan(plan.spec, load_plan(text=_BOUNDARY).rules + rules, plan.file, plan.source)


def _torchtitan_moe_half(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, SequenceParallel, parallelize_module

    parallelize_module(model, mesh, {
        "entry": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "layers.0.ffn_norm": SequenceParallel(),
        "exit": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    })
    titan("models.llama4.infra.parallelize").apply_moe_ep_tp(model, mesh, None, None, None)


# One MoE layer with its boundary: forward the moe's all-gather and reduce-scatter and the
# exit's all-gather; backward the reduce-scatter's all-gather and the all-reduces of the
# layer's input gradients (routed experts, shared experts; torchtitan's plain input to the
# shared experts costs one for w1 and one for w3; deepseek_v3_moe's router gate one, below)
_LAYER_FORWARD = {"all_gather": 2, "reduce_scatter": 1}
MOE_LAYER_COMMS = {
    "llama4": ({"forward": _LAYER_FORWARD, "backward": {"all_gather": 1, "all_reduce": 2}},
               {"forward": _LAYER_FORWARD, "backward": {"all_gather": 1, "all_reduce": 3}}),
    "deepseek_v3_moe": ({"forward": _LAYER_FORWARD, "backward": {"all_gather": 1, "all_reduce": 3}},
                        {"forward": _LAYER_FORWARD, "backward": {"all_gather": 1, "all_reduce": 3}}),
}


def _moe_layer_inputs() -> torch.Tensor:
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_layer_matches_one_device_with_torchtitans_collectives_or_fewer(name, tp):
    ours = check_parity(lambda: _moe_half(name), _moe_half_plan(name), tp, inputs=_moe_layer_inputs())
    assert ours.passed, ours.problems
    assert ours.max_abs_diff < 1e-6 and "layers.0.moe.experts.w2 grad" in ours.diffs  # outputs and every gradient compared
    with simulated_world(tp):
        torch.manual_seed(0)
        theirs = _moe_half(name)
        _torchtitan_moe_half(theirs, tp_mesh(tp))
        assert (ours.comms, count_collectives(theirs, _moe_layer_inputs())) == MOE_LAYER_COMMS[name]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_torchtitans_own_moe_layer_against_one_device(name, tp):
    theirs = check_parity(lambda: _moe_half(name), _torchtitan_moe_half, tp, inputs=_moe_layer_inputs())
    if name == "llama4":  # scores applied before the experts: the router's gradient arrives whole
        assert theirs.passed, theirs.problems
    else:
        # scores applied after the experts (score_before_experts false): the gate's output
        # gradient is each rank's share of a sum, which torchtitan 0.2.2's NoParallel router
        # leaves unsummed (its PR 2416 adds the all-reduce); the plan's sum_output_grad sums it
        assert not theirs.passed
        assert {problem.split(" grad:")[0] for problem in theirs.problems} == {"layers.0.moe.router.gate.weight"}


def test_torchtitans_own_deepseek_v3_moe_plan_is_an_error_at_the_moe_naming_the_router_gates_sum(tmp_path):
    # torchtitan 0.2.2's plan is the shipped one without the router gate's rule (its
    # NoParallel router, pytorch/torchtitan#2387): the gate's scores weigh the experts'
    # partial sums, so each rank's gradient of them is its share; the lint says so from
    # the plan and the model alone (the check test above confirms it with values)
    shipped = (PLANS / "deepseek_v3_moe_tp.yaml").read_text()
    assert shipped.count("  layers.*.moe.router.gate: sum_output_grad\n") == 1
    (tmp_path / "deepseek_v3_tp.yaml").write_text((PLANS / "deepseek_v3_tp.yaml").read_text())  # what it extends
    theirs = tmp_path / "theirs.yaml"
    theirs.write_text(shipped.replace("  layers.*.moe.router.gate: sum_output_grad\n", ""))
    plan = load_plan(theirs)
    with torch.device("meta"):
        model = _model("deepseek_v3_moe")
    problems = lint_model(plan, model, [2, 4])
    rules = {rule.line: rule.pattern for rule in plan.rules if Path(rule.file) == theirs}
    assert [(p.code, p.severity, rules.get(p.line)) for p in problems] == [("TP325", "error", "layers.*.moe")], [str(p) for p in problems]
    assert "in 'bmm' inside 'layers.1.moe', a whole tensor computed from parameters (from the output of 'layers.1.moe.router.gate')" in problems[0].message
    assert problems[0].message.endswith("add the rule 'layers.*.moe.router.gate: sum_output_grad' (its output's gradient summed over the mesh)")
    # torchtitan's NoParallel gate written out: the error is at that rule, which sums nothing
    theirs.write_text(shipped.replace("router.gate: sum_output_grad", "router.gate: no_parallel"))
    plan = load_plan(theirs)
    rules = {rule.line: rule.pattern for rule in plan.rules if Path(rule.file) == theirs}
    problems = lint_model(plan, model, [2, 4])
    assert [(p.code, rules.get(p.line)) for p in problems] == [("TP325", "layers.*.moe.router.gate")], [str(p) for p in problems]
    assert "(now no_parallel) 'layers.*.moe.router.gate: sum_output_grad'" in problems[0].message


# The whole models, 2 layers: llama4 MoE in both, deepseek_v3_moe a dense first layer
# then MoE (per MoE layer as above, less the boundary's exit; the dense parts as the
# dense plans')
MOE_MODEL_COMMS = {
    "llama4": ({"forward": {"all_gather": 6, "reduce_scatter": 5}, "backward": {"all_gather": 5, "all_reduce": 4, "reduce_scatter": 3}},
               {"forward": {"all_gather": 6, "reduce_scatter": 5}, "backward": {"all_gather": 5, "all_reduce": 6, "reduce_scatter": 3}}),
    "deepseek_v3_moe": ({"forward": {"all_gather": 6, "reduce_scatter": 5}, "backward": {"all_gather": 5, "all_reduce": 3, "reduce_scatter": 4}},
                        {"forward": {"all_gather": 6, "reduce_scatter": 5}, "backward": {"all_gather": 5, "all_reduce": 3, "reduce_scatter": 4}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_plan_passes_check_with_torchtitans_collectives_or_fewer(name, tp):
    report = dry_run(ApplyOptions(plan=str(PLANS / f"{name}_tp.yaml"), model=f"tpplan.models.titan:{name}", tp=tp, check=True))
    assert report.ok and report.check.passed, [str(p) for p in report.problems]
    assert report.check.max_abs_diff < 1e-5
    assert (report.comms, torchtitan_comms(name, tp)) == MOE_MODEL_COMMS[name]
