"""Shipped plans against the single-device model, simulated in one process.

Each plan runs at every TP degree it promises (`mesh.sizes`) under a fake
process group with real per-rank values (LocalTensorMode): outputs and every
parameter gradient must equal the single-device run, and the collectives of
one forward and backward must be exactly the counts of tests/expected.py.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from expected import llama_comms, mlp_comms
from tpplan import load_plan
from tpplan.models import llama, mlp
from tpplan.check.verify import check_parity
from tpplan.simulation.simulate import (
    collective_name,
    count_collectives,
    default_inputs,
    output_tensors,
    simulated_world,
    tp_mesh,
)

PLANS = Path(__file__).resolve().parent.parent / "plans"
LAYERS = llama.tiny().config.n_layers  # 2

# Counts of one forward / backward, the same at every TP degree.
SHIPPED = {
    "llama_tp.yaml": (llama.tiny, llama_comms("llama_tp.yaml", LAYERS)),
    "llama_tp_sp.yaml": (llama.tiny, llama_comms("llama_tp_sp.yaml", LAYERS)),
    "mlp_tp.yaml": (mlp.tiny, mlp_comms(len(mlp.tiny().blocks))),
}
assert LAYERS == 2  # the literal counts in the test ids below assume it


def _cases():
    for file, (build, comms) in SHIPPED.items():
        for tp in load_plan(PLANS / file).mesh_sizes:
            yield pytest.param(file, build, comms, tp, id=f"{file.removesuffix('.yaml')}-tp{tp}")


pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.mark.parametrize("file, build, comms, tp", _cases())
def test_shipped_plan_matches_single_device_with_exact_collective_counts(file, build, comms, tp):
    result = check_parity(build, load_plan(PLANS / file), tp)
    assert result.passed, result.problems
    assert result.max_abs_diff < 1e-5
    assert result.comms == comms


def test_every_parameter_gradient_is_compared():
    result = check_parity(llama.tiny, load_plan(PLANS / "llama_tp_sp.yaml"), 2)
    assert set(result.grad_diffs) == {name for name, _ in llama.tiny().named_parameters()}


NAIVE_LLAMA_TP = """
version: 1
rules:
  tok_embeddings: {style: rowwise, input_layouts: replicate}
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: rowwise
  layers.*.feed_forward.w{1,3}: colwise
  layers.*.feed_forward.w2: rowwise
  output: {style: colwise, output_layouts: replicate}
"""


def test_per_linear_plan_all_reduces_each_column_parallel_input_grad_separately():
    # Why llama_tp.yaml keeps attention/feed_forward inputs as one DTensor: without it,
    # wq, wk, wv, w1 and w3 each all-reduce their input grad (5 per layer, not 2).
    result = check_parity(llama.tiny, load_plan(text=NAIVE_LLAMA_TP), 2)
    assert result.passed, result.problems
    assert result.comms == {
        "forward": {"all_gather": 1, "all_reduce": 2 * LAYERS + 1},
        "backward": {"all_reduce": 5 * LAYERS + 1},
    }


def test_parity_check_catches_a_plan_that_leaves_partial_sums():
    # Row-parallel wo whose partial sums are never reduced: every rank sees a wrong output.
    broken = NAIVE_LLAMA_TP.replace("layers.*.attention.wo: rowwise", "layers.*.attention.wo: {style: rowwise, output_layouts: partial}")
    result = check_parity(llama.tiny, load_plan(text=broken), 2)
    assert not result.passed
    assert result.out_diff > 1e-2
    assert any(problem.startswith("output: rank 0 differs") for problem in result.problems)


def test_parity_check_reports_a_shape_mismatch_instead_of_raising():
    # Sharded logits handed back as local tensors: each rank holds vocab / tp columns.
    sharded_head = NAIVE_LLAMA_TP.replace("output: {style: colwise, output_layouts: replicate}", "output: colwise")
    result = check_parity(llama.tiny, load_plan(text=sharded_head), 2)
    assert not result.passed
    assert "output: rank 0 has shape (2, 8, 128), single device (2, 8, 256)" in result.problems


def test_collectives_are_counted_on_meta_without_per_rank_values():
    # What `tpplan apply --dry-run` does: Llama 3 8B at TP 8, no memory, no values.
    plan = load_plan(PLANS / "llama_tp.yaml")
    with simulated_world(8):
        mesh = tp_mesh(8)
        with torch.device("meta"):
            model = llama.llama3_8b()
            plan.apply(model, mesh)
            comms = count_collectives(model, default_inputs(model, batch=1, seq=16))
        assert model.layers[0].attention.wk.weight.to_local().shape == (1024 // 8, 4096)
    assert comms == {"forward": {"all_gather": 1, "all_reduce": 65}, "backward": {"all_reduce": 65}}


def test_simulated_worlds_of_different_sizes_follow_each_other():
    for size in (2, 8, 4):
        with simulated_world(size):
            assert dist.get_world_size() == size
            assert tp_mesh(size, "tp").mesh_dim_names == ("tp",)
        assert not dist.is_initialized()


def test_simulated_world_nests_for_the_same_size_and_refuses_another():
    with simulated_world(2):
        with simulated_world(2):
            pass
        assert dist.is_initialized()
        with pytest.raises(RuntimeError, match=r"cannot simulate 4 ranks: a process group \(fake, world size 2\)"):
            with simulated_world(4):
                pass
    assert not dist.is_initialized()


def test_default_inputs_are_token_ids_below_num_embeddings_for_an_embedding():
    tokens = default_inputs(llama.tiny(), batch=3, seq=5)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 256


def test_default_inputs_are_floats_of_in_features_for_a_linear():
    x = default_inputs(mlp.tiny())
    assert x.shape == (2, 8, 32) and x.dtype == torch.float32


def test_default_inputs_follow_the_model_onto_meta():
    with torch.device("meta"):
        model = llama.tiny()
    assert default_inputs(model).is_meta


class _NormedEmbedding(torch.nn.Embedding):
    """Inkling's embedding: an Embedding holding its RMSNorm as a child."""

    def __init__(self, num, dim):
        super().__init__(num, dim)
        self.embed_norm = torch.nn.RMSNorm(dim)

    def forward(self, ids):
        return self.embed_norm(super().forward(ids))


def test_default_inputs_are_token_ids_for_an_embedding_with_children():
    model = torch.nn.Sequential(_NormedEmbedding(100, 4), torch.nn.Linear(4, 4))
    tokens = default_inputs(model, batch=3, seq=5)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.long and tokens.max() < 100


def test_default_inputs_pass_over_a_container_s_own_parameters_to_its_first_leaf():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 4))
    model.position = torch.nn.Parameter(torch.zeros(8, 4))  # a learned table on the root: not where the inputs go
    assert default_inputs(model).dtype == torch.long


def test_default_inputs_name_the_first_module_they_cannot_feed():
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"but '0' is a LayerNorm; pass the inputs explicitly"):
        default_inputs(model)


@pytest.mark.parametrize(
    "op, name",
    [
        ("c10d_functional.all_reduce", "all_reduce"),
        ("c10d_functional.all_gather_into_tensor", "all_gather"),
        ("c10d_functional.reduce_scatter_tensor", "reduce_scatter"),
        ("c10d_functional.all_to_all_single", "all_to_all"),
        ("c10d_functional.broadcast", "broadcast"),
        ("c10d.allreduce_", "all_reduce"),
        ("c10d._allgather_base_", "all_gather"),
        ("c10d._reduce_scatter_base_", "reduce_scatter"),
        ("_dtensor.shard_dim_alltoall", "all_to_all"),
        ("c10d.scatter_", "scatter"),
    ],
)
def test_collective_ops_are_named_as_in_the_spec(op, name):
    assert collective_name(op) == name


def test_output_tensors_unwrap_tuples_dicts_and_model_outputs():
    a, b = torch.ones(1), torch.zeros(2)

    class Output:
        logits = a

    assert output_tensors((a, {"x": b, "ids": torch.ones(1, dtype=torch.long)})) == [a, b]
    assert output_tensors(Output()) == [a]


def test_counting_leaves_a_model_that_adds_into_a_submodule_output_in_place_working():
    # CommDebugMode's module tracker returns every module output as a view of a backward
    # hook's custom Function: an in-place add into one (Llama 4's MoE does) raised there
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class AddsInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
            self.shared = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            out = self.shared(x)
            out.add_(self.down(self.up(x)))
            return out

    with simulated_world(2):
        model = AddsInPlace()
        parallelize_module(model, tp_mesh(2), {"up": ColwiseParallel(), "down": RowwiseParallel()})
        comms = count_collectives(model, torch.randn(2, 8, requires_grad=True))
    assert comms == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
