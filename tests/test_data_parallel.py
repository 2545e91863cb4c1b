"""FSDP2 / HSDP from a version 2 plan (issue 28 item 5, SPEC §7): the plan's dp_replicate
and dp_shard axes and its `fsdp` section, applied after the TP rules by `Plan.apply`
(with `plan.build_mesh(world)`) and by `tpplan apply` under torchrun, with `--check`
parity against one device after AdamW steps. `--fsdp N` stays a version 1 plan's shorthand."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tpplan import load_plan
from tpplan.core.axes import mesh_dims
from tpplan.core.problems import PlanError

from test_torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "llama_fsdp_tp.yaml"
TINY = "tpplan.models.llama:tiny"


def _plan(tmp_path: Path, mesh: str, fsdp: str = "") -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh:\n{textwrap.indent(mesh, '  ')}{fsdp}")
    return path


def test_the_mesh_a_plan_builds_names_its_data_axes_outermost_and_tp_fastest(tmp_path):
    assert mesh_dims(load_plan(PLAN), 8, 2) == ((4, 2), ("dp_shard", "tp"))
    assert mesh_dims(load_plan(PLAN), 8, 4) == ((2, 4), ("dp_shard", "tp"))
    # HSDP: FSDP2 takes a 2-D (replicate, shard) mesh, so dp_shard stays at 1
    assert mesh_dims(load_plan(_plan(tmp_path, "dp_replicate: 2\ntp: 2\n")), 4) == ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"))
    assert mesh_dims(load_plan(_plan(tmp_path, "dp_replicate: 2\ndp_shard: -1\ntp: 2\n")), 8) == ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    assert mesh_dims(load_plan(ROOT / "plans" / "llama_tp.yaml"), 4, 2) == ((2, 2), ("dp", "tp"))  # version 1: --fsdp's dp
    with pytest.raises(ValueError, match="multiply to 4, not the world size 8"):
        mesh_dims(load_plan(_plan(tmp_path, "dp_shard: 2\ntp: 2\n")), 8)


def _applied(plan_path: Path, world: int, tp: int | None = None):
    """Plan.apply on plan.build_mesh(world) in the one fake world (rank 0), on a tiny Llama."""
    from tpplan.models.llama import tiny
    from tpplan.simulation.fsdp import _meshes_outside_fake_mode
    from tpplan.simulation.simulate import simulated_world

    plan = load_plan(plan_path)
    with simulated_world(world):
        model = tiny()
        mesh = plan.build_mesh(world, tp=tp)
        with _meshes_outside_fake_mode():
            plan.apply(model, mesh)
    return model, mesh


def test_plan_apply_shards_the_tp_rules_then_fsdp_over_dp_shard():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    model, mesh = _applied(PLAN, 8, tp=2)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    # colwise over tp, then FSDP's rows over dp_shard: torch's strided shard of the TP shard
    assert str(wq.placements) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert wq.to_local().shape == (128 // 2 // 4, 128)
    norm = model.layers[0].attention_norm.weight
    assert (norm.device_mesh.mesh_dim_names, norm.placements) == (("dp_shard",), (Shard(0),))  # no TP rule: FSDP's shard alone
    assert isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for block in model.layers)
    assert not isinstance(model.tok_embeddings, FSDPModule)  # the plan's units: layers.* and the root


def test_hsdp_replicates_over_dp_replicate_and_shards_over_dp_shard(tmp_path):
    model, _ = _applied(_plan(tmp_path, "dp_replicate: 2\ndp_shard: 2\ntp: 2\n"), 8)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert str(wq.placements) == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_fsdp_units_that_match_nothing_are_the_plans_located_error(tmp_path):
    path = _plan(tmp_path, "dp_shard: 2\ntp: 2\n", "fsdp:\n  units: [layers.*, blocks.*]\n")
    with pytest.raises(PlanError) as info:
        _applied(path, 4)
    problem = info.value.problems[0]
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "units" in text)
    assert (problem.code, problem.line) == ("TP200", line)
    assert "fsdp.units: 'blocks.*' matches no module" in problem.message


def test_mixed_precision_and_reshard_reach_fully_shard(tmp_path):
    import torch

    path = _plan(tmp_path, "dp_shard: 2\ntp: 2\n", "fsdp:\n  reshard_after_forward: false\n  mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}\n")
    model, _ = _applied(path, 4)
    state = model.layers[0]._get_fsdp_state()
    policy = state._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert state._fsdp_param_group.post_forward_mesh_info is None  # reshard_after_forward false: kept gathered


@pytest.mark.slow  # 2 torchrun jobs of 4 ranks (~25 s); the default suite runs a v2 plan's fsdp under torchrun in
# test_training_torchrun.py (the example trainer) and FSDP2 × TP parity there too
def test_torchrun_applies_fsdp_from_the_plan_as_the_fsdp_flag_does_with_one_device_parity():
    """dp_shard 2 × tp 2 on 4 gloo ranks, 3 AdamW steps, --check: the same collectives and
    losses as the version 1 plan with --fsdp 2 (the shorthand), and parity with one device."""
    def run(*args):
        result = torchrun(4, "-m", "tpplan", "apply", "--model", TINY, "--tp", "2", "--check", "--steps", "3", "--format", "json", *args, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return json.loads(result.stdout)

    plan = run("--plan", str(PLAN))
    flag = run("--plan", "plans/llama_tp.yaml", "--fsdp", "2")
    assert plan["mesh"] == {"dp_shard": 2, "tp": 2} and flag["mesh"] == {"dp": 2, "tp": 2}
    assert plan["check"]["passed"] and plan["steps"]["max_abs_diff"] < 1e-4
    assert plan["comms"] == flag["comms"]
    assert plan["comms"]["backward"]["reduce_scatter"] > 0  # FSDP's gradient reduce-scatters
    assert plan["steps"]["losses"] == flag["steps"]["losses"]
    assert "FSDP2 (fully_shard on layers.* and the root) over dp_shard 2, after the plan" in plan["notes"]


@pytest.mark.slow
def test_hsdp_by_tp_on_eight_gloo_ranks_matches_one_device_after_three_adamw_steps(tmp_path):
    path = _plan(tmp_path, "dp_replicate: 2\ndp_shard: 2\ntp: 2\n")
    result = torchrun(8, "-m", "tpplan", "apply", "--model", TINY, "--plan", str(path), "--check", "--steps", "3", "--format", "json", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert report["check"]["passed"] and report["steps"]["max_abs_diff"] < 1e-4


def test_torchrun_refuses_fsdp_flag_tp_mismatch_and_a_wrong_world_with_the_numbers():
    from tpplan.cli.apply import usage_text
    from tpplan.runtime.options import ApplyOptions, ApplyOptionsError
    from tpplan.runtime.torchrun import _mesh
    from tpplan.simulation.training import TrainOptions

    plan = load_plan(PLAN)
    assert _mesh(8, ApplyOptions(plan=str(PLAN), model=TINY, tp=4), plan) == ((2, 4), ("dp_shard", "tp"))
    with pytest.raises(ApplyOptionsError) as info:
        _mesh(4, ApplyOptions(plan=str(PLAN), model=TINY, train=TrainOptions(fsdp=2)), plan)
    assert usage_text(info.value).startswith("--fsdp is a version 1 plan's shorthand: a version 2 plan sets mesh.dp_shard")
    fixed = load_plan(ROOT / "plans" / "llama_tp.yaml")  # a version 1 plan: --tp as ever
    assert _mesh(4, ApplyOptions(plan="p", model=TINY, tp=2), fixed) == ((2, 2), ("dp", "tp"))
    two = load_plan(text="version: 2\nmesh:\n  dp_shard: 3\n  tp: 2\nrules: {}\n")
    with pytest.raises(PlanError) as wrong:
        _mesh(8, ApplyOptions(plan="p", model=TINY), two)
    assert (wrong.value.problems[0].code, wrong.value.problems[0].line) == ("TP121", 2)
    assert "dp_shard 3 × tp 2 = 6, not the world size 8" in wrong.value.problems[0].message
    with pytest.raises(ApplyOptionsError) as mismatch:
        _mesh(6, ApplyOptions(plan="p", model=TINY, tp=3), two)
    assert usage_text(mismatch.value) == "--tp 3: the plan's mesh gives tp 2 on 6 ranks (dp_shard 3 × tp 2); leave --tp out, or change mesh.tp"
