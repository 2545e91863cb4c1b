"""NoParallel (SPEC section 1): a module kept whole on every rank of the TP mesh,
inside a DTensor program. Real per-rank values (fake process group +
LocalTensorMode) and counted collectives (CommDebugMode)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

from tpplan import NoParallel, load_plan
from tpplan.simulation.simulate import collective_name, simulated_world, tp_mesh

TP = 4


class Scaled(nn.Module):
    """A Linear with a buffer; remembers the input it computed on."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.arange(1.0, dim + 1))
        self.seen = None

    def forward(self, x: torch.Tensor, *rest) -> torch.Tensor:
        self.seen = x
        return self.proj(x) * self.scale


def per_rank(tensor: torch.Tensor) -> list[torch.Tensor]:
    """One plain tensor per simulated rank (local values; DTensors are not gathered)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if hasattr(tensor, "trigger_wait"):
        tensor = tensor.trigger_wait()
    return [tensor._local_tensors[rank] for rank in sorted(tensor._local_tensors)]


def collectives(mode: CommDebugMode) -> dict[str, int]:
    return {collective_name(op): n for op, n in mode.get_comm_counts().items() if n}


pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.fixture
def world():
    """TP simulated ranks with real per-rank values; yields (mesh, mode)."""
    with simulated_world(TP), LocalTensorMode(TP) as mode:
        yield tp_mesh(TP), mode


@pytest.fixture
def module():
    torch.manual_seed(0)
    return Scaled()


# -- the style --------------------------------------------------------------------------------


def test_no_parallel_is_a_torch_parallel_style():
    assert issubclass(NoParallel, ParallelStyle)


def test_defaults_are_replicate_everywhere_and_local_output():
    style = NoParallel()
    assert (style.input_layout, style.desired_input_layout, style.output_layout) == (Replicate(), Replicate(), Replicate())
    assert style.use_local_output is True


def test_parameters_and_buffers_become_replicated_dtensors_with_the_same_values(world, module):
    mesh, _ = world
    original = {name: tensor.detach().clone() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
    parallelize_module(module, mesh, NoParallel())
    assert set(original) == {"proj.weight", "proj.bias", "scale"}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert isinstance(tensor, DTensor), name
        assert tensor.device_mesh is mesh and tensor.placements == (Replicate(),)
        for value in per_rank(tensor):
            torch.testing.assert_close(value, original[name])
    assert isinstance(module.proj.weight, nn.Parameter) and module.proj.weight.requires_grad


def test_replicated_module_matches_single_device_forward_and_backward(world, module):
    mesh, _ = world
    reference = copy.deepcopy(module)
    x = torch.randn(4, 6)
    want = reference(x)
    want.pow(2).sum().backward()

    parallelize_module(module, mesh, NoParallel())
    with CommDebugMode() as comms:
        out = module(x)
    assert not isinstance(out, DTensor)
    assert collectives(comms) == {}  # replicated in, replicated out: nothing to move
    for value in per_rank(out):
        torch.testing.assert_close(value, want)
    out.pow(2).sum().backward()
    for value in per_rank(module.proj.weight.grad):
        torch.testing.assert_close(value, reference.proj.weight.grad)


# -- input and output layouts --------------------------------------------------------------------


def test_sharded_input_is_all_gathered_so_the_module_sees_all_of_it(world, module):
    mesh, mode = world
    parallelize_module(module, mesh, NoParallel(input_layout=Shard(0), desired_input_layout=Replicate()))
    # each rank holds two rows of an (8, 6) batch: rank r's rows are all r
    x = mode.rank_map(lambda rank: torch.full((2, 6), float(rank)))
    with CommDebugMode() as comms:
        module(x)
    assert collectives(comms) == {"all_gather": 1}
    seen = module.seen
    assert isinstance(seen, DTensor) and seen.placements == (Replicate(),) and seen.shape == (2 * TP, 6)
    full_batch = torch.arange(float(TP)).repeat_interleave(2)[:, None].expand(2 * TP, 6)
    for value in per_rank(seen):
        torch.testing.assert_close(value, full_batch)


def test_sharded_output_layout_hands_each_rank_its_shard(world, module):
    mesh, _ = world
    reference = copy.deepcopy(module)
    x = torch.randn(8, 6)
    parallelize_module(module, mesh, NoParallel(output_layout=Shard(0)))
    out = module(x)
    assert not isinstance(out, DTensor)
    for rank, value in enumerate(per_rank(out)):
        torch.testing.assert_close(value, reference(x).chunk(TP)[rank])


def test_use_local_output_false_returns_a_dtensor_in_the_output_layout(world, module):
    mesh, _ = world
    reference = copy.deepcopy(module)
    x = torch.randn(8, 6)
    parallelize_module(module, mesh, NoParallel(output_layout=Shard(1), use_local_output=False))
    out = module(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),) and out.shape == (8, 6)
    for value in per_rank(out.full_tensor()):
        torch.testing.assert_close(value, reference(x))


def test_dtensor_input_is_redistributed_not_reannotated(world, module):
    mesh, _ = world
    # input_layout only applies to plain tensors; a DTensor already knows its layout
    parallelize_module(module, mesh, NoParallel(input_layout=Replicate()))
    x = DTensor.from_local(torch.ones(2, 6), mesh, (Partial(),))
    with CommDebugMode() as comms:
        module(x)
    assert collectives(comms) == {"all_reduce": 1}
    for value in per_rank(module.seen):
        torch.testing.assert_close(value, torch.full((2, 6), float(TP)))


def test_non_tensor_first_input_is_a_style_input_error_with_its_fix(world, module):
    from tpplan.core.problems import StyleInputError

    mesh, _ = world
    parallelize_module(module, mesh, NoParallel())
    with pytest.raises(StyleInputError, match="^no_parallel on Scaled needs a tensor as its first positional input, got list; ") as caught:
        module([torch.ones(2, 6)])
    assert caught.value.fix == "put the rule on a module called with a tensor first, or on its parent"
    with pytest.raises(StyleInputError, match="got no positional input; "):
        module(x=torch.ones(2, 6))


def test_other_positional_inputs_pass_through_untouched(world, module):
    mesh, _ = world
    parallelize_module(module, mesh, NoParallel())
    marker = object()
    seen_rest = []
    module.register_forward_pre_hook(lambda _, args: seen_rest.extend(args[1:]))
    module(torch.ones(2, 6), marker, 3)
    assert seen_rest == [marker, 3]


# -- inside a plan, and with torch's own parallelize_module ---------------------------------------


class Block(nn.Module):
    """A parent with its own parameter around two Linears."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + self.bias


def test_parent_no_parallel_keeps_the_childs_colwise_shard(world):
    mesh, _ = world
    torch.manual_seed(0)
    model = Block()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8)
    plan = load_plan(
        text="version: 1\nrules:\n  '': no_parallel\n  up: {style: colwise, output_layouts: replicate, use_local_output: false}\n"
    )
    plan.apply(model, mesh)
    assert model.up.weight.placements == (Shard(0),) and model.up.weight.to_local().shape == (16 // TP, 8)
    assert model.down.weight.placements == (Replicate(),) and model.bias.placements == (Replicate(),)
    out = model(x)
    for value in per_rank(out):
        torch.testing.assert_close(value, reference(x))


def test_works_with_torchs_own_parallelize_module(world):
    mesh, _ = world
    torch.manual_seed(0)
    model = Block()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8)
    parallelize_module(
        model,
        mesh,
        {"up": ColwiseParallel(output_layouts=Replicate(), use_local_output=False), "down": NoParallel(use_local_output=False)},
    )
    assert model.up.weight.placements == (Shard(0),) and model.down.weight.placements == (Replicate(),)
    assert not isinstance(model.bias, DTensor)  # not named in the plan: left alone
    out = model.down(torch.relu(model.up(x)))
    for value in per_rank(out.full_tensor()):
        torch.testing.assert_close(value, reference.down(torch.relu(reference.up(x))))


def test_no_parallel_from_a_plan_honours_its_options(world, module):
    mesh, _ = world
    plan = load_plan(text="version: 1\nrules:\n  proj: {style: no_parallel, output_layout: shard(0), use_local_output: false}\n")
    [style] = plan.resolve(module).values()
    assert isinstance(style, NoParallel)
    assert (style.output_layout, style.use_local_output, style.input_layout) == (Shard(0), False, Replicate())
