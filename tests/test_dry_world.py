"""`apply --dry-run` of a version 2 plan's whole mesh (issue 28 item 6, SPEC §7 "Dry
run"): dp_replicate × dp_shard × tp over `--world N` in one process, on fake tensors,
one simulated rank per distinct position, each with its memory by category (the
plan's activation checkpointing applied) and its collectives per mesh axis.

The positions are exact: each rank simulated on its own (`every_rank`) gives the
memory and collectives of the position that stands for it, on worlds of 8 and 16
whose dims do not divide evenly (so that positions do differ). The bytes per axis
are checked against the model's sizes by hand.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from expected import FP32, llama_bytes
from tpplan.cli.app import app
from tpplan.models import llama
from tpplan.models.llama import LlamaConfig, Transformer
from tpplan.render.apply_report import render_text
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions, ApplyOptionsError
from tpplan.simulation.training import TrainOptions

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
TINY = "tpplan.models.llama:tiny"
CFG = llama.tiny().config

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def uneven() -> Transformer:
    """251 tokens: tp 2 cuts the embedding and head into 126 and 125 rows, dp_shard 2
    those into 63 | 63 and 63 | 62, so tp and dp_shard positions hold different shapes;
    2 KV heads: at tp 4 the plan replicates each on two ranks (a (kv_heads, kv_replicas)
    view of the tp mesh)."""
    return Transformer(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=251, ffn_hidden=136))


def _plan(tmp_path: Path, mesh: str, sections: str = "", parent: str = "llama_tp_sp.yaml", name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"version: 2\nextends: {PLANS / parent}\nrules: {{}}\nmesh:\n{mesh}{sections}")
    return path


HSDP = "  dp_replicate: 2\n  dp_shard: -1\n  tp: 2\n"
SECTIONS = "fsdp:\n  units: [layers.*]\ncheckpointing:\n  modules: layers.*\n"


@functools.cache
def _report(plan: str, model: str, world: int, tp: int | None, every_rank: bool = False, jobs: int = 1, **train) -> str:
    report = dry_run(ApplyOptions(plan=plan, model=model, world=world, tp=tp, every_rank=every_rank, jobs=jobs, train=TrainOptions(**train)))
    assert report.ok, report.problems
    return json.dumps(report.to_json())


def report(plan: Path | str, model: str, world: int, every_rank: bool = False, tp: int | None = None, jobs: int = 1, **train) -> dict:
    """The JSON report of the dry run over `world` ranks (a copy: tests share the runs);
    `jobs`: positions simulated at once (forked children)."""
    return json.loads(_report(str(plan), model, world, tp, every_rank, jobs, **train))


def by_rank(found: dict) -> dict[int, dict]:
    """{global rank: the memory and collectives of the position that stands for it}."""
    out = {}
    for entry in found["ranks"]:
        for rank in entry["global_ranks"]:
            assert rank not in out, f"rank {rank} in two positions"
            out[rank] = {"memory": entry["memory"], "comms_by_axis": entry["comms_by_axis"]}
    return out


@pytest.mark.parametrize("mesh, world, positions", [
    # dp_replicate 2 × dp_shard 2 × tp 2: 251 rows cut 126 | 125 on tp, then 63 | 63 and 63 | 62 on dp_shard;
    # the positions: (dp_shard any, tp 0) 63 of 126, (dp_shard 0, tp 1) 63 of 125, (dp_shard 1, tp 1) 62 of 125
    (HSDP, 8, 3),
    # dp_replicate 2 × dp_shard 2 × tp 4 (16 simulations: about 20 s of CPU): 63 | 63 | 63 | 62 on tp, then
    # (tp 0-2) 32 | 31 and (tp 3) 31 | 31 on dp_shard: (dp_shard 0, tp 0-2), (dp_shard 1, tp 0-2), (tp 3)
    pytest.param("  dp_replicate: 2\n  dp_shard: -1\n  tp: 4\n", 16, 3, marks=pytest.mark.slow),
], ids=["world8", "world16"])
def test_one_rank_per_position_plans_exactly_what_every_rank_simulated_plans(tmp_path, monkeypatch, mesh, world, positions):
    """The positions past rank 0 run at once in forked children (--jobs), every rank in this process."""
    plan = _plan(tmp_path, mesh, SECTIONS)
    forks, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    distinct = report(plan, "test_dry_world:uneven", world, jobs=positions)
    assert len(forks) == positions - 1
    every = report(plan, "test_dry_world:uneven", world, every_rank=True)
    assert len(every["ranks"]) == world and sorted(by_rank(every)) == list(range(world))
    # the dims do not divide: positions differ (else the comparison below would prove nothing)
    assert len(distinct["ranks"]) == positions
    assert len({json.dumps(entry["memory"]) for entry in every["ranks"]}) > 1
    assert by_rank(distinct) == by_rank(every)  # every rank: each figure of its memory and of its collectives per axis
    assert distinct["memory"] == every["memory"]  # the worst rank's
    # replicas never make a position: every position simulated is replica 0
    assert all(entry["position"]["dp_replicate"] == 0 for entry in distinct["ranks"])


def test_an_even_world_is_one_position_and_its_collectives_per_axis_are_the_model_sizes_by_hand():
    """plans/llama_fsdp_tp.yaml on 8 ranks at tp 2: dp_shard 4, every dim divides, one position.
    FSDP2 all-gathers each unit's TP shard (layers.* and the root, in forward and again in
    backward) and reduce-scatters its gradient over dp_shard; TP's collectives are
    llama_tp.yaml's, of activations and logits."""
    found = report(PLANS / "llama_fsdp_tp.yaml", TINY, 8, tp=2, batch=2, seq=16)
    assert found["mesh"] == {"dp_shard": 4, "tp": 2} and found["world_size"] == 8
    assert [entry["global_ranks"] for entry in found["ranks"]] == [list(range(8))]
    _, tp_shard = llama_bytes(CFG, 2)  # what one tp rank holds, and so each dp_shard group gathers
    units = CFG.n_layers + 1
    activation, logits = FP32 * 2 * 16 * CFG.dim, FP32 * 2 * 16 * CFG.vocab_size
    assert found["comms_by_axis"] == {
        "dp_shard": {
            "forward": {"all_gather": {"count": units, "bytes": tp_shard}},
            "backward": {"all_gather": {"count": units, "bytes": tp_shard}, "reduce_scatter": {"count": units, "bytes": tp_shard}},
        },
        "tp": {
            "forward": {"all_gather": {"count": 1, "bytes": logits}, "all_reduce": {"count": 2 * CFG.n_layers + 1, "bytes": (2 * CFG.n_layers + 1) * activation}},
            "backward": {"all_reduce": {"count": 2 * CFG.n_layers + 1, "bytes": (2 * CFG.n_layers + 1) * activation}},
        },
    }
    # the flat collectives (SPEC §4) are the axes' sum
    assert found["comm_bytes"]["forward"] == {"all_gather": tp_shard + logits, "all_reduce": (2 * CFG.n_layers + 1) * activation}
    # what stays between steps: a quarter of the TP shard, and AdamW's two moments of it (+ a step counter per parameter)
    assert found["memory"]["after_step"]["parameters"] == tp_shard // 4


def test_hsdp_all_reduces_the_sharded_gradients_over_dp_replicate(tmp_path):
    """dp_replicate 2 × dp_shard 2 × tp 2: the reduce-scatter over dp_shard, then an
    all-reduce of each unit's gradient shard (half the TP shard) across the replicas."""
    plan = _plan(tmp_path, HSDP, "fsdp:\n  units: [layers.*]\n", parent="llama_tp.yaml")
    found = report(plan, TINY, 8)
    _, tp_shard = llama_bytes(CFG, 2)
    units = CFG.n_layers + 1
    assert found["comms_by_axis"]["dp_replicate"] == {"forward": {}, "backward": {"all_reduce": {"count": units, "bytes": tp_shard // 2}}}
    assert found["comms_by_axis"]["dp_shard"]["backward"]["reduce_scatter"] == {"count": units, "bytes": tp_shard}


def test_the_plans_data_axes_plan_as_the_fsdp_flag_does_on_a_version_1_plan():
    """The same FSDP2 (each block, then the root) over dp_shard 4 as over --fsdp 4's dp: the
    same memory and collectives, the axis named as the plan names it."""
    v2 = report(PLANS / "llama_fsdp_tp.yaml", TINY, 8, tp=2)
    v1 = json.loads(json.dumps(dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model=TINY, tp=2, train=TrainOptions(fsdp=4))).to_json()))
    assert v1["mesh"] == {"dp": 4, "tp": 2}
    assert v2["memory"] == v1["memory"] and v2["comms"] == v1["comms"] and v2["comm_bytes"] == v1["comm_bytes"]
    assert v2["comms_by_axis"] == {"dp_shard" if axis == "dp" else axis: phases for axis, phases in v1["comms_by_axis"].items()}


def test_the_plans_activation_checkpointing_lowers_the_activations_it_keeps(tmp_path):
    fsdp = "fsdp:\n  units: [layers.*]\n"
    plain = report(_plan(tmp_path, HSDP, fsdp, "llama_tp.yaml", "plain.yaml"), TINY, 8, seq=64)
    checkpointed = report(_plan(tmp_path, HSDP, fsdp + "checkpointing:\n  modules: layers.*\n", "llama_tp.yaml", "checkpointed.yaml"), TINY, 8, seq=64)
    assert "activation checkpointing (full) on 2 module(s) (layers.*)" in checkpointed["notes"]
    assert checkpointed["memory"]["activations"] < plain["memory"]["activations"]
    assert checkpointed["memory"]["after_step"] == plain["memory"]["after_step"]  # the same parameters and optimizer state
    assert checkpointed["comms_by_axis"]["dp_shard"] == plain["comms_by_axis"]["dp_shard"]


def test_memory_limit_names_the_ranks_that_do_not_fit_and_by_how_much(tmp_path):
    plan = _plan(tmp_path, HSDP, SECTIONS)
    peaks = sorted({entry["memory"]["per_rank_peak_bytes"] for entry in report(plan, "test_dry_world:uneven", 8)["ranks"]})
    limit = peaks[0]  # the lowest position fits exactly, the others do not
    # one dry run with the limit, its JSON and its text as the CLI renders them (test_memory.py runs the flag's CLI)
    limited = dry_run(ApplyOptions(plan=str(plan), model="test_dry_world:uneven", world=8, train=TrainOptions(memory_limit=limit)))
    found = limited.to_json()
    over = {tuple(entry["global_ranks"]): entry["over_limit_bytes"] for entry in found["ranks"]}
    assert found["memory"]["fits"] is False and found["memory"]["per_rank_peak_bytes"] == peaks[-1]
    assert sorted(over.values()) == [peak - limit for peak in peaks] and min(over.values()) == 0
    console = Console(record=True, width=200, highlight=False)
    render_text(limited, console)
    text = console.export_text()
    lines = [line.strip() for line in text.splitlines() if line.endswith("over the limit")]
    wanted = [entry for entry in found["ranks"] if entry["over_limit_bytes"]]
    assert len(lines) == len(wanted) >= 1
    for line, entry in zip(lines, wanted):
        where = " · ".join(f"{axis} {index}" for axis, index in entry["position"].items())
        assert line.startswith(f"{where} (ranks ") and f"({entry['over_limit_bytes']} bytes) over the limit" in line
    assert "Collectives over dp_replicate (2 ranks)" in text and "Collectives over tp (2 ranks)" in text


@pytest.mark.parametrize("args, message", [
    (["--plan", str(PLANS / "llama_fsdp_tp.yaml"), "--tp", "2"], "mesh.dp_shard is -1 (the rest of the world): give the world size (--world N)"),
    (["--plan", str(PLANS / "llama_tp.yaml"), "--tp", "2", "--world", "4"], "--world sizes a version 2 plan's mesh"),
    (["--plan", str(PLANS / "llama_fsdp_tp.yaml"), "--world", "8", "--check"], "run --check under torchrun"),
    (["--plan", str(PLANS / "llama_tp.yaml"), "--tp", "2", "--every-rank"], "--every-rank simulates each rank's memory plan"),
])
def test_what_the_dry_run_of_a_world_cannot_do_is_a_usage_error(args, message):
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--model", TINY, *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_a_world_the_plans_axes_do_not_make_is_located_at_the_mesh(tmp_path):
    plan = _plan(tmp_path, "  dp_shard: 2\n  tp: 2\n", "fsdp:\n  units: [layers.*]\n")
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--world", "8", "--plan", str(plan), "--model", TINY])
    assert result.exit_code == 1
    assert f"{plan}:4:1: TP121 mesh: dp_shard 2 × tp 2 = 4, not the world size 8" in " ".join(result.output.split())


def test_world_n_resolves_each_tp_degree_of_the_plan_and_reports_the_smallest_that_fits():
    found = report(PLANS / "llama_fsdp_tp.yaml", TINY, 8, memory_limit=1 << 30)
    assert [(row["tp"], row["dp"]) for row in found["memory_by_tp"]] == [(2, 4), (4, 2), (8, 1)]
    assert found["mesh"] == {"dp_shard": 4, "tp": 2}
    with pytest.raises(ApplyOptionsError):
        dry_run(ApplyOptions(plan=str(PLANS / "llama_fsdp_tp.yaml"), model=TINY, tp=3, world=8))


def test_each_collective_is_filed_under_the_mesh_dim_of_its_group_and_a_flattened_group_under_the_dims_it_spans():
    from collections import Counter

    import torch
    import torch.distributed._functional_collectives as funcol

    from tpplan.simulation.comm_axes import counting, mesh_axes
    from tpplan.simulation.positions import MeshDims
    from tpplan.simulation.simulate import simulated_world

    counts, sizes = Counter(), Counter()
    with simulated_world(8, rank=5):
        mesh = MeshDims((2, 2, 2), ("dp_replicate", "dp_shard", "tp")).build()
        axis = mesh_axes(mesh)
        flat = mesh["dp_replicate", "dp_shard"]._flatten()
        with counting(counts, sizes, axis):
            issued = [funcol.all_reduce(torch.ones(4), "sum", mesh.get_group("tp")),
                      funcol.all_gather_tensor(torch.ones(4), 0, mesh.get_group("dp_shard")),
                      funcol.all_reduce(torch.ones(2), "sum", flat.get_group())]
            for out in issued:
                out.wait()
    assert counts == {("tp", "all_reduce"): 1, ("dp_shard", "all_gather"): 1, ("dp_replicate+dp_shard", "all_reduce"): 1}
    assert sizes == {("tp", "all_reduce"): 16, ("dp_shard", "all_gather"): 32, ("dp_replicate+dp_shard", "all_reduce"): 8}


CP = "context_parallel:\n  modules: layers.*.attention\n"


@pytest.mark.slow  # 12 simulated ranks (about 50 s here)
def test_context_parallel_in_the_world_is_exact_per_position_and_runs_the_cp_dry_runs_ring(tmp_path):
    """dp_shard 2 × cp 2 × tp 2 with context parallelism (simulated as on CUDA), checkpointing
    and FSDP2 over dp_shard·cp: one rank per position plans what every rank does (each cp
    index its own position: the ring differs per cp rank); the ring's collectives under cp
    are the shapes-only CP dry run's (the same step: checkpointing's recompute in both);
    the report's sequence is the batch's whole one."""
    plan = _plan(tmp_path, "  dp_shard: 2\n  cp: 2\n  tp: 2\n", SECTIONS + CP)
    distinct = report(plan, "test_dry_world:uneven", 8, batch=2, seq=16, optimizer="adamw")
    every = report(plan, "test_dry_world:uneven", 8, every_rank=True, batch=2, seq=16, optimizer="adamw")
    assert len(distinct["ranks"]) > 1 and by_rank(distinct) == by_rank(every)
    assert {entry["position"]["cp"] for entry in distinct["ranks"]} == {0, 1}
    assert distinct["mesh"] == {"dp_shard": 2, "cp": 2, "tp": 2} and distinct["memory"]["seq"] == 16
    ring = dry_run(ApplyOptions(plan=str(plan), model="test_dry_world:uneven", train=TrainOptions(batch=2, seq=16))).to_json()
    assert distinct["comms_by_axis"]["cp"] == ring["context_parallel"]["ring"]
    assert "FSDP2 (fully_shard on layers.* and the root) over dp_shard 2 × cp 2, after the plan" in " ".join(distinct["notes"])


def test_a_cp_plan_given_a_memory_option_plans_the_worlds_memory_with_the_cp_dry_runs_ring(tmp_path):
    """dp_shard 2 × cp 2 (world 4): `--optimizer` turns the CP dry run into the world's memory
    plan, one position per cp index; the ring under cp is the one-rank CP dry run's."""
    plan = _plan(tmp_path, "  dp_shard: 2\n  cp: 2\n  tp: 1\n", CP, parent="llama_tp.yaml")
    found = report(plan, TINY, 4, batch=2, seq=16, optimizer="adamw")
    # cp 1's position is known before rank 0 is simulated: a child starts it at once, with the same result
    assert report(plan, TINY, 4, batch=2, seq=16, optimizer="adamw", jobs=2) == found
    assert [entry["position"] for entry in found["ranks"]] == [{"dp_shard": 0, "cp": 0, "tp": 0}, {"dp_shard": 0, "cp": 1, "tp": 0}]
    assert found["memory"]["seq"] == 16 and found["memory"]["optimizer"] > 0
    ring = dry_run(ApplyOptions(plan=str(plan), model=TINY, train=TrainOptions(batch=2, seq=16))).to_json()
    assert found["comms_by_axis"]["cp"] == ring["context_parallel"]["ring"]
