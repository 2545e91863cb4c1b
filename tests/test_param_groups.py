"""Optimizers over a plan that leaves parameters whole: torch's foreach (and fused)
AdamW, the default on CUDA, refuses one call over DTensors and plain tensors;
`tpplan.param_groups` keeps them in separate groups, with the same steps."""

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tpplan import load_plan, param_groups
from tpplan.models import llama
from tpplan.simulation.simulate import default_inputs, local_ranks, simulated_world, tp_mesh

PLANS = Path(__file__).resolve().parent.parent / "plans"

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def _steps(model, params, inputs, foreach, steps=3):
    optimizer = torch.optim.AdamW(params, lr=1e-2, foreach=foreach)
    for _ in range(steps):
        model(inputs).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _per_rank(param):
    """Every rank's whole value (a plain parameter is one value on every rank)."""
    value = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return [value._local_tensors[r] for r in range(2)] if hasattr(value, "_local_tensors") else [value] * 2


def test_foreach_adamw_over_param_groups_steps_as_the_one_tensor_at_a_time_loop():
    torch.manual_seed(0)
    grouped, looped = llama.tiny(), llama.tiny()
    looped.load_state_dict(grouped.state_dict())
    inputs = default_inputs(grouped, 2, 16)
    with simulated_world(2), local_ranks(2):
        for model in (grouped, looped):
            load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(2))  # the norms stay plain tensors
        groups = param_groups(grouped)
        assert [all(isinstance(p, DTensor) for p in g["params"]) for g in groups] == [True, False]
        assert sum(len(g["params"]) for g in groups) == len(list(grouped.parameters()))
        _steps(grouped, groups, inputs, foreach=True)
        _steps(looped, looped.parameters(), inputs, foreach=False)
        for (name, got), want in zip(grouped.named_parameters(), looped.parameters()):
            torch.testing.assert_close(_per_rank(got), _per_rank(want), rtol=1e-6, atol=1e-7, msg=name)


def test_foreach_adamw_over_one_group_mixing_dtensors_and_plain_tensors_fails():
    """What param_groups avoids (under LocalTensorMode plain tensors become per-rank
    values, so this runs on the fake process group alone, as rank 0)."""
    model = llama.tiny()
    with simulated_world(2):
        load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(2))
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            _steps(model, model.parameters(), default_inputs(model, 2, 16), foreach=True, steps=1)
