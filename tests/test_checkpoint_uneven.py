"""A checkpoint loaded at a TP degree that does not divide the sharded dims (torch's
uneven shards: rank r holds chunk r of `torch.chunk`, 130 features are 44 + 44 + 42
at TP 3, 33 + 33 + 33 + 31 at TP 4): `apply --dry-run --check --checkpoint` reports
for each rank the bytes that loading at that degree reads, in one process
(`simulation.simulated_load`, each simulated rank its own chunk) and on real gloo ranks
(uneven_load_worker.py), and every rank's values are its slice of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from uneven_load_worker import DIM, HIDDEN, PLAN, odd, rank_reads

from tpplan import load_checkpoint, load_plan, save_checkpoint
from tpplan.simulation.simulated_load import simulated_load
from tpplan.cli.app import app

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

MODEL = "uneven_load_worker:odd"
ROOT = Path(__file__).resolve().parent.parent


def chunk_bytes(tp: int) -> list[int]:
    """What rank r of TP `tp` holds, by hand: per block, in_proj's rows and bias and
    out_proj's columns of its chunk of HIDDEN, out_proj's bias whole; float32."""
    chunks = [len(c) for c in torch.arange(HIDDEN).chunk(tp)]
    return [2 * 4 * (c * DIM + c + DIM * c + DIM) for c in chunks]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    root = tmp_path_factory.mktemp("uneven")
    (root / "plan.yaml").write_text(PLAN)
    save_checkpoint(odd(), root / "hf", format="hf")
    return root


def dry_run(checkpoint, directory, tp: int, *more: str):
    return CliRunner().invoke(app, ["apply", "--dry-run", "--check", "--tp", str(tp), "--model", MODEL, "--plan",
                                    str(checkpoint / "plan.yaml"), "--checkpoint", str(directory), *more])


def test_the_chunks_are_uneven_at_3_and_4():
    assert chunk_bytes(3) == [21712, 21712, 20736] and chunk_bytes(4) == [16344, 16344, 16344, 15368]
    whole = sum(p.numel() * p.element_size() for p in odd().parameters())
    for tp in (3, 4):  # the ranks together: the model once, and out_proj's replicated biases tp times
        assert sum(chunk_bytes(tp)) == whole + (tp - 1) * 2 * DIM * 4


def simulated_reads(checkpoint, tp: int) -> list[tuple[int, list[str]]]:
    """(bytes, names not equal to their slice) that each rank holds after loading at TP `tp` in one process."""
    full = odd()
    load_checkpoint(full, checkpoint / "hf")
    with simulated_load(odd, load_plan(text=PLAN), tp, str(checkpoint / "hf")) as sim:
        assert [r.read_bytes for r in sim.results] == chunk_bytes(tp)
        return [rank_reads(sim.model, full.state_dict(), rank, lambda t: t.to_local()._local_tensors[rank]) for rank in range(tp)]


def test_the_dry_run_reports_what_each_simulated_rank_loads(checkpoint):
    result = dry_run(checkpoint, checkpoint / "hf", 3)
    assert result.exit_code == 0, result.output
    reads = "would load 8 of its 8 tensors\n  ranks 0-1 read 21.20 KiB (21712 bytes)\n  rank 2 reads 20.25 KiB (20736 bytes)\n"
    assert reads in result.stdout
    assert "check against a single device: passed" in result.stdout
    assert simulated_reads(checkpoint, 3) == [(21712, []), (21712, []), (20736, [])]


@pytest.mark.slow  # the same at TP 3 and 4, in the JSON report (~3 s each)
@pytest.mark.parametrize("tp", [3, 4])
def test_the_dry_runs_rank_reads_are_what_each_simulated_rank_loads(checkpoint, tp):
    result = dry_run(checkpoint, checkpoint / "hf", tp, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["check"]["passed"] is True
    assert report["checkpoint"]["rank_read_bytes"] == chunk_bytes(tp)
    assert simulated_reads(checkpoint, tp) == [(b, []) for b in chunk_bytes(tp)]
    fake = CliRunner().invoke(app, ["apply", "--dry-run", "--tp", str(tp), "--model", MODEL, "--plan", str(checkpoint / "plan.yaml"),
                                    "--checkpoint", str(checkpoint / "hf"), "--format", "json"])
    assert json.loads(fake.stdout)["checkpoint"]["rank_read_bytes"] == chunk_bytes(tp)  # without --check: fake tensors' metadata


@pytest.mark.slow  # a transformers Llama (~10 s)
def test_an_uneven_vocab_parallel_embedding_and_lm_head_read_what_each_rank_loads(tmp_path):
    pytest.importorskip("transformers")
    from uneven_load_worker import llama_odd_vocab

    torch.manual_seed(2)
    llama_odd_vocab().save_pretrained(tmp_path / "llama")
    plan = str(ROOT / "plans/hf/llama_tp.yaml")
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--check", "--tp", "4", "--model", "uneven_load_worker:llama_odd_vocab",
                                      "--plan", plan, "--checkpoint", str(tmp_path / "llama"), "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    read = report["checkpoint"]["rank_read_bytes"]
    assert report["check"]["passed"] is True
    # 130 tokens: 33, 33, 33 and 31 rows of the embedding and of lm_head, 64 floats each
    assert read[:3] == [read[0]] * 3 and read[0] - read[3] == 2 * (33 - 31) * 64 * 4
    with torch.device("meta"):
        full = llama_odd_vocab()
    load_checkpoint(full, tmp_path / "llama")
    with simulated_load(llama_odd_vocab, load_plan(plan), 4, str(tmp_path / "llama")) as sim:
        held = [rank_reads(sim.model, full.state_dict(), rank, lambda t: t.to_local()._local_tensors[rank]) for rank in range(4)]
    assert held == [(r, []) for r in read]


@pytest.mark.slow  # torchrun with 3 gloo ranks (~30 s)
def test_real_gloo_ranks_read_what_the_dry_run_reports_and_their_dcp_save_reloads_at_another_uneven_degree(checkpoint, tmp_path):
    from test_torchrun import torchrun

    result = torchrun(3, "tests/uneven_load_worker.py", str(checkpoint / "hf"), str(tmp_path), "--save", str(tmp_path / "dcp3"),
                      timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert ranks == [{"held": b, "read_bytes": b, "wrong": []} for b in chunk_bytes(3)]
    report = json.loads(dry_run(checkpoint, checkpoint / "hf", 3, "--format", "json").stdout)
    assert report["checkpoint"]["rank_read_bytes"] == [r["held"] for r in ranks]
    # the DCP the 3 ranks wrote (uneven chunks) at TP 4
    again = dry_run(checkpoint, tmp_path / "dcp3", 4, "--format", "json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["checkpoint"]["rank_read_bytes"] == chunk_bytes(4)
