"""Block identity (simulation/blocks.py) is one notion for both callers that cut a model's
repeated blocks: memory planning's block reuse (simulated once) and the lint's collapse
(dry-run on two blocks). A difference that changes what a block computes keeps it apart
in both; what only numbers a block, or each block's own copy of one function module,
merges it in both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tpplan import load_plan
from tpplan.lint.context import LintContext
from tpplan.models import mlp
from tpplan.memory.reuse import BlockReuse, find_run
from tpplan.simulation.blocks import runs

PLAN = Path(__file__).resolve().parent.parent / "plans" / "mlp_tp.yaml"


class _Func(nn.Module):  # a function as a module, as the kernels package makes one
    def forward(self, x):
        return x * torch.sigmoid(x)


def six_blocks() -> mlp.MLP:
    """Six identical blocks, each numbered (`layer_idx`, as transformers' layers) and holding its own
    copy of one function module (`_kernel_funcs`, as transformers 5.25 with the kernels package)."""
    with torch.device("meta"):
        model = mlp.MLP(n_blocks=6)
        for i, block in enumerate(model.blocks):
            block.layer_idx = i
            block.__dict__["_kernel_funcs"] = {"silu": _Func()}
    return model


def merged(model: nn.Module) -> dict[str, object]:
    """What each caller made of the six blocks: reuse's run (or its note), the lint's kept blocks."""
    plan = load_plan(str(PLAN))
    found = find_run(model, plan)
    cuts = LintContext(plan, model, [2]).kept_blocks
    return {"reuse": (found.start, found.stop) if isinstance(found, BlockReuse) else found,
            "lint keeps": [list(kept) for _, kept in cuts]}


def test_blocks_differing_only_in_their_number_and_their_own_copy_of_a_function_module_are_merged_by_both():
    assert merged(six_blocks()) == {"reuse": (0, 6), "lint keeps": [["0", "1"]]}


def _tanh_gelu(block: nn.Module) -> None:
    block.act.approximate = "tanh"  # a setting the forward reads: another function


def _narrower(block: nn.Module) -> None:
    with torch.device("meta"):
        block.in_proj, block.out_proj = nn.Linear(32, 64), nn.Linear(64, 32)  # other shapes, other memory


def _relu(block: nn.Module) -> None:
    block.act = nn.ReLU()  # another class


def _hooked(block: nn.Module) -> None:
    block.register_forward_hook(lambda module, args, output: output * 2)  # what the block returns, changed


@pytest.mark.parametrize("change, where", [
    (_tanh_gelu, "the attribute approximate of 'act'"),
    (_narrower, "the parameter weight of 'in_proj'"),
    (_relu, "the type of 'act'"),
    (_hooked, "the hooks of '<block>'"),
])
def test_a_block_that_computes_otherwise_is_kept_apart_by_both(change, where):
    model = six_blocks()
    change(model.blocks[3])
    assert merged(model) == {
        "reuse": f"no 6 consecutive blocks of 'blocks' are identical ('blocks.3' differs from 'blocks.2' in {where}): all 6 simulated",
        # runs 0-2, 3, 4-5: two of each run are dry-run, and block 3 stands for no other
        "lint keeps": [["0", "1", "3", "4", "5"]],
    }


def test_runs_are_maximal_and_in_order():
    assert runs(["a", "a", "b", "a", "a", "a"]) == [range(0, 2), range(2, 3), range(3, 6)]
    assert runs([]) == []
