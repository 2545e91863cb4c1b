"""Activation checkpointing from a version 2 plan's `checkpointing` section (SPEC §7):
after the TP rules, before FSDP2, with torch's composable `checkpoint` (full) or its
op-level SAC (selective). What it changes is what backward keeps: fewer tensors saved
in forward, the same values and gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpplan import load_plan
from tpplan.core.problems import PlanError

from test_torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
TINY = "tpplan.models.llama:tiny"


def _plan(tmp_path: Path, checkpointing: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh:\n  tp: 2\n{checkpointing}")
    return path


def _saved_bytes_and_grads(plan_path: Path | None):
    """Bytes saved for backward in one forward of a tiny Llama at TP 2 (rank 0 of the
    fake world, real values), and the gradients of the loss."""
    import torch

    from tpplan.models.llama import tiny
    from tpplan.simulation.simulate import simulated_world, tp_mesh

    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes() if not hasattr(tensor, "to_local") else tensor.to_local().untyped_storage().nbytes())
        return tensor

    with simulated_world(2):
        torch.manual_seed(0)
        model = tiny()
        if plan_path is not None:
            plan = load_plan(plan_path)
            plan.apply(model, tp_mesh(2, plan.mesh_axis))
        tokens = torch.randint(0, 256, (2, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(tokens).float().pow(2).mean()
        during = sum(saved)
        loss.backward()
        grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for name, p in model.named_parameters()}
    return during, grads


def test_full_and_selective_checkpointing_save_less_for_backward_and_change_no_gradient(tmp_path):
    import torch

    none, grads = _saved_bytes_and_grads(_plan(tmp_path, ""))
    full, full_grads = _saved_bytes_and_grads(_plan(tmp_path, "checkpointing:\n  modules: layers.*\n"))
    selective, selective_grads = _saved_bytes_and_grads(_plan(tmp_path, "checkpointing:\n  modules: layers.*\n  mode: selective\n"))
    # saved_tensors_hooks see what autograd keeps; SAC keeps its saved ops' outputs in its own cache
    assert full == selective < none / 5, (full, selective, none)
    for name, grad in grads.items():
        torch.testing.assert_close(full_grads[name], grad)
        torch.testing.assert_close(selective_grads[name], grad)
    assert set(full_grads) == set(grads)  # the parameter names stay: composable checkpoint wraps nothing


def _backward_ops(tmp_path: Path, checkpointing: str) -> dict[str, int]:
    """How often backward runs a matmul and a SiLU, with the plan's checkpointing and
    no TP rule (plain tensors: the ops as they run)."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpplan.models.llama import tiny

    path = tmp_path / "ac.yaml"
    path.write_text(f"version: 2\nrules: {{}}\nmesh:\n  tp: 1\n{checkpointing}")
    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = tiny()
    plan = load_plan(path)
    from tpplan.sharding.activation_checkpoint import apply_activation_checkpointing

    apply_activation_checkpointing(plan, model)
    loss = model(torch.randint(0, 256, (2, 16))).float().pow(2).mean()
    with Count():
        loss.backward()
    return {"mm": counts["mm"], "silu": counts["silu"]}


def test_full_checkpointing_recomputes_the_matmuls_selective_keeps_them_and_recomputes_the_rest(tmp_path):
    none = _backward_ops(tmp_path, "")
    full = _backward_ops(tmp_path, "checkpointing:\n  modules: layers.*\n")
    selective = _backward_ops(tmp_path, "checkpointing:\n  modules: layers.*\n  mode: selective\n")
    assert none["silu"] == 0 and full["silu"] == selective["silu"] == 2  # each block's SiLU runs again
    assert full["mm"] > none["mm"] == selective["mm"], (none, full, selective)  # SAC saved the matmuls' outputs


def test_checkpointing_modules_that_match_nothing_are_the_plans_located_error(tmp_path):
    path = _plan(tmp_path, "checkpointing:\n  modules: [layers.*, blocks.*]\n")
    with pytest.raises(PlanError) as info:
        _saved_bytes_and_grads(path)
    problem = info.value.problems[0]
    assert (problem.code, problem.line, problem.column) == ("TP200", 7, 23)  # at the glob itself
    assert "checkpointing.modules: 'blocks.*' matches no module" in problem.message


def test_selective_checkpointing_by_tp_on_two_gloo_ranks_matches_one_device_after_adamw_steps(tmp_path):
    path = _plan(tmp_path, "checkpointing:\n  modules: layers.*\n  mode: selective\n")
    result = torchrun(2, "-m", "tpplan", "apply", "--model", TINY, "--plan", str(path), "--check", "--steps", "2", "--format", "json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["check"]["passed"] and report["steps"]["max_abs_diff"] < 1e-4
    assert "activation checkpointing (selective) on 2 module(s) (layers.*)" in report["notes"]
