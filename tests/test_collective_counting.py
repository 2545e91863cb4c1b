"""tpplan counts collectives with its own dispatch mode (simulate.collective_counter),
not CommDebugMode, whose module tracker breaks models it should only watch: a
module called twice in one forward, and an in-place op on a module's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from tpplan import load_plan
from tpplan.simulation.simulate import collective_name, count_collectives, scalar_loss, simulated_world, tp_mesh

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

PLAN = """\
version: 1
mesh: {axis: tp}
rules:
  up: colwise
  down: rowwise
"""


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.0)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class CalledTwice(Plain):
    """Phi's decoder layer: one dropout module for the attention's and the MLP's outputs."""

    def forward(self, x):
        return self.drop(self.down(self.drop(torch.relu(self.up(x)))))


class ChangedInPlace(Plain):
    """Llama 4's MoE: a module's output changed in place (the routed experts added into the shared one's)."""

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)) + 1)
        h.mul_(2)
        return self.down(h)


def _sharded(cls):
    torch.manual_seed(0)
    model = cls()
    load_plan(text=PLAN).apply(model, tp_mesh(2))
    return model


def test_the_counts_are_comm_debug_modes():
    with simulated_world(2), torch.device("meta"):
        model, x = _sharded(Plain), torch.randn(2, 8, 16, requires_grad=True)
        counted = count_collectives(model, x)
        with CommDebugMode() as forward:
            out = model(x)
        with CommDebugMode() as backward:
            scalar_loss(out).backward()
    theirs = {
        "forward": {collective_name(op): n for op, n in forward.get_comm_counts().items() if n},
        "backward": {collective_name(op): n for op, n in backward.get_comm_counts().items() if n},
    }
    assert counted == theirs == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


@pytest.mark.parametrize("cls, torch_fails", [
    (CalledTwice, "list index out of range"),
    (ChangedInPlace, "Output 0 of BackwardHookFunction(Backward)? is a view and is being modified inplace"),
])
def test_a_module_called_twice_and_an_output_changed_in_place_are_counted_not_failed(cls, torch_fails):
    with simulated_world(2), torch.device("meta"):
        model = _sharded(cls)
        assert count_collectives(model, torch.randn(2, 8, 16)) == {"forward": {"all_reduce": 1}, "backward": {}}
        with pytest.raises((IndexError, RuntimeError), match=torch_fails), CommDebugMode():  # torch's counter fails
            model(torch.randn(2, 8, 16))
