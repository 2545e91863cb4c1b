"""Experts on their own ep axis (issue 28 item 3, SPEC §7): a version 2 plan's `experts`
rules applied over `ep`, whose ranks are borrowed from dp_shard·cp·tp (torchtitan's expert
view (dp_replicate, efsdp, ep), efsdp = dp_shard·cp·tp / ep), by `Plan.apply` and by
`tpplan apply` under torchrun: expert_parallel with all_to_all dispatch over ep, then FSDP2
shards the experts over efsdp and the rest of the model over dp_shard. Parity with one
device after AdamW steps on real gloo ranks (the all-to-all's split sizes differ per rank,
so no one-process simulation can check its values)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tpplan import load_plan
from tpplan.core.axes import NotAppliedError
from tpplan.core.problems import PlanError

from test_torchrun import torchrun

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "qwen3_moe_fsdp_ep.yaml"
MODEL = "tpplan.models.hf:qwen3_moe"
L = 2  # tpplan.models.hf.TINY's layers, each with 4 routed experts
EXPERTS = "  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}\n"


def _plan(tmp_path: Path, mesh: str, experts: str = EXPERTS, rules: str = "  model.layers.*.mlp.experts: null\n", more: str = "") -> Path:
    """The shipped plan's layout with other sizes: the SP rules of qwen3_moe_ep_sp.yaml over tp, the experts over ep."""
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'hf' / 'qwen3_moe_ep_sp.yaml'}\nrules:\n{rules}"
                    f"mesh:\n{textwrap.indent(mesh, '  ')}experts:\n{experts}fsdp:\n  units: [model.layers.*]\n{more}")
    return path


def _line(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def test_the_expert_view_borrows_ep_from_tp_first_then_dp_shard_and_is_built_once(tmp_path):
    from tpplan.sharding.expert_mesh import expert_view
    from tpplan.simulation.simulate import simulated_world

    cases = [  # mesh, world, (view dims), rank 0's ep group, rank 0's efsdp group
        ("dp_shard: 2\ntp: 2\nep: 2\n", 4, {"efsdp": 2, "ep": 2}, [0, 1], [0, 2]),  # ep = the tp group
        ("dp_shard: 2\ntp: 2\nep: 4\n", 4, {"efsdp": 1, "ep": 4}, [0, 1, 2, 3], [0]),  # ep spans both dp_shard ranks
        ("dp_shard: 4\ntp: 1\nep: 2\n", 4, {"efsdp": 2, "ep": 2}, [0, 1], [0, 2]),  # from dp_shard alone
        ("dp_replicate: 2\ndp_shard: 2\ntp: 2\nep: 2\n", 8, {"dp_replicate": 2, "efsdp": 2, "ep": 2}, [0, 1], [0, 2]),
    ]
    for mesh_text, world, dims, ep_group, efsdp_group in cases:
        plan = load_plan(_plan(tmp_path, mesh_text))
        with simulated_world(world):
            mesh = plan.build_mesh(world)
            view = expert_view(plan, mesh)
            assert dict(zip(view.mesh_dim_names, view.shape)) == dims, mesh_text
            assert (_ranks(view["ep"]), _ranks(view["efsdp"])) == (ep_group, efsdp_group), mesh_text
            assert expert_view(plan, mesh) is view  # build_mesh built it; apply finds the same process groups


def test_plan_apply_places_the_experts_over_ep_then_fsdp_shards_them_over_efsdp():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    from tpplan.models.hf import qwen3_moe
    from tpplan.simulation.fsdp import _meshes_outside_fake_mode
    from tpplan.simulation.simulate import simulated_world

    plan = load_plan(PLAN)
    with simulated_world(4):
        model = qwen3_moe()
        mesh = plan.build_mesh(4)
        with _meshes_outside_fake_mode():
            plan.apply(model, mesh)
    layer = model.model.layers[0]
    experts = layer.mlp.experts.gate_up_proj  # [4, 64, 64]: 2 experts per ep rank, then 1 per efsdp rank
    assert experts.device_mesh.mesh_dim_names == ("efsdp", "ep") and experts.placements[1] == Shard(0)
    assert experts.to_local().shape == (1, 64, 64)
    q = layer.self_attn.q_proj.weight  # the rest of the model: the TP rules over tp, FSDP over dp_shard
    assert q.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    assert isinstance(layer.mlp.experts, FSDPModule) and isinstance(layer, FSDPModule) and isinstance(model, FSDPModule)


def test_an_ep_that_does_not_divide_the_borrowed_ranks_is_located_at_mesh_ep(tmp_path):
    from tpplan.runtime.options import ApplyOptions
    from tpplan.runtime.torchrun import _mesh

    fixed = _plan(tmp_path, "dp_shard: 2\ntp: 2\nep: 3\n")
    with pytest.raises(PlanError) as at_load:  # every size known: the plan alone is wrong
        load_plan(fixed)
    problem = at_load.value.problems[0]
    assert (problem.code, problem.line, problem.column) == ("TP122", _line(fixed, "ep: 3"), 7)
    assert problem.message.startswith("mesh.ep: 3 does not divide dp_shard·cp·tp = 2·1·2 = 4: ")
    assert "make ep one of 1, 2, 4, or raise dp_shard" in problem.message
    rest = _plan(tmp_path, "dp_shard: -1\ntp: 2\nep: 3\n")  # dp_shard from the world: torchrun's world decides
    plan = load_plan(rest)
    with pytest.raises(PlanError) as at_world:
        _mesh(4, ApplyOptions(plan=str(rest), model=MODEL), plan)
    problem = at_world.value.problems[0]
    assert (problem.code, problem.line, problem.message[:50]) == ("TP122", _line(rest, "ep: 3"), "mesh.ep: 3 does not divide dp_shard·cp·tp = 2·1·2 ")
    assert _mesh(6, ApplyOptions(plan=str(rest), model=MODEL), plan) == ((3, 2), ("dp_shard", "tp"))  # 3 divides 3·2


def test_torchrun_stops_every_rank_at_an_ep_that_does_not_divide_the_world_it_runs_on(tmp_path):
    path = _plan(tmp_path, "dp_shard: -1\ntp: 2\nep: 3\n")
    result = torchrun(4, "-m", "tpplan", "apply", "--model", MODEL, "--plan", str(path), timeout=120)
    assert result.returncode == 1
    located = (f"{path}:{_line(path, 'ep: 3')}:7: TP122 mesh.ep: 3 does not divide dp_shard·cp·tp = 2·1·2 = 4: expert "
               "parallelism borrows its ranks from these axes; make ep one of 1, 2, 4, or raise dp_shard")
    assert result.stdout.splitlines()[0] == located and "Traceback" not in result.stdout  # rank 0's report
    assert sorted(line for line in result.stderr.splitlines() if line.startswith("rank ")) == [f"rank {r}: {located}" for r in (1, 2, 3)]


def test_an_experts_rule_the_ep_axis_does_not_carry_is_refused_at_the_rule(tmp_path):
    import torch

    path = _plan(tmp_path, "dp_shard: 2\ntp: 2\nep: 2\n", experts="  model.layers.*.mlp.experts: expert_tp\n")
    with pytest.raises(NotAppliedError) as info:
        load_plan(path).apply(torch.nn.Linear(2, 2), None)
    problem = info.value.problem
    assert (problem.code, problem.line, problem.column) == ("TP130", _line(path, "expert_tp"), 3)
    assert "experts rule 'model.layers.*.mlp.experts' is expert_tp. Over the ep axis this tpplan applies expert_parallel" in problem.message


def test_experts_a_tp_rule_also_claims_are_the_plans_error_at_the_experts_rule(tmp_path):
    from tpplan.lint.checks import check_model
    from tpplan.models.hf import qwen3_moe
    from tpplan.simulation.simulate import simulated_world
    from lint_helpers import meta_model

    path = _plan(tmp_path, "dp_shard: 2\ntp: 2\nep: 2\n", rules="  model.norm: sequence_parallel\n")  # the parent's experts rule kept
    plan = load_plan(path)
    with simulated_world(4):
        model = qwen3_moe()
        with pytest.raises(PlanError) as info:
            plan.apply(model, plan.build_mesh(4))
    problem = info.value.problems[0]
    parent = ROOT / "plans" / "hf" / "qwen3_moe_ep_sp.yaml"
    assert (problem.code, problem.line) == ("TP201", _line(path, "dispatch: all_to_all"))
    assert problem.message == (
        f"experts rule 'model.layers.*.mlp.experts' and rule 'model.layers.*.mlp.experts' ({parent}:{_line(parent, 'mlp.experts')}) "
        "both match 'model.layers.0.mlp.experts' (and 1 more): a module takes one style (the experts rule places it over ep, "
        "the TP rule over tp); delete the inherited rule with 'model.layers.*.mlp.experts: null' under rules")
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Parameter"  # refused before any rule applied
    linted = [p for p in check_model(plan, meta_model(MODEL), [2]) if p.code == "TP201"]
    assert [(p.line, p.message) for p in linted] == [(problem.line, problem.message)]  # validate --model says the same


# Per layer: the SP plan's attention (1 all-gather, 1 reduce-scatter each way) and the
# experts' all-to-alls (forward 3: counts, tokens, results; backward 2), plus the embedding's
# reduce-scatter and the head's all-gathers (tests/test_expert_all_to_all.py's EP_SP); FSDP2:
# one all-gather per unit forward (L blocks over dp_shard, L experts over efsdp, the root),
# again in backward (resharded after forward) with one reduce-scatter each; the replicated
# parameters' partial gradients (q_norm, k_norm, router, both layer norms per layer, the
# final norm) all-reduced when FSDP2 takes them.
UNITS = 2 * L + 1
COMMS = {
    "forward": {"all_gather": L + 2 + UNITS, "all_to_all": 3 * L, "reduce_scatter": L + 1},
    "backward": {"all_gather": L + 1 + UNITS, "all_reduce": 5 * L + 1, "all_to_all": 2 * L, "reduce_scatter": L + 1 + UNITS},
}


# ep 4 spans both dp_shard ranks: efsdp 1 (no FSDP collective for the experts, their gradients
# divided by dp_shard 2 all the same: the all-to-all summed both data ranks' tokens); with full
# activation checkpointing of the blocks, backward recomputes each block's forward: its
# attention's all-gather and reduce-scatter and its experts' 3 all-to-alls again.
EP4_AC = {
    "forward": {"all_gather": L + 2 + L + 1, "all_to_all": 3 * L, "reduce_scatter": L + 1},
    "backward": {"all_gather": L + 1 + L + 1 + L, "all_reduce": 5 * L + 1, "all_to_all": 2 * L + 3 * L,
                 "reduce_scatter": L + 1 + L + 1 + L},
}


@pytest.mark.parametrize("mesh, more, sizes, comms", [
    # the shipped plan: ep 2 = the tp group, efsdp 2 (the experts' FSDP over the dp_shard pairs)
    (None, "", {"dp_shard": 2, "tp": 2, "ep": 2}, COMMS),
    # slow (~26 s): the dry run's test below holds its collectives to EP4_AC by default
    pytest.param("dp_shard: 2\ntp: 2\nep: 4\n", "checkpointing: {modules: model.layers.*, mode: full}\n", {"dp_shard": 2, "tp": 2, "ep": 4},
                 EP4_AC, marks=pytest.mark.slow),
], ids=["ep2-efsdp2", "ep4-efsdp1-ac"])
def test_torchrun_applies_experts_over_ep_with_fsdp_and_matches_one_device_after_three_adamw_steps(tmp_path, mesh, more, sizes, comms):
    path = PLAN if mesh is None else _plan(tmp_path, mesh, more=more)
    result = torchrun(4, "-m", "tpplan", "apply", "--model", MODEL, "--plan", str(path), "--check", "--steps", "3",
                      "--format", "json", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["problems"] == [] and report["mesh"] == sizes
    # the forward and backward's loss and every gradient, then the losses and parameters after 3 AdamW steps
    assert report["check"]["passed"] and report["check"]["max_abs_diff"] < 1e-5
    assert report["steps"]["n"] == 3 and report["steps"]["max_abs_diff"] < 5e-4
    assert report["comms"] == comms
    experts = report["parameters"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["placements"] == "shard(0)" and experts["local_shapes"] == [[4 // sizes["ep"], 64, 64]] * 2
    efsdp = 4 // sizes["ep"]
    assert f"expert_parallel (all_to_all) over ep {sizes['ep']}, borrowed from dp_shard·cp·tp, on {L} module(s), sharded by FSDP2 over efsdp {efsdp}" in report["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, sizes", [
    # ep from dp_shard alone: efsdp 2, but gradients divided by dp_shard 4 (summed, then divided: gloo has no PREMUL_SUM)
    ("dp_shard: 4\ntp: 1\nep: 2\n", {"dp_shard": 4, "tp": 1, "ep": 2}),
    # HSDP: the experts replicated over dp_replicate, sharded over efsdp 1 (ep = tp)
    ("dp_replicate: 2\ntp: 2\nep: 2\n", {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "ep": 2}),
    # no data axis: ep 2 of tp 4 leaves each expert on 2 ranks, whose gradients FSDP2 over efsdp 2 sums
    ("tp: 4\nep: 2\n", {"tp": 4, "ep": 2}),
], ids=["dp_shard4-ep2", "hsdp-ep2", "tp4-ep2"])
def test_other_borrowings_of_ep_match_one_device(tmp_path, mesh, sizes):
    path = _plan(tmp_path, mesh)
    result = torchrun(4, "-m", "tpplan", "apply", "--model", MODEL, "--plan", str(path), "--check", "--steps", "3",
                      "--format", "json", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["mesh"] == sizes
    assert report["check"]["passed"] and report["steps"]["max_abs_diff"] < 5e-4


@pytest.mark.parametrize("mesh, more, comms", [
    (None, "", COMMS),
    ("dp_shard: 2\ntp: 2\nep: 4\n", "checkpointing: {modules: model.layers.*, mode: full}\n", EP4_AC),
], ids=["ep2-efsdp2", "ep4-efsdp1-ac"])
def test_the_dry_run_simulates_the_ep_axis_with_torchruns_collectives_filed_by_axis(tmp_path, mesh, more, comms):
    """The dry run of the world applies the experts over ep as torchrun does (the same
    collectives as the torchrun runs above counted), filing the all-to-alls under ep and the
    experts' FSDP2 under efsdp: the expert view's own axes."""
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    path = PLAN if mesh is None else _plan(tmp_path, mesh, more=more)
    report = dry_run(ApplyOptions(plan=str(path), model=MODEL, world=4)).to_json()
    assert report["ok"], report["problems"]
    assert report["comms"] == comms
    by_axis = report["comms_by_axis"]
    assert {phase: {op: found["count"] for op, found in ops.items()} for phase, ops in by_axis["ep"].items()} == {
        "forward": {"all_to_all": 3 * L}, "backward": {"all_to_all": 2 * L + (3 * L if more else 0)}}
    efsdp = 4 // (2 if mesh is None else 4)
    assert ("efsdp" in by_axis) == (efsdp > 1)
    if efsdp > 1:  # the experts' own FSDP2 units: one all-gather each way, one reduce-scatter
        assert {phase: {op: found["count"] for op, found in ops.items()} for phase, ops in by_axis["efsdp"].items()} == {
            "forward": {"all_gather": L}, "backward": {"all_gather": L, "reduce_scatter": L}}
    note = next(n for n in report["notes"] if n.startswith("expert_parallel"))
    assert note.startswith(f"expert_parallel (all_to_all) over ep {4 // efsdp}, borrowed from dp_shard·cp·tp, on {L} module(s)")
    assert "routing simulated as balanced" in note


def test_the_dry_run_simulates_experts_sharded_alone_over_efsdp_without_data_axes(tmp_path):
    """tp 4, ep 2 (torchrun's tp4-ep2 above): FSDP2 wraps the experts alone, over efsdp 2, and
    no root; torch's FSDPMemTracker needs an FSDP2 root, so the step is followed by MemTracker."""
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    report = dry_run(ApplyOptions(plan=str(_plan(tmp_path, "tp: 4\nep: 2\n")), model=MODEL, world=4)).to_json()
    assert report["ok"], report["problems"]
    assert report["mesh"] == {"tp": 4} and report["memory"]["per_rank_peak_bytes"] > 0  # the mesh's dims: ep is borrowed
    assert {phase: {op: found["count"] for op, found in ops.items()} for phase, ops in report["comms_by_axis"]["efsdp"].items()} == {
        "forward": {"all_gather": L}, "backward": {"all_gather": L, "reduce_scatter": L}}
