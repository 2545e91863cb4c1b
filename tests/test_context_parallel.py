"""Context parallelism from a version 2 plan's `context_parallel` section (issue 28 item 4,
SPEC §7): torch's own ring attention on the modules the plan names, with its rotate
method, head-tail load balance and sequence-sharded buffers, applied by `Plan.apply`
between the TP rules and FSDP2.

torch 2.13 runs it on CUDA only, so these tests run it in one CPU process: each cp rank a
thread of torch's threaded process group (real collectives between the threads; the ring
branches on its rank, which LocalTensorMode's one program over all ranks cannot), inside
`context_parallel_rules()`, where the CPU SDPA kernel runs in torch's ring as CUDA's
kernels do on a GPU. Everything else (the ring's loop, rotation, causal schedule and merge,
the load balancer, the sharding of buffers and batches) is torch's own code.
"""

from __future__ import annotations

import copy
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor.experimental._context_parallel  # noqa: F401  torch's CP imported before any simulation, as in a user's process
from torch import nn

from tpplan import load_plan
from tpplan.core.axes import mesh_dims
from tpplan.core.problems import PlanError
from tpplan.check.context_parallel import model_parity, ring_parity
from tpplan.models import positional
from tpplan.simulation.device_rules import context_parallel_rules

from test_torchrun import torchrun
from threaded_world import run_threaded

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32


def _plan(tmp_path: Path, cp: int, rotate: str = "allgather", load_balance: str = "headtail", modules: str = "layers.*.attention",
          buffers: str = "{positions: 0}", more: str = "") -> Path:
    path = tmp_path / "cp.yaml"
    path.write_text(textwrap.dedent(f"""\
        version: 2
        name: cp-test
        mesh: {{cp: {cp}, tp: 1}}
        rules: {{}}
        context_parallel:
          modules: {modules}
          rotate: {rotate}
          load_balance: {load_balance}
          buffers: {buffers}
        """) + more)
    return path


@pytest.mark.parametrize("cp, rotate", [(2, "allgather"), (2, "alltoall"), (4, "allgather"), (4, "alltoall")])
def test_ring_attention_equals_full_attention_forward_and_backward(tmp_path, cp, rotate):
    """torch's ring attention over cp ranks, causal, head-tail balanced, against one
    full SDPA: the output and the gradients of q, k and v, gathered back in order."""
    plan = load_plan(_plan(tmp_path, cp, rotate, modules="attention", buffers="{}"))
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64) for _ in range(4))  # (batch, heads, seq, head_dim)

    with context_parallel_rules():
        ranks = run_threaded(cp, lambda _: ring_parity(plan, plan.build_mesh(cp), q, k, v, grad))
    # the ring merges its blocks in float32 (torch's convert_to_f32), as on a GPU
    assert max(max(diffs.values()) for diffs, _, _ in ranks) < 1e-6, ranks
    # The rotation the plan names: forward and backward each all-gather this rank's k and v
    # once, or pass them round the ring (cp - 1 all-to-alls); the backward passes the k and
    # v gradients round by all-to-all (cp of them) either way, in float32.
    kv, dkv = 2 * q.numel() // cp * q.element_size(), 2 * q.numel() // cp * 4
    for _, _, found in ranks:
        if rotate == "allgather":
            assert found == Counter({("all_gather", kv): 2, ("all_to_all", dkv): cp})
        else:
            assert found == Counter({("all_to_all", kv): 2 * (cp - 1), ("all_to_all", dkv): cp})


def _positions_shape(plan, mesh) -> tuple[int, ...]:
    """The positions buffer of a fresh model on this rank once the plan is applied."""
    model = positional.tiny()
    plan.apply(model, mesh)
    return tuple(model.positions.shape)


@pytest.mark.parametrize("cp, rotate, load_balance", [(2, "allgather", "headtail"), (4, "alltoall", "headtail"), (2, "allgather", "none")])
def test_plan_apply_with_context_parallel_trains_as_one_device(tmp_path, cp, rotate, load_balance):
    """Plan.apply on a transformer: the attention blocks' SDPA sequence-sharded, the
    positions buffer cut as the batch is, FSDP2 over cp; the loss and every gradient
    equal one device's."""
    plan = load_plan(_plan(tmp_path, cp, rotate, load_balance))
    torch.manual_seed(0)
    reference = positional.tiny().double()  # built here: the threads share torch's random generator
    tokens, labels = torch.randint(0, 64, (2, SEQ)), torch.randint(0, 64, (2, SEQ))

    def rank(_):
        mesh = plan.build_mesh(cp)
        return model_parity(plan, mesh, copy.deepcopy(reference), tokens, labels)[0], _positions_shape(plan, mesh)

    with context_parallel_rules():
        ranks = run_threaded(cp, rank)
    assert max(max(diffs.values()) for diffs, _ in ranks) < 1e-7, ranks[0][0]
    assert len(ranks[0][0]) == 1 + len(list(reference.parameters()))  # the loss and every gradient
    assert all(shape == (SEQ // cp, 64) for _, shape in ranks)  # each rank holds its part of the positions


def test_a_module_both_context_parallel_and_checkpointed_recomputes_through_the_ring(tmp_path):
    """Activation checkpointing is applied after context parallelism: the recomputation
    in backward runs the module's forward again, inside its ring."""
    cp = 2
    plan = load_plan(_plan(tmp_path, cp, more="checkpointing:\n  modules: layers.*.attention\n"))
    torch.manual_seed(0)
    reference = positional.tiny().double()
    tokens, labels = torch.randint(0, 64, (2, SEQ)), torch.randint(0, 64, (2, SEQ))
    with context_parallel_rules():
        ranks = run_threaded(cp, lambda _: model_parity(plan, plan.build_mesh(cp), copy.deepcopy(reference), tokens, labels)[0])
    assert max(max(diffs.values()) for diffs in ranks) < 1e-7, ranks[0]


def test_the_mesh_has_cp_between_the_data_axes_and_tp(tmp_path):
    plan = load_plan(_plan(tmp_path, 2, more=""))
    assert mesh_dims(plan, 2) == ((2, 1), ("cp", "tp"))
    path = tmp_path / "4d.yaml"
    path.write_text("version: 2\nmesh: {dp_replicate: 2, dp_shard: 2, cp: 2, tp: 2}\nrules: {}\n")
    assert mesh_dims(load_plan(path), 16) == ((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp"))


def test_fsdp_shards_over_dp_shard_and_cp_flattened():
    """The cp ranks hold the same parameters, so FSDP2 shards (and reduces) over dp_shard·cp
    (torchtitan's dp_shard_cp), and HSDP replicates across dp_replicate beside it."""
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan.sharding.data_parallel import data_parallel_mesh
    from tpplan.simulation.simulate import simulated_world

    with simulated_world(16):
        mesh = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        hsdp = data_parallel_mesh(mesh)
        assert (hsdp.mesh_dim_names, tuple(hsdp.shape)) == (("dp_replicate", "dp_shard_cp"), (2, 4))
        cp_only = data_parallel_mesh(init_device_mesh("cpu", (4, 4), mesh_dim_names=("cp", "tp")))
        assert (cp_only.mesh_dim_names, tuple(cp_only.shape)) == (("cp",), (4,))


def _refused(plan, model, world: int) -> PlanError:
    from tpplan.simulation.simulate import simulated_world

    with simulated_world(world), pytest.raises(PlanError) as info:
        plan.apply(model, plan.build_mesh(world))
    return info.value


def test_plan_apply_on_a_cpu_mesh_refuses_context_parallel_located_before_touching_the_model(tmp_path):
    path = _plan(tmp_path, 2)
    model = positional.tiny()
    problem = _refused(load_plan(path), model, 2).problems[0]
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("context_parallel"))
    assert (problem.code, problem.line, problem.column) == ("TP131", line, 1)
    assert "context parallelism needs CUDA in torch 2.13, and this mesh is on cpu" in problem.message
    assert type(model.layers[0].attention.wq.weight) is nn.Parameter and model.positions.shape == (SEQ, 64)  # untouched


@pytest.mark.parametrize("cp, buffers, why", [
    (2, "{positons: 0}", "'positons' names no buffer of the model (its buffers: positions)"),
    (2, "{positions: 2}", "'positions' has 2 dims (32, 64), so no dim 2"),
    (3, "{positions: 0}", "'positions' holds 32 positions on dim 0, not a multiple of 6 (2·cp: headtail gives each rank"),
])
def test_a_buffer_that_cannot_be_cut_on_the_sequence_is_tp132_at_its_name(tmp_path, cp, buffers, why):
    path = _plan(tmp_path, cp, buffers=buffers)
    with context_parallel_rules():
        problem = _refused(load_plan(path), positional.tiny(), cp).problems[0]
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "buffers:" in text)
    assert (problem.code, problem.line) == ("TP132", line)
    assert why in problem.message


def test_torchrun_on_cpu_refuses_context_parallel_located_no_traceback(tmp_path):
    path = tmp_path / "cp.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh:\n  cp: 2\n  tp: 1\n"
                    "context_parallel:\n  modules: layers.*.attention\n")
    result = torchrun(2, "-m", "tpplan", "apply", "--plan", str(path), "--model", "tpplan.models.llama:tiny", pythonpath=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith(f"{path}:7:1: TP131 context_parallel: context parallelism needs CUDA in torch 2.13")
    # torchrun's launcher prints its own traceback for a rank that exits 1; none of tpplan's code is in it
    assert "Traceback" not in result.stdout and "tpplan/" not in result.stderr


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_the_simulation_gives_a_cuda_ranks_shapes_and_collectives_at_cp_2(tmp_path, rotate):
    """One rank of cp 2 on fake tensors (the fake process group, CUDA's ring simulated):
    its part of the sequence, and the ring's collectives and FSDP2's over cp, counted by
    hand. Float32, batch 2, 4 heads of 16, 2 layers of 16,448 parameters, the root's 8,192."""
    from tpplan.simulation.context_parallel import simulate_context_parallel

    sim = simulate_context_parallel(load_plan(_plan(tmp_path, 2, rotate)), positional.tiny, world=2, batch=2, seq=SEQ)
    assert (sim.mesh, sim.tokens, sim.buffers) == ({"cp": 2, "tp": 1}, (2, SEQ // 2), {"positions": (SEQ // 2, 64)})
    assert sim.attention == ((2, 4, SEQ // 2, 16),) * 2  # (batch, heads, this rank's seq, head_dim) in each layer
    kv = 2 * (2 * 4 * SEQ // 2 * 16) * 4  # this rank's k and v, float32; dk, dv float32 too
    if rotate == "allgather":  # one all-gather of k and v per layer and pass (its output: both ranks' k and v)
        ring = {"forward": {"all_gather": {"count": 2, "bytes": 2 * 2 * kv}},
                "backward": {"all_gather": {"count": 2, "bytes": 2 * 2 * kv}, "all_to_all": {"count": 4, "bytes": 4 * kv}}}
    else:  # k and v passed once round the ring per layer and pass; dk, dv twice (cp) in backward
        ring = {"forward": {"all_to_all": {"count": 2, "bytes": 2 * kv}}, "backward": {"all_to_all": {"count": 6, "bytes": 6 * kv}}}
    assert sim.ring == ring
    params = (2 * (64 + 4 * 64 * 64) + 2 * 64 * 64) * 4  # FSDP2 over cp: 3 units gathered whole, their gradients reduce-scattered
    fsdp = {"forward": {"all_gather": (3, params)}, "backward": {"all_gather": (3, params), "reduce_scatter": (3, params)}}
    for phase, ops in fsdp.items():
        for op, (count, nbytes) in ops.items():
            ring_op = ring[phase].get(op, {"count": 0, "bytes": 0})
            assert sim.comms[phase][op] == {"count": count + ring_op["count"], "bytes": nbytes + ring_op["bytes"]}
    assert set(sim.comms["backward"]) == set(fsdp["backward"]) | set(ring["backward"])


def test_apply_dry_run_of_a_plan_with_context_parallelism_reports_the_simulated_rank(tmp_path):
    """`apply --dry-run` simulates CP at cp 2 as the simulation does (the same figures),
    in the JSON report's `context_parallel` and `comms`, and its notes."""
    import json

    from typer.testing import CliRunner

    from tpplan.cli.app import app
    from tpplan.simulation.context_parallel import simulate_context_parallel

    path = _plan(tmp_path, 2)
    args = ["apply", "--dry-run", "--plan", str(path), "--model", "tpplan.models.positional:tiny", "--seq", str(SEQ)]
    result = CliRunner().invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    sim = simulate_context_parallel(load_plan(path), positional.tiny, world=2, batch=2, seq=SEQ)
    assert (report["ok"], report["world_size"], report["mesh"]) == (True, 2, {"cp": 2, "tp": 1})
    assert report["context_parallel"]["ring"] == sim.ring and report["context_parallel"]["comms"] == sim.comms
    assert report["context_parallel"]["tokens"] == [2, SEQ // 2]
    assert report["comms"] == {phase: {op: found["count"] for op, found in ops.items()} for phase, ops in sim.comms.items()}
    text = CliRunner().invoke(app, args).output
    assert "the ring's collectives (rotate: allgather): forward all_gather ×2 (64.00 KiB)" in text
    refused = CliRunner().invoke(app, [*args, "--check"])
    assert refused.exit_code == 2 and "simulates shapes, collectives and memory (no values or checkpoints yet)" in refused.output


def test_torchrun_on_cuda_does_not_apply_context_parallelism_yet_and_says_where_it_is_applied(tmp_path):
    """`tpplan apply` under torchrun does not cut its batches on the sequence: on CUDA the
    plan is refused as not applied yet (TP130), pointing at Plan.apply."""
    from tpplan.core.axes import NotAppliedError, refuse_unapplied

    with pytest.raises(NotAppliedError) as info:
        refuse_unapplied(load_plan(_plan(tmp_path, 2)))
    assert info.value.problem.code == "TP130"
    assert "not applied yet: mesh.cp, context_parallel" in str(info.value) and "`Plan.apply` applies context parallelism on CUDA" in str(info.value)
    refuse_unapplied(load_plan(_plan(tmp_path, 2)), "api")  # Plan.apply's own check lets it through


def test_dry_run_of_tp_then_cp_on_llama(tmp_path):
    """TP 2 × CP 2 on tpplan's Llama: the TP rules first (their all-reduces), then the ring
    on the local heads (alltoall at cp 2: k and v passed once per layer, dk and dv twice)."""
    import json

    from typer.testing import CliRunner

    from tpplan.cli.app import app
    from tpplan.models.llama import tiny

    path = tmp_path / "llama_cp.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh: {{cp: 2, tp: 2}}\n"
                    "context_parallel:\n  modules: layers.*.attention\n  rotate: alltoall\n")
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(path), "--model", "tpplan.models.llama:tiny", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cfg, layers = tiny().config, tiny().config.n_layers
    assert (report["ok"], report["world_size"], report["mesh"]) == (True, 4, {"cp": 2, "tp": 2})
    q = [2, cfg.n_heads // 2, 16, cfg.dim // cfg.n_heads]  # the local heads (TP) of this rank's 16 of 32 tokens (CP)
    assert report["context_parallel"]["attention_q"] == [q] * layers
    ring = report["context_parallel"]["ring"]
    assert {op: found["count"] for op, found in ring["forward"].items()} == {"all_to_all": layers}
    assert {op: found["count"] for op, found in ring["backward"].items()} == {"all_to_all": 3 * layers}
    assert report["comms"]["forward"]["all_reduce"] > 0  # the TP rules' (row-wise wo, w2)


def test_a_head_sharded_attention_is_no_ring_and_is_refused_in_the_simulation():
    """Inside the simulation every DTensor CPU attention is routed to the ring (as torch
    routes every CUDA one under CP); one sharded on heads (a TP plan's DTensor q/k/v)
    would be ringed over the wrong mesh: refused with the fix, not computed."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tpplan.simulation.simulate import simulated_world

    with simulated_world(2), context_parallel_rules():
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        q = DTensor.from_local(torch.randn(1, 2, 8, 4), mesh, [Shard(1)])
        with pytest.raises(RuntimeError, match=r"laid out as \(Shard\(dim=1\),\), not on the sequence"):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
