"""Expert styles on any layout whose parameters have the expert dim first (issue 19,
build item 2): torchtitan's GroupedExperts (w1/w2/w3, forward(x sorted by expert,
num_tokens_per_expert)) under expert_tp with explicit params and expert_parallel
(dispatch all_reduce), in the one-process simulation: outputs and every gradient equal
one device; the lint reads the declared placements; a rule that cannot apply is a
located exit 1."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from typer.testing import CliRunner

from grouped_experts import GroupedExperts, tiny_moe
from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.simulation.simulate import simulated_world, tp_mesh
from tpplan.check.verify import check_parity
from tpplan.sharding.expert_parallel import AllReduceExpertParallel, AllToAllExpertParallel
from tpplan.sharding.experts import ExpertTensorParallel

MODEL = "grouped_experts:tiny_moe"  # tests/grouped_experts.py
TITAN_TP = "experts: {style: expert_tp, params: {w1: shard(1), w2: shard(2), w3: shard(1)}}"
TITAN_EP = "experts: {style: expert_parallel, dispatch: all_reduce}"


def _plan(tmp_path, rule: str) -> str:
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 1\nmesh: {{axis: tp, sizes: [2, 4]}}\nrules:\n  {rule}\n")
    return str(path)


def _cli(*args: str):
    result = CliRunner().invoke(app, [*args, "--format", "json"], env={"TPPLAN_DEBUG": None})
    return result.exit_code, result.output


STYLES = {
    "expert_tp": lambda: ExpertTensorParallel(params={"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}),
    "expert_parallel": AllReduceExpertParallel,
}


def _sharded_call(experts, style, tp, x, counts):
    """The experts under `style` at `tp` with every rank's values: (output, x's gradient,
    each parameter's full gradient) as rank 0 sees them, and whether all ranks agree."""
    with simulated_world(tp), LocalTensorMode(tp):
        mesh = tp_mesh(tp)
        parallelize_module(experts, mesh, style)
        xi = x.detach().clone().requires_grad_()
        out = experts(DTensor.from_local(xi, mesh, (Replicate(),)), DTensor.from_local(counts, mesh, (Replicate(),)))
        out.square().sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in experts.named_parameters()}
        ranks = [(out._local_tensors[r], {n: g._local_tensors[r] for n, g in grads.items()}) for r in range(tp)]
    return ranks


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", list(STYLES))
def test_grouped_experts_match_one_device_on_every_rank_outputs_and_weight_gradients(style, tp):
    torch.manual_seed(0)
    reference = GroupedExperts()
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no tokens; uneven shares per rank
    x = torch.randn(10, 16)
    xr = x.clone().requires_grad_()
    want = reference(xr, counts)
    want.square().sum().backward()
    ranks = _sharded_call(copy.deepcopy(reference), STYLES[style](), tp, x, counts)
    assert len(ranks) == tp
    for out, grads in ranks:
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        assert sorted(grads) == ["w1", "w2", "w3"]
        for name, grad in grads.items():
            torch.testing.assert_close(grad, getattr(reference, name).grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("rule", [TITAN_TP, TITAN_EP], ids=["expert_tp", "expert_parallel"])
def test_model_around_grouped_experts_matches_one_device_with_one_forward_all_reduce(tmp_path, rule, tp):
    """check_parity compares the outputs and every parameter gradient (the embedding's
    too, so the experts' input gradient) with one device."""
    result = check_parity(tiny_moe, load_plan(_plan(tmp_path, rule)), tp)
    assert result.passed, result.problems
    assert result.max_abs_diff < 1e-5
    # the experts' partial output (forward); the embedding's partial input gradient (backward)
    assert result.comms == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_expert_parallel_gives_each_rank_its_experts_slice_of_the_sorted_tokens():
    from tpplan.sharding.expert_dispatch import route_sorted

    x = torch.arange(10.0).unsqueeze(-1)  # row i holds i
    counts = torch.tensor([3, 0, 5, 2])  # experts 0..3 hold rows 0-2, none, 3-7, 8-9
    with simulated_world(2):
        rows, local, row, valid = route_sorted(x, counts, tp_mesh(2), 4)
        assert rows.squeeze(-1).tolist() == [0, 1, 2] and local.tolist() == [3, 0]  # rank 0: experts 0 and 1
        with LocalTensorMode(2):
            rows, local, row, valid = route_sorted(x, counts, tp_mesh(2), 4)
            # one program for both ranks: 5 rows per local expert (the largest count), masked
            assert local.tolist() == [5, 5] and rows.shape == (10, 1)
            got = {r: (row._local_tensors[r].tolist(), valid._local_tensors[r].squeeze(-1).tolist()) for r in (0, 1)}
    assert got[0] == ([0, 1, 2, 3, 4, 3, 4, 5, 6, 7], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    assert got[1] == ([3, 4, 5, 6, 7, 8, 9, 9, 9, 9], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0])


def test_lint_reads_the_declared_placements_of_a_torchtitan_layout():
    from tpplan.core.placements import PlacementSpec

    spec = load_plan_rule(TITAN_TP)
    got = spec.param_placements(GroupedExperts())
    assert got == {"w1": PlacementSpec("shard", 1), "w2": PlacementSpec("shard", 2), "w3": PlacementSpec("shard", 1)}
    assert set(load_plan_rule(TITAN_EP).param_placements(GroupedExperts()).values()) == {PlacementSpec("shard", 0)}


def load_plan_rule(rule: str):
    (parsed,) = load_plan(text=f"version: 1\nrules:\n  {rule}\n").rules
    return parsed.spec


@pytest.mark.parametrize("rule", [TITAN_TP, TITAN_EP], ids=["expert_tp", "expert_parallel"])
def test_validate_model_is_clean_of_errors_and_the_dry_run_passes_on_a_correct_plan(tmp_path, rule):
    plan = _plan(tmp_path, rule)
    code, out = _cli("validate", plan, "--model", MODEL, "--tp", "2")
    assert code == 0, out
    assert [p["code"] for p in json.loads(out)["problems"]] == ["TP360"]  # only: embedding and head left whole
    code, out = _cli("apply", "--plan", plan, "--model", MODEL, "--tp", "4", "--dry-run")
    assert code == 0, out


# (model, rule, the lint's code, the dry run's code, in the message)
BAD = [
    (MODEL, "experts: {style: expert_tp, params: {w4: shard(1)}}", "TP305", "TP501",
     "params names no parameter of GroupedExperts: 'w4'; name its own parameters: w1, w2, w3"),
    (MODEL, "experts: expert_tp", "TP305", "TP501", "expert_tp has no default placements for GroupedExperts"),
    (MODEL, "experts: {style: expert_tp, params: {w1: shard(3)}}", "TP305", "TP501",
     "expert_tp shards 'w1' [4, 32, 16] of GroupedExperts on dim 3, which it does not have; give 'w1' a dim in 0..2"),
    ("grouped_experts:tiny_no_expert_dim", "experts: expert_parallel", "TP305", "TP501",
     "expert_parallel needs a module whose own parameters all have the expert dim first (at least 2-D, one common "
     "first size E); NoExpertDim has: w1 [32, 16], w2 [16, 32]"),
    (MODEL, "experts: {style: expert_parallel, dispatch: all_to_all}", None, "TP502",
     "GroupedExperts(x, num_tokens_per_expert), tokens already sorted by expert, which this dispatch does not take"),
]


@pytest.mark.parametrize("model, rule, lint_code, run_code, message", BAD, ids=[r[1][9:40] for r in BAD])
def test_a_rule_that_cannot_apply_to_its_module_is_located_with_exit_1(tmp_path, model, rule, lint_code, run_code, message):
    plan = _plan(tmp_path, rule)
    code, out = _cli("apply", "--plan", plan, "--model", model, "--tp", "2", "--dry-run")
    assert code == 1, out
    (problem,) = json.loads(out)["problems"]
    assert (problem["code"], problem["line"], problem["column"]) == (run_code, 4, 3)
    assert message in problem["message"]
    code, out = _cli("validate", plan, "--model", model, "--tp", "2")
    assert code == 1, out
    errors = [p for p in json.loads(out)["problems"] if p["severity"] == "error"]
    assert errors and all((p["line"], p["column"]) == (4, 3) for p in errors)
    if lint_code is not None:
        assert [p["code"] for p in errors] == [lint_code] and message in errors[0]["message"]


def _titan_moe():
    """torchtitan 0.2.2's own module on a machine without triton: its kernels module (the
    CUDA-only token permutation, not called on the for-loop path) replaced by a stub."""
    name = "torchtitan.models.moe.kernels"
    if name not in sys.modules and importlib.util.find_spec("triton") is None:
        stub = types.ModuleType(name)
        stub.generate_permute_indices = stub.fill_indices_wrapper = None
        sys.modules[name] = stub
    return importlib.import_module("torchtitan.models.moe.moe")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed")
@pytest.mark.parametrize("style", list(STYLES))
def test_torchtitans_own_grouped_experts_match_one_device_at_tp_2(style):
    torch.manual_seed(0)
    reference = _titan_moe().GroupedExperts(dim=16, hidden_dim=32, num_experts=4, use_grouped_mm=False)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.1)
    counts, x = torch.tensor([1, 4, 2, 3]), torch.randn(10, 16)
    want = reference(x, counts)
    want.square().sum().backward()
    for out, grads in _sharded_call(copy.deepcopy(reference), STYLES[style](), 2, x, counts):
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, getattr(reference, name).grad, rtol=1e-5, atol=1e-6)


def test_all_to_all_refuses_the_sorted_call_before_moving_tokens():
    experts = GroupedExperts()
    with simulated_world(2), pytest.raises(ValueError, match="use dispatch: all_reduce"):
        parallelize_module(experts, tp_mesh(2), AllToAllExpertParallel())
        experts(torch.randn(4, 16), torch.tensor([1, 1, 1, 1]))


def test_torchtitan_call_on_real_ranks_runs_each_ranks_exact_slice_and_matches_one_device():
    """Real ranks (torchrun, gloo) take the exact slice, no padding: rank 0's experts 0-1
    compute 3 rows, rank 1's experts 2-3 compute 7."""
    from pathlib import Path

    from test_torchrun import torchrun

    root = Path(__file__).resolve().parent.parent
    result = torchrun(2, "tests/grouped_experts_worker.py", pythonpath=root, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert max(report["diffs"].values()) < 1e-5, report["diffs"]
    assert report["rows"] == [3, 7]
    assert report["forward"] == {"all_reduce": 1} and report["backward"] == {"all_reduce": 1}
