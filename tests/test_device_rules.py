"""The simulation is faithful to CUDA: SDPA's CPU form gets the DTensor rule of
its CUDA forms inside a simulated world (and only there), and an op with no rule
on any device is TP507 at the rule whose DTensor output reached it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpplan import load_plan
from tpplan.lint import lint_model
from tpplan.simulation.device_rules import cuda_rules, faithful_ops
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions
from tpplan.simulation.simulate import simulated_world, tp_mesh

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _propagator():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def test_the_faithful_ops_are_the_cpu_flash_attention_forward_and_backward():
    assert faithful_ops() == [
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    ]


@pytest.mark.parametrize("layout", ["shard(1)", "shard(0)", "replicate"])
def test_sdpa_on_dtensors_matches_one_device_and_keeps_the_layout(layout):
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placement = {"shard(1)": Shard(1), "shard(0)": Shard(0), "replicate": Replicate()}[layout]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=generator, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.pow(2).sum().backward()
    with simulated_world(2), LocalTensorMode(2):
        mesh = tp_mesh(2)
        dq, dk, dv = (distribute_tensor(t.detach(), mesh, [placement]).requires_grad_() for t in (q, k, v))
        got = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        got.pow(2).sum().backward()
        assert got.placements == (placement,) and dq.grad.placements == (placement,)
        torch.testing.assert_close(got.full_tensor(), want)
        for grad, expected in ((dq.grad, q.grad), (dk.grad, k.grad), (dv.grad, v.grad)):
            torch.testing.assert_close(grad.full_tensor(), expected)


def test_a_head_sharded_mask_is_laid_out_like_q():
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(1)
    q, k, v, mask = (torch.randn(2, 4, 8, size, generator=generator) for size in (16, 16, 16, 8))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with simulated_world(2), LocalTensorMode(2):
        mesh = tp_mesh(2)
        got = F.scaled_dot_product_attention(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v, mask)))
        assert got.placements == (Shard(1),)
        torch.testing.assert_close(got.full_tensor(), want)


def test_rules_exist_only_inside_the_simulation_and_restore_what_was_there():
    propagator = _propagator()
    assert CPU_FLASH not in propagator.op_strategy_funcs
    with simulated_world(2):
        assert CPU_FLASH in propagator.op_strategy_funcs
    assert CPU_FLASH not in propagator.op_strategy_funcs

    def theirs(op_schema):
        raise AssertionError("not called")

    propagator.op_strategy_funcs[CPU_FLASH] = theirs
    try:
        with cuda_rules(), cuda_rules():
            assert propagator.op_strategy_funcs[CPU_FLASH] is not theirs
        assert propagator.op_strategy_funcs[CPU_FLASH] is theirs
    finally:
        del propagator.op_strategy_funcs[CPU_FLASH]


class Renorm(nn.Module):
    """A Linear whose output is renormalised: torch has no DTensor rule for renorm."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(torch.renorm(self.proj(x), 2, 0, 1.0))


def renorm_model():
    return Renorm()


PLAN = """\
version: 1
rules:
  proj: {style: colwise, use_local_output: false}
  out: rowwise
"""


def test_an_op_without_a_rule_on_any_device_is_tp507_at_the_rule_whose_dtensor_reached_it(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(PLAN)
    report = dry_run(ApplyOptions(plan=str(plan), model="test_device_rules:renorm_model", tp=2))
    [problem] = report.problems
    assert (problem.code, problem.line, problem.column) == ("TP507", 3, 3)
    assert problem.message.startswith(
        "torch has no DTensor rule for aten.renorm on cuda (nor on the simulating CPU), reached in the forward of "
        "'<root>' at TP 2: the plan runs into a limit of torch, not a mistake of its own; DTensor inputs reach it "
        "from rule 'proj' (colwise, "
    )


def test_the_lint_says_torchs_limit_as_a_warning_not_the_plans_failure():
    with torch.device("meta"):
        model = Renorm()
    problems = lint_model(load_plan(text=PLAN, file="p.yaml"), model, [2])
    assert [(p.code, p.severity, p.line) for p in problems] == [("TP330", "warning", 3)]
    assert "the shape-level dry run stops at a limit of torch (TP507): torch has no DTensor rule for aten.renorm" in problems[0].message
