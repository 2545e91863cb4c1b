"""Training on real gloo ranks: `apply --steps N --check` (AdamW steps, losses and
final parameters against one device) on a (dp 2, tp 2) mesh, with TP alone and
with FSDP2 x TP x sequence parallelism x loss_parallel, and examples/train.py
(saved and resumed; on a transformers model) against its own one-device run.
Slow (torchrun launches)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_torchrun import torchrun

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("plan, extra", [
    pytest.param("llama_tp.yaml", [], marks=pytest.mark.slow),  # TP alone, two dp replicas (the second case covers TP too)
    ("llama_tp_sp_loss_parallel.yaml", ["--fsdp", "2"]),  # FSDP2 on dp, TP with SP on tp, loss_parallel
], ids=["tp", "fsdp-tp-sp-loss-parallel"])
def test_adamw_steps_match_one_device_on_a_two_by_two_mesh(plan, extra):
    result = torchrun(4, "-m", "tpplan", "apply", "--model", "tpplan.models.llama:tiny", "--plan", f"plans/{plan}",
                      "--tp", "2", *extra, "--steps", "3", "--check", "--format", "json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["world_size"], report["dp"], report["tp"]) == (4, 2, 2)
    assert report["check"]["passed"] is True, report["problems"]
    steps = report["steps"]
    assert steps["n"] == 3 and steps["optimizer"] == "AdamW"
    assert steps["losses"][-1] < steps["losses"][0]


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", text, re.MULTILINE)]


@pytest.mark.slow  # ~30 s; resume is bitwise-checked by test_checkpoint_faults and the slow test_checkpoint_resume
def test_the_example_trainer_on_four_ranks_resumes_on_the_one_device_loss_curve(tmp_path):
    # 2 steps on a (dp 2, tp 2) mesh, saved; a new job resumes them to 4: the losses of
    # both parts must be the one-device run's 4 steps (weights and AdamW state restored).
    # lr 0.02: large enough that resuming with fresh AdamW moments moves step 4's loss by
    # about 0.07, far outside the tolerance (at the default 1e-3 it would be 4e-5).
    args = ["examples/train.py", "--plan", "plans/llama_tp.yaml", "--tp", "2", "--lr", "0.02"]
    first = torchrun(4, *args, "--steps", "2", "--save", str(tmp_path / "ckpt"), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = torchrun(4, *args, "--steps", "4", "--resume", str(tmp_path / "ckpt"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, *args, "--steps", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    got, want = _losses(first.stdout) + _losses(resumed.stdout), _losses(single.stdout)
    assert len(got) == len(want) == 4
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5 * max(want)


def test_the_example_trainer_trains_a_transformers_model_with_loss_parallel_on_its_one_device_curve(tmp_path, monkeypatch, capsys):
    # transformers' Llama (output .logits, layers under model.layers, vocabulary in its
    # config) at TP 2 with the shipped plan's head keeping the logits vocabulary-sharded
    # for loss_parallel: each step's loss is the one-device run's (that run in this process).
    plan = tmp_path / "llama_loss_parallel.yaml"
    plan.write_text(f"version: 1\nextends: {ROOT / 'plans/hf/llama_tp.yaml'}\nloss_parallel: true\n"
                    "rules:\n  lm_head: {style: colwise, use_local_output: false}\n")
    args = ["--model", "tpplan.models.hf:llama", "--plan", str(plan), "--steps", "3", "--lr", "0.01"]
    sharded = torchrun(2, "examples/train.py", *args, "--tp", "2", timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    import train

    train.main()
    got, want = _losses(sharded.stdout), _losses(capsys.readouterr().out)
    assert len(got) == len(want) == 3 and want[-1] < want[0]
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5 * max(want)


def test_the_example_trainer_takes_a_version_2_plan_fsdp_and_checkpointing_from_the_file(tmp_path):
    # dp_shard 2 x tp 2 from the plan's mesh, FSDP2 on its units and selective activation
    # checkpointing of each block, with no flag but --plan: each step's loss is the
    # one-device run's (no torchrun, no plan), so the data split over the plan's data axes
    # and the loss's mean over them are right.
    plan = tmp_path / "llama_fsdp_tp_ac.yaml"
    plan.write_text(f"version: 2\nextends: {ROOT / 'plans/llama_fsdp_tp.yaml'}\nrules: {{}}\n"
                    "mesh: {dp_shard: -1, tp: 2}\ncheckpointing: {modules: layers.*, mode: selective}\n")
    args = ["examples/train.py", "--plan", str(plan), "--steps", "3", "--lr", "0.02"]
    sharded = torchrun(4, *args, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    got, want = _losses(sharded.stdout), _losses(single.stdout)
    assert len(got) == len(want) == 3  # a fresh random batch each step: the curve need not fall
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5 * max(want)


@pytest.mark.slow  # 3 torchrun jobs (~10 s); the default suite runs pipelines under torchrun in test_pipeline_apply.py
# and resumes them in test_pipeline_checkpoint.py
def test_the_example_trainer_runs_a_pipeline_on_its_one_device_curve_and_resumes_it(tmp_path):
    # pp 2 (1F1B, 2 microbatches of each step's 4 sequences) from the plan, no other flag:
    # the first stage takes the tokens, the last computes the loss, and the losses are the
    # one-device run's; 2 steps saved (each rank its stage's keys) and resumed to 3 stay on it.
    plan = tmp_path / "llama_pp.yaml"
    plan.write_text(f"version: 2\nextends: {ROOT / 'plans/llama_tp.yaml'}\nrules: {{}}\nmesh: {{pp: 2, tp: 1}}\n"
                    "pipeline: {layers_per_stage: 1, schedule: 1F1B, microbatches: 2}\n")
    args = ["examples/train.py", "--plan", str(plan), "--lr", "0.02"]
    first = torchrun(2, *args, "--steps", "2", "--save", str(tmp_path / "ckpt"), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = torchrun(2, *args, "--steps", "3", "--resume", str(tmp_path / "ckpt"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([sys.executable, *args, "--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    got, want = _losses(first.stdout) + _losses(resumed.stdout), _losses(single.stdout)
    assert len(got) == len(want) == 3
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5 * max(want)
