"""Checkpoints across layouts (issue 28 item 8, SPEC §7): a DCP checkpoint saved under
one layout of a version 2 plan loads under any other, the optimizer state included, and
the dry run says from headers alone whether it will.

On 4 gloo ranks (tests/ckpt_layout_worker.py) a tiny Llama trains 2 AdamW steps under
(dp_shard 2, tp 2) and is saved; it is loaded under (tp 4), (dp_shard 4) and
(dp_replicate 2, dp_shard 2) with activation checkpointing: the parameters and AdamW's exp_avg, exp_avg_sq and step
equal the saved ones bitwise (DCP copies the bytes of each slice), and one more step
equals that step continued under the original layout to float32 rounding (the
reductions run in another order). Measured on torch 2.13 CPU: 0.0 after the load;
after the step at most ~1e-6 on parameters and moments, the loss equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_torchrun import ROOT, torchrun
from tpplan.cli.app import app
from tpplan.models.llama import LlamaConfig, Transformer

MESHES = {  # name: the plan's mesh section; the first is the layout saved under
    "source": "dp_shard: 2\n  tp: 2",
    "tp4": "tp: 4",
    "dp4": "dp_shard: 4\n  tp: 1",
    "hsdp": "dp_replicate: 2\n  dp_shard: 2\n  tp: 1",
}
TARGETS = {"tp4": "tp 4", "dp4": "dp_shard 4", "hsdp": "dp_replicate 2 × dp_shard 2"}
TINY = "tpplan.models.llama:tiny"


def wider() -> Transformer:
    """The tiny Llama with a vocabulary of 512 (the embedding and head of another shape)."""
    return Transformer(LlamaConfig(vocab_size=512))


def plan_file(directory: Path, name: str) -> Path:
    """A version 2 plan: llama_tp.yaml's rules on the mesh MESHES[name], FSDP2 per block where it has data axes
    (and under HSDP activation checkpointing per block too: parameter names stay, so the checkpoint's keys fit)."""
    fsdp = "" if name == "tp4" else "fsdp:\n  units: [layers.*]\n"
    fsdp += "checkpointing:\n  modules: layers.*\n" if name == "hsdp" else ""
    path = directory / f"{name}.yaml"
    path.write_text(f"version: 2\nname: {name}\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh:\n  {MESHES[name]}\n{fsdp}")
    return path


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """(directory, the worker's report): saved under `source`, loaded under each target."""
    directory = tmp_path_factory.mktemp("layouts")
    plans = [str(plan_file(directory, name)) for name in MESHES]
    result = torchrun(4, "tests/ckpt_layout_worker.py", str(directory), *plans, pythonpath=ROOT / "tests", timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return directory, json.loads(result.stdout.strip().splitlines()[-1])


def test_each_layout_loads_the_parameters_and_adamw_state_bitwise_and_steps_as_the_original(resharded):
    directory, report = resharded
    assert report["keys"] == 84  # 21 parameters, and AdamW's exp_avg, exp_avg_sq, step of each
    assert sorted(report["targets"]) == sorted(TARGETS)
    for name, got in report["targets"].items():
        print(f"{name}: after the load {got['loaded']}, after one more step {got['stepped']}, loss {got['loss']}")
        assert got["keys"] == 84 and got["steps"] == [2], name
        assert got["loaded"] == 0.0, name  # every byte of every slice, whatever the layout
        assert got["stepped"] < 1e-5 and got["loss"] < 1e-6, name
        assert all(read == held for read, held in got["reads"]), name  # each rank read exactly its local shards
        assert got["layout"] == {"mesh": {"dp_shard": 2, "tp": 2}, "plan": {
            "name": "source", "file": str(directory / "source.yaml"), "version": 2, "fingerprint": got["layout"]["plan"]["fingerprint"]}}
    # the target layouts are what they say: TP only, FSDP2 over 4, HSDP's replicate × shard
    wq = "layers.0.attention.wq.weight"
    assert report["targets"]["tp4"]["placements"][wq] == "(Shard(dim=0),)"
    assert report["targets"]["dp4"]["placements"][wq] == "(Shard(dim=0), Shard(dim=0))"
    assert report["targets"]["hsdp"]["placements"][wq] == "(Replicate(), Shard(dim=0), Shard(dim=0))"


def test_the_manifest_records_the_mesh_and_the_plan(resharded):
    directory, _ = resharded
    manifest = json.loads((directory / "ckpt" / ".tpplan-checkpoint.json").read_text())
    layout = manifest["layout"]
    assert layout["mesh"] == {"dp_shard": 2, "tp": 2}
    assert (layout["plan"]["name"], layout["plan"]["file"], layout["plan"]["version"]) == ("source", str(directory / "source.yaml"), 2)


def dry_run(*args: str):
    return CliRunner().invoke(app, ["apply", "--dry-run", *args])


def test_the_dry_run_says_from_headers_that_each_target_layout_loads(resharded):
    directory, _ = resharded
    for name, target in TARGETS.items():
        args = ["--plan", str(directory / f"{name}.yaml"), "--model", TINY, "--checkpoint", str(directory / "ckpt")]
        result = dry_run(*args, "--format", "json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        layout = report["checkpoint"]["layout"]
        assert report["ok"] and report["checkpoint"]["loaded"] == 21, name
        assert layout["saved"]["mesh"] == {"dp_shard": 2, "tp": 2} and layout["saved"]["plan"]["name"] == "source"
        assert (layout["reshards"], layout["optimizer"]) == (True, True)
        text = " ".join(dry_run(*args).stdout.split())
        assert f"saved under dp_shard 2 × tp 2 by source: loads under {target} (DCP reshards every tensor, the optimizer state's too)" in text
    # checked from the headers alone (no memory option: nothing simulated), said with the mesh that was checked
    assert report["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert "--checkpoint was checked from its headers against the whole layout (dp_replicate 2, dp_shard 2, tp 1)" in report["notes"][0]


def test_the_dry_run_refuses_a_model_of_another_shape_at_the_checkpoints_metadata(resharded):
    directory, _ = resharded
    metadata = directory / "ckpt" / ".metadata"
    for name in ("dp4", "tp4"):  # header-only against a data-parallel layout, and the simulated TP one
        result = dry_run("--plan", str(directory / f"{name}.yaml"), "--model", "test_checkpoint_layouts:wider",
                         "--checkpoint", str(directory / "ckpt"))
        assert result.exit_code == 1, result.output
        text = " ".join(result.output.split())
        assert f"{metadata}:1:1: TP603 tok_embeddings.weight has shape (256, 128) in {metadata}, the model's is (512, 128)" in text
        assert f"saved under dp_shard 2 × tp 2 by source: it does not load under {TARGETS[name]}" in text


def test_a_layout_without_sizes_for_the_dry_run_is_a_usage_error(resharded, tmp_path):
    directory, _ = resharded
    path = tmp_path / "rest.yaml"
    path.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\nmesh:\n  dp_shard: -1\n  tp: 2\n")
    result = dry_run("--plan", str(path), "--model", TINY, "--checkpoint", str(directory / "ckpt"))
    assert result.exit_code == 2
    assert "mesh.dp_shard is -1 (the rest of the world)" in " ".join(result.output.split())


def test_optimizer_state_of_another_shape_is_refused_from_headers_before_anything_is_allocated(tmp_path):
    """A training checkpoint whose model tensors fit but whose AdamW moments do not (written
    by DCP directly: tpplan's saves cannot disagree with themselves) is TP603 at its
    .metadata, naming the state, and the model is left as it was."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tpplan import CheckpointError, load_checkpoint
    from tpplan.checkpoint.errors import quiet
    from tpplan.models.llama import tiny

    torch.manual_seed(0)
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    held = get_optimizer_state_dict(model, optimizer)
    held["state"]["output.weight"]["exp_avg"] = torch.zeros(128, 128)  # the head's rows halved
    with quiet():  # DCP's warning that it saves in one process: the intent
        dcp.save({**model.state_dict(), "_tpplan": {"optimizer": held}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    torch.manual_seed(1)
    fresh = tiny()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(fresh, tmp_path / "ckpt", optimizer=torch.optim.AdamW(fresh.parameters()))
    problem = info.value.problems[0]
    assert (problem.code, problem.file) == ("TP603", str(tmp_path / "ckpt" / ".metadata"))
    assert "does not fit the model: exp_avg of output.weight is (128, 128), the parameter (256, 128)" in problem.message
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    load_checkpoint(fresh, tmp_path / "ckpt")  # the model alone loads: only the optimizer state is wrong


@pytest.mark.slow  # one more 4-rank torchrun (~12 s)
def test_tpplan_apply_loads_it_under_hsdp_checks_against_one_device_and_saves_its_own_layout(resharded):
    directory, _ = resharded
    out = directory / "hsdp-out"
    result = torchrun(4, "-m", "tpplan", "apply", "--model", TINY, "--plan", str(directory / "hsdp.yaml"), "--checkpoint",
                      str(directory / "ckpt"), "--check", "--save", str(out), "--format", "json", timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["check"]["passed"] and report["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    layout = report["checkpoint"]["layout"]
    assert (layout["saved"]["mesh"], layout["target"], layout["reshards"]) == ({"dp_shard": 2, "tp": 2}, report["mesh"], True)
    saved = json.loads((out / ".tpplan-checkpoint.json").read_text())["layout"]
    assert saved["mesh"] == report["mesh"] and saved["plan"]["name"] == "hsdp"


QWEN3_MOE = "tpplan.models.hf:qwen3_moe"
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


def moe_plans(directory: Path) -> tuple[Path, Path]:
    """Qwen3-MoE on 4 ranks, dp_shard 2 × tp 2 both: the experts whole over ep 2 (the shipped
    plans/qwen3_moe_fsdp_ep.yaml, FSDP2 over efsdp 2), and each expert sharded over tp
    (plans/hf/qwen3_moe_tp.yaml's expert_tp, FSDP2 per block over dp_shard)."""
    tp = directory / "experts_tp.yaml"
    tp.write_text(f"version: 2\nname: experts-tp\nextends: {ROOT / 'plans' / 'hf' / 'qwen3_moe_tp.yaml'}\nrules: {{}}\n"
                  "mesh:\n  dp_shard: 2\n  tp: 2\nfsdp:\n  units: [model.layers.*]\n")
    return ROOT / "plans" / "qwen3_moe_fsdp_ep.yaml", tp


@pytest.mark.parametrize("direction", ["ep-to-tp", pytest.param("tp-to-ep", marks=pytest.mark.slow)])
def test_experts_saved_over_ep_load_sharded_over_tp_and_back_with_adamw_state(tmp_path, direction):
    """EP ↔ TP experts (issue 28 item 8): the same parameter names, the experts' dim 0 split
    over ep (whole experts) in one layout and their intermediate dim over tp in the other;
    DCP reshards every tensor and the AdamW state, bitwise, and one more step equals that
    step continued under the original layout."""
    pytest.importorskip("transformers")
    ep, tp = moe_plans(tmp_path)
    source, target = (ep, tp) if direction == "ep-to-tp" else (tp, ep)
    result = torchrun(4, "tests/ckpt_layout_worker.py", "--model", QWEN3_MOE, str(tmp_path), str(source), str(target),
                      pythonpath=ROOT / "tests", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    got = report["targets"][target.stem]
    print(f"{direction}: after the load {got['loaded']}, after one more step {got['stepped']}, loss {got['loss']}", got.get("differing"))
    assert got["keys"] == report["keys"] and got["steps"] == [2]
    assert got["loaded"] == 0.0 and got["stepped"] < 1e-5 and got["loss"] < 1e-6
    assert all(read == held for read, held in got["reads"])
    # the experts as the target lays them out: whole experts over ep (then efsdp), or their intermediate dim over tp
    placed = got["placements"][EXPERTS]
    assert placed == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))" if target == ep else "(Shard(dim=0), _StridedShard(dim=1, sf=2))"), placed
