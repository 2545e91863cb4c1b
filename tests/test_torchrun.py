"""`tpplan apply` under a real `torchrun` with gloo ranks on CPU.

Each test launches processes (a few seconds each), so this file holds only
what a single process cannot show: real ranks agreeing on a plan, real
collectives, parity of a real sharded run, and failing fast when ranks
disagree or one of them hangs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from expected import llama_bytes, llama_comms, mlp_bytes
from tpplan import load_plan
from tpplan.models import llama, mlp

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"


def torchrun(nproc: int, *args: str, pythonpath: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """torchrun (as `python -m torch.distributed.run`, so this Python's torch) with
    --standalone: a free port, so tests never collide."""
    env = {key: value for key, value in os.environ.items() if key != "FORCE_COLOR"}  # plain text output
    env["OMP_NUM_THREADS"] = "1"  # also silences torchrun's warning about it
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


SHIPPED = {
    "llama_tp_sp.yaml": "tpplan.models.llama:tiny",
    "llama_tp.yaml": "tpplan.models.llama:tiny",
}


@pytest.mark.parametrize("file", SHIPPED)
def test_shipped_llama_plan_passes_check_on_two_gloo_ranks(file):
    result = torchrun(2, "-m", "tpplan", "apply", "--model", SHIPPED[file], "--plan", f"plans/{file}", "--check", "--format", "json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # rank 0 alone prints: one JSON object
    assert report["ok"] is True and report["problems"] == []
    assert report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-5
    assert (report["world_size"], report["tp"], report["dp"], report["backend"], report["device"]) == (2, 2, 1, "gloo", "cpu")
    cfg = llama.tiny().config
    assert tuple(report["params"].values()) == llama_bytes(cfg, 2)
    # Real gloo collectives, counted as in the dry run.
    assert report["comms"] == llama_comms(file, cfg.n_layers)
    assert report["step_time_s"] > 0


def test_mlp_plan_trains_and_reports_as_text():
    result = torchrun(2, "-m", "tpplan", "apply", "--model", "tpplan.models.mlp:tiny", "--plan", "plans/mlp_tp.yaml", "--check", "--steps", "3", "--optimizer", "sgd")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "tpplan apply mlp-tp on tpplan.models.mlp:tiny: world 2, gloo on cpu" in out
    total, per_rank = mlp_bytes(mlp.tiny(), 2)
    assert re.search(rf"│ ranks 0-1 +│ +{per_rank} │", out) and re.search(rf"│ all \(unsharded\) +│ +{total} │", out)
    assert "check against a single device: passed" in out
    assert "3 SGD steps: loss " in out and "median step " in out
    assert out.count("tpplan apply") == 1  # not once per rank


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_two_dimensional_mesh_shards_over_tp_within_each_dp_replica():
    result = torchrun(4, "-m", "tpplan", "apply", "--model", "tpplan.models.llama:tiny", "--plan", "plans/llama_tp_sp.yaml", "--tp", "2", "--check", "--format", "json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["world_size"], report["dp"], report["tp"]) == (4, 2, 2)
    assert report["check"]["passed"] is True
    assert report["params"]["per_rank_bytes"] == llama_bytes(llama.tiny().config, 2)[1]


@pytest.fixture
def helpers(tmp_path):
    (tmp_path / "rank_plans.py").write_text(textwrap.dedent("""\
        # `tpplan apply` with a plan that depends on the rank: ranks that disagree.
        import os, sys
        from tpplan.cli.app import main
        plans = sys.argv[1].split(",")
        sys.argv = ["tpplan", "apply", "--plan", plans[int(os.environ["RANK"])], *sys.argv[2:]]
        main()
    """))
    (tmp_path / "slow_rank.py").write_text(textwrap.dedent("""\
        # Rank 1 builds its model far slower than --timeout allows: a hung rank.
        import os, time
        from tpplan.models import mlp

        def build():
            if os.environ["RANK"] == "1":
                time.sleep(30)
            return mlp.tiny()
    """))
    return tmp_path


def test_ranks_holding_different_plans_all_stop_with_the_difference(helpers):
    start = time.monotonic()
    result = torchrun(2, str(helpers / "rank_plans.py"), "plans/llama_tp.yaml,plans/llama_tp_sp.yaml", "--model", "tpplan.models.llama:tiny")
    assert result.returncode != 0
    assert time.monotonic() - start < 60  # fails fast: no collective timeout involved
    expected = "TP503 the ranks hold different plans: rank 0 plans/llama_tp.yaml (fingerprint "
    # Rank 0 reports it; rank 1 says the same, prefixed, on stderr; both exit 1.
    assert expected in result.stdout
    first = load_plan(PLANS / "llama_tp.yaml").rules[0]  # the first rule that differs, tok_embeddings
    assert f"rank 1: plans/llama_tp.yaml:{first.line}:{first.column}: {expected}" in result.stderr
    assert "rule 'tok_embeddings' is {style: rowwise, input_layouts: replicate} on rank 0 but " in result.stdout
    assert "exitcode  : 1" in result.stderr
    assert f'File "{ROOT / "tpplan"}' not in result.stderr  # torchrun prints its own traceback; ours, none


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_a_hung_rank_fails_the_others_after_the_timeout_naming_it(helpers):
    start = time.monotonic()
    result = torchrun(
        2, "-m", "tpplan", "apply", "--model", "slow_rank:build", "--plan", "plans/mlp_tp.yaml", "--timeout", "3", pythonpath=helpers
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 25  # not the 30 s the hung rank sleeps
    assert "TP504 rank 0: plan consensus failed within 3 s: [Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms" in result.stdout


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_transformers_llama_passes_check_on_two_gloo_ranks():
    pytest.importorskip("transformers")
    result = torchrun(2, "-m", "tpplan", "apply", "--model", "tpplan.models.hf:llama", "--plan", "plans/hf/llama_tp.yaml", "--check", "--format", "json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-4
    # Communication-minimal: one all-reduce per attention and per MLP backward, + the head.
    assert report["comms"]["backward"] == {"all_reduce": 5}


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_moe_plan_with_sharded_experts_passes_check_and_trains_on_two_gloo_ranks():
    """expert_tp's packed gate/up shards, replicated-gradient q_norm/k_norm and the experts'
    partial-output all-reduce, with real gloo collectives; then SGD steps."""
    pytest.importorskip("transformers")
    result = torchrun(
        2, "-m", "tpplan", "apply", "--model", "tpplan.models.hf:qwen3_moe", "--plan", "plans/hf/qwen3_moe_tp.yaml",
        "--check", "--steps", "2", "--format", "json", timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-4
    layers = 2
    assert report["comms"] == {"forward": {"all_gather": 1, "all_reduce": 2 * layers + 1}, "backward": {"all_reduce": 3 * layers + 1}}
    total, per_rank = report["params"]["total_bytes"], report["params"]["per_rank_bytes"]
    assert per_rank < 0.51 * total  # every expert, attention and the vocabulary halved; norms and routers whole
