"""Checkpoints of a pipeline (SPEC §8: stages keep the model's parameter names, so DCP
checkpoints reshard across PP degrees), the optimizer state included.

On 2 gloo ranks (tests/ckpt_layout_worker.py) a tiny Llama trains 2 AdamW steps as a
two-stage pipeline (1F1B, 4 microbatches) and its stages are saved, each rank its own
keys; the checkpoint loads under TP 2, under FSDP2 over dp_shard 2, into the stages
of GPipe and of Interleaved1F1B (two stages a rank), and on one device: the parameters and AdamW's moments and step
equal the saved ones bitwise, and one more step equals that step continued under the
pipeline to float32 rounding. Measured on torch 2.13 CPU: 0.0 after the load, after
the step at most ~2.4e-7. `tpplan apply --save` of an interleaved run (each rank's two
stages saved as one) loads the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckpt_layout_worker import batches
from test_torchrun import ROOT, torchrun
from tpplan import load_checkpoint
from tpplan.models.llama import tiny

TP = ROOT / "plans" / "llama_tp.yaml"
LAYOUTS = {  # name: the mesh and what else the plan says; the first is the layout saved under
    "pp2": "mesh: {pp: 2, tp: 1}\npipeline: {layers_per_stage: 1, schedule: 1F1B, microbatches: 4}\n",
    "tp2": "mesh: {tp: 2}\n",
    "dp2": "mesh: {dp_shard: 2, tp: 1}\nfsdp: {units: [layers.*]}\n",
    "pp2_gpipe": "mesh: {pp: 2, tp: 1}\npipeline: {layers_per_stage: 1, schedule: GPipe, microbatches: 2}\n",
    # two stages per rank (0 and 2 on pp rank 0): the rank's stages held as one for the checkpoint
    "pp2_interleaved": "mesh: {pp: 2, tp: 1}\npipeline:\n  stages: [[tok_embeddings], [layers.0], [layers.1], [norm, output]]\n"
                       "  schedule: Interleaved1F1B\n  virtual_stages: 2\n  microbatches: 2\n",
}


def plan_file(directory: Path, name: str, layout: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(f"version: 2\nname: {name}\nextends: {TP}\nrules: {{}}\n{layout}")
    return path


@pytest.fixture(scope="module")
def pp2_saved(tmp_path_factory):
    """(directory, the worker's report): saved under pp2, loaded under each other layout."""
    directory = tmp_path_factory.mktemp("pipeline_ckpt")
    plans = [str(plan_file(directory, name, layout)) for name, layout in LAYOUTS.items()]
    result = torchrun(2, "tests/ckpt_layout_worker.py", str(directory), *plans, pythonpath=ROOT / "tests", timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return directory, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["tp2", "dp2", "pp2_gpipe", "pp2_interleaved"])
def test_a_pipelines_checkpoint_loads_under_tp_fsdp_and_another_schedule(pp2_saved, target):
    _, report = pp2_saved
    found = report["targets"][target]
    assert found["keys"] == report["keys"] == 84  # 21 parameters, each with exp_avg, exp_avg_sq and step
    assert found["loaded"] == 0.0, found["differing"]  # each pp rank's keys, read back bitwise
    assert found["steps"] == [2]
    assert found["stepped"] < 1e-5 and found["loss"] < 1e-5
    assert found["layout"]["mesh"] == {"pp": 2, "tp": 1} and found["layout"]["plan"]["name"] == "pp2"


def test_a_pipelines_checkpoint_loads_on_one_device_as_training_there(pp2_saved):
    """PP 2 → PP 1: the stages' keys make one model; it and its AdamW equal 2 steps on one device."""
    directory, _ = pp2_saved
    torch.manual_seed(0)
    trained = tiny()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=0.02)
    for batch in batches(trained)[:2]:
        F.cross_entropy(trained(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(99)
    loaded = tiny()
    loaded_optimizer = torch.optim.AdamW(loaded.parameters(), lr=0.02)
    load_checkpoint(loaded, directory / "ckpt", optimizer=loaded_optimizer)
    for (name, p), q in zip(trained.named_parameters(), loaded.parameters()):
        # AdamW's m/√v turns float32 rounding (microbatches summed in another order) into up to
        # ~1e-4 where a gradient is near zero (measured: 1.1e-4); its moments agree to ~2e-8.
        assert torch.allclose(p, q, atol=5e-4), name
        mine, theirs = optimizer.state[p], loaded_optimizer.state[q]
        assert float(theirs["step"]) == 2.0
        assert torch.allclose(mine["exp_avg"], theirs["exp_avg"], atol=1e-6), name
        assert torch.allclose(mine["exp_avg_sq"], theirs["exp_avg_sq"], atol=1e-8), name


@pytest.mark.slow  # 2 torchrun jobs (~14 s); the default suite loads a pipeline's checkpoint under tp, fsdp and another schedule above
def test_tpplan_apply_saves_an_interleaved_pipelined_run_that_loads_under_tp(tmp_path):
    plans = {name: plan_file(tmp_path, name, LAYOUTS[name]) for name in ("pp2_interleaved", "tp2")}
    model = "tpplan.models.llama:tiny"
    saved = torchrun(2, "-m", "tpplan", "apply", "--plan", str(plans["pp2_interleaved"]), "--model", model, "--steps", "2",
                     "--save", str(tmp_path / "ckpt"), "--format", "json")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert json.loads(saved.stdout)["saved"] == {"path": str(tmp_path / "ckpt"), "format": "dcp"}
    loaded = torchrun(2, "-m", "tpplan", "apply", "--plan", str(plans["tp2"]), "--model", model,
                      "--checkpoint", str(tmp_path / "ckpt"), "--check", "--format", "json")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    report = json.loads(loaded.stdout)
    assert report["check"]["passed"] is True
    layout = report["checkpoint"]["layout"]
    assert (layout["saved"]["mesh"], layout["target"], layout["reshards"]) == ({"pp": 2, "tp": 1}, {"tp": 2}, True)


@pytest.mark.slow
def test_pp2_by_tp2_reshards_to_tp4_and_into_fsdp_stages(tmp_path):
    """The shipped pp 2 × tp 2 plan's checkpoint under TP 4, and loaded into the stages of pp 2 × dp_shard 2."""
    plans = [str(ROOT / "plans" / "llama_pp_tp.yaml"), str(plan_file(tmp_path, "tp4", "mesh: {tp: 4}\n")),
             str(plan_file(tmp_path, "pp2_fsdp", "mesh: {pp: 2, dp_shard: 2, tp: 1}\nfsdp: {units: [layers.*]}\n"
                                                 "pipeline: {layers_per_stage: 1, schedule: GPipe, microbatches: 2}\n"))]
    result = torchrun(4, "tests/ckpt_layout_worker.py", str(tmp_path), *plans, pythonpath=ROOT / "tests", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for target in ("tp4", "pp2_fsdp"):
        found = report["targets"][target]
        assert found["loaded"] == 0.0, found["differing"]
        assert found["keys"] == 84 and found["steps"] == [2]
        assert found["stepped"] < 1e-5 and found["loss"] < 1e-5
        assert found["layout"]["mesh"] == {"pp": 2, "tp": 2}
    assert report["targets"]["tp4"]["placements"] == {"layers.0.attention.wq.weight": "(Shard(dim=0),)"}
