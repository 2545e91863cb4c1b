"""A loaded plan against real torch models: match, resolve, apply over a mesh
axis, src_data_rank and the fingerprint. Values are real per simulated rank
(fake process group + LocalTensorMode), so parity is checked rank by rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tpplan import PlanError, load_plan
from tpplan.simulation.simulate import simulated_world, tp_mesh


class TwoLinear(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.act = nn.ReLU()
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


MEGATRON = "version: 1\nrules:\n  up: colwise\n  down: rowwise\n"


def per_rank(tensor: torch.Tensor) -> list[torch.Tensor]:
    """One plain tensor per simulated rank (DTensors gathered to full size first)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if hasattr(tensor, "trigger_wait"):  # an AsyncCollectiveTensor around the rank values
        tensor = tensor.trigger_wait()
    return [tensor._local_tensors[rank] for rank in sorted(tensor._local_tensors)]


pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.fixture
def reference():
    """A seeded TwoLinear, an input, and its single-device output and gradients."""
    torch.manual_seed(0)
    model = TwoLinear()
    x = torch.randn(3, 5, 8)
    out = model(x)
    out.pow(2).sum().backward()
    return model, x, out.detach()


def assert_parity(reference, mesh, tp: int):
    model, x, want = reference
    plan = load_plan(text=MEGATRON)
    sharded = copy.deepcopy(model)
    sharded.zero_grad()
    assert plan.apply(sharded, mesh) is sharded

    assert isinstance(sharded.up.weight, DTensor) and sharded.up.weight.placements == (Shard(0),)
    assert sharded.up.weight.to_local().shape == (16 // tp, 8)
    assert sharded.down.weight.placements == (Shard(1),) and sharded.down.weight.to_local().shape == (8, 16 // tp)

    out = sharded(x)
    out.pow(2).sum().backward()
    for value in per_rank(out):
        torch.testing.assert_close(value, want)
    for name, param in sharded.named_parameters():
        for grad in per_rank(param.grad):
            torch.testing.assert_close(grad, model.get_parameter(name).grad, msg=lambda m, name=name: f"{name}: {m}")


# -- match and resolve ----------------------------------------------------------------------


def test_match_takes_a_model_or_its_module_names():
    plan = load_plan(text=MEGATRON)
    model = TwoLinear()
    assert {fqn: rule.pattern for fqn, rule in plan.match(model).items()} == {"up": "up", "down": "down"}
    assert list(plan.match(name for name, _ in model.named_modules())) == ["up", "down"]


def test_resolve_compiles_each_matched_module_in_module_order():
    plan = load_plan(text="version: 1\nrules:\n  down: rowwise\n  up: {style: colwise, use_local_output: false}\n")
    styles = plan.resolve(TwoLinear())
    assert list(styles) == ["up", "down"]
    assert isinstance(styles["up"], ColwiseParallel) and styles["up"].use_local_output is False
    assert isinstance(styles["down"], RowwiseParallel)


def test_resolve_against_a_model_is_strict():
    plan = load_plan(text="version: 1\nrules:\n  up: colwise\n  donw: rowwise\n")
    with pytest.raises(PlanError) as info:
        plan.resolve(TwoLinear())
    [problem] = info.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP200", 4, 3)
    assert "did you mean 'down'?" in problem.message


def test_claim_returns_what_match_raises_and_what_does_resolve():
    plan = load_plan(text="version: 1\nrules:\n  down: rowwise\n  '*': colwise\n  donw: rowwise\n")
    claimed, problems = plan.claim(TwoLinear())
    assert {fqn: rule.pattern for fqn, rule in claimed.items()} == {"up": "*", "act": "*", "down": "down"}  # first rule wins
    with pytest.raises(PlanError) as info:
        plan.match(TwoLinear())
    assert problems == info.value.problems and [p.code for p in problems] == ["TP201", "TP200"]


def test_a_plan_that_does_not_match_leaves_the_model_untouched():
    plan = load_plan(text="version: 1\nrules:\n  up: colwise\n  donw: rowwise\n")
    model = TwoLinear()
    with simulated_world(2):
        with pytest.raises(PlanError):
            plan.apply(model, tp_mesh(2))
    assert not any(isinstance(p, DTensor) for p in model.parameters())


# -- apply --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_rowwise_plan_matches_single_device_on_every_rank(reference, tp):
    with simulated_world(tp), LocalTensorMode(tp):
        assert_parity(reference, tp_mesh(tp), tp)


def test_two_dimensional_mesh_shards_over_the_tp_axis(reference):
    with simulated_world(4), LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert_parity(reference, mesh, tp=2)


def test_plan_mesh_axis_picks_the_dim_of_a_two_dimensional_mesh():
    plan = load_plan(text="version: 1\nmesh: {axis: model}\nrules:\n  up: colwise\n")
    with simulated_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("model", "data"))
        assert plan.tp_mesh(mesh).mesh_dim_names == ("model",) and plan.tp_mesh(mesh).size() == 2
        with torch.device("meta"):
            model = plan.apply(TwoLinear(), mesh)
        assert model.up.weight.device_mesh.mesh_dim_names == ("model",)
        assert model.up.weight.to_local().shape == (8, 8)


def test_missing_mesh_axis_is_a_clear_error():
    plan = load_plan(text="version: 1\nmesh: {axis: tp}\nrules:\n  up: colwise\n")
    with simulated_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        with pytest.raises(ValueError) as info:
            plan.apply(TwoLinear(), mesh)
    assert str(info.value) == (
        "the plan shards over mesh axis 'tp' but the 2-D mesh has dims ('dp', 'cp'): name one dim 'tp' "
        "(init_device_mesh(..., mesh_dim_names=...)) or set mesh.axis in the plan"
    )


def test_one_dimensional_mesh_is_used_whatever_its_name():
    plan = load_plan(text="version: 1\nmesh: {axis: tp}\nrules:\n  up: colwise\n")
    with simulated_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
        assert plan.tp_mesh(mesh) is mesh


# -- src_data_rank ------------------------------------------------------------------------------


def _rank_numbered_weights(mode: LocalTensorMode, model: TwoLinear) -> None:
    """Give rank r an `up` weight full of r, as if each rank had initialised its own."""
    weight = mode.rank_map(lambda rank: torch.full((16, 8), float(rank)))
    model.up.weight = nn.Parameter(weight)


# (Only 0 or null: one process simulates the ranks as rank 0, and LocalTensorMode
# can scatter only from the rank the process is.)
@pytest.mark.parametrize("src_data_rank, expected", [("null", [0.0, 1.0, 2.0, 3.0]), ("0", [0.0] * 4)])
def test_src_data_rank_picks_whose_weights_are_sharded(src_data_rank, expected):
    plan = load_plan(text=f"version: 1\nsrc_data_rank: {src_data_rank}\nrules:\n  up: colwise\n")
    with simulated_world(4), LocalTensorMode(4) as mode:
        model = TwoLinear()
        _rank_numbered_weights(mode, model)
        plan.apply(model, tp_mesh(4))
        shards = per_rank(model.up.weight.to_local())
    assert [shard.shape for shard in shards] == [(4, 8)] * 4
    assert [shard.unique().tolist() for shard in shards] == [[value] for value in expected]


def test_src_data_rank_null_keeps_each_ranks_replicated_weights_different():
    plan = load_plan(text="version: 1\nsrc_data_rank: null\nrules:\n  up: no_parallel\n")
    with simulated_world(2), LocalTensorMode(2) as mode:
        model = TwoLinear()
        _rank_numbered_weights(mode, model)
        plan.apply(model, tp_mesh(2))
        assert model.up.weight.placements == (Replicate(),)
        weights = per_rank(model.up.weight.to_local())
    assert [w.unique().tolist() for w in weights] == [[0.0], [1.0]]


# -- fingerprint ------------------------------------------------------------------------------


PLAN = """\
version: 1
name: mlp
mesh: {axis: tp, sizes: [2, 4]}
rules:
  blocks.*.in_proj: colwise
  blocks.*.out_proj: {style: rowwise, output_layouts: shard(1)}
"""

SAME_PLAN_REFORMATTED = """\
# the same plan, written differently
version: 1
name: another name
description: and a description
rules:
  "blocks.*.out_proj":
    style: rowwise
    output_layouts: Shard( 1 )
    use_local_output: true   # the default, spelled out
  blocks.*.in_proj: {style: colwise}
mesh:
  sizes:
    - 2
    - 4
src_data_rank: 0
"""


def test_fingerprint_ignores_formatting_names_defaults_and_rule_order():
    assert load_plan(text=PLAN).fingerprint() == load_plan(text=SAME_PLAN_REFORMATTED).fingerprint()


@pytest.mark.parametrize(
    "old, new",
    [
        ("in_proj: colwise", "in_proj: rowwise"),  # style
        ("output_layouts: shard(1)", "output_layouts: shard(0)"),  # option
        ("blocks.*.in_proj", "blocks.?.in_proj"),  # glob
        ("sizes: [2, 4]", "sizes: [2, 4, 8]"),  # promised degrees
        ("axis: tp", "axis: model"),  # mesh axis
        ("version: 1\n", "version: 1\nsrc_data_rank: null\n"),
        ("version: 1\n", "version: 1\nloss_parallel: true\n"),
    ],
)
def test_fingerprint_changes_with_the_meaning(old, new):
    changed = PLAN.replace(old, new)
    assert changed != PLAN
    assert load_plan(text=changed).fingerprint() != load_plan(text=PLAN).fingerprint()
