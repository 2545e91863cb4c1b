"""`tpplan apply --checkpoint/--save` on real `torchrun` gloo ranks: a HuggingFace
checkpoint loaded at TP 2, trained, saved as DCP, reloaded at TP 4 (2 -> 4),
saved again, reloaded at TP 2 (4 -> 2) and saved as HuggingFace safetensors;
every save loaded again on one device (2 -> 1, 4 -> 1, and `from_pretrained`)
gives the same logits.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_torchrun import ROOT, torchrun  # noqa: E402
from tpplan import load_checkpoint  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402

PLAN = str(ROOT / "plans/hf/llama_tp.yaml")


def ids():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids()).logits


def loaded_on_one_device(path) -> torch.Tensor:
    with torch.device("meta"):
        model = hf_models.llama()
    load_checkpoint(model, path)
    return logits(model)


def apply(nproc: int, *args: str) -> dict:
    result = torchrun(nproc, "-m", "tpplan", "apply", "--plan", PLAN, "--format", "json", *args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_load_train_save_and_reshard_across_tp_degrees(tmp_path):
    torch.manual_seed(3)
    hf_models.llama().save_pretrained(tmp_path / "llama", max_shard_size="100KB")
    original = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama"))

    # TP 2 from the sharded HF checkpoint, --check against one device loaded from it, 2 SGD steps, save DCP.
    report = apply(2, "--model", f"hf:{tmp_path / 'llama'}", "--checkpoint", str(tmp_path / "llama"), "--check", "--steps", "2", "--save", str(tmp_path / "tp2"))
    assert report["ok"] and report["check"]["passed"] and report["check"]["max_abs_diff"] < 1e-4
    ckpt = report["checkpoint"]
    assert (ckpt["format"], ckpt["loaded"], ckpt["missing"], ckpt["unexpected"]) == ("hf", 21, [], [])
    assert ckpt["rank_read_bytes"] == [report["params"]["per_rank_bytes"]] * 2 < [ckpt["checkpoint_bytes"]] * 2
    assert report["saved"] == {"path": str(tmp_path / "tp2"), "format": "dcp"}
    assert sorted(p.name for p in (tmp_path / "tp2").iterdir()) == [".metadata", ".tpplan-checkpoint.json", "__0_0.distcp", "__1_0.distcp"]  # one part per rank, the manifest
    trained = loaded_on_one_device(tmp_path / "tp2")  # 2 -> 1
    assert not torch.allclose(trained, original)

    # 2 -> 4: the DCP checkpoint of TP 2 at TP 4, checked against one device; saved again.
    report = apply(4, "--model", "tpplan.models.hf:llama", "--checkpoint", str(tmp_path / "tp2"), "--check", "--save", str(tmp_path / "tp4"))
    assert report["ok"] and report["check"]["passed"] and report["tp"] == 4
    assert report["checkpoint"]["format"] == "dcp" and len(set(report["checkpoint"]["rank_read_bytes"])) == 1
    assert torch.equal(loaded_on_one_device(tmp_path / "tp4"), trained)  # 4 -> 1

    # 4 -> 2, saved as consolidated HF safetensors, which transformers loads on one device.
    report = apply(2, "--model", "tpplan.models.hf:llama", "--checkpoint", str(tmp_path / "tp4"), "--check", "--save", str(tmp_path / "hf"), "--save-format", "hf")
    assert report["ok"] and report["check"]["passed"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(again), trained)


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_an_unreadable_checkpoint_stops_every_rank_before_sharding(tmp_path):
    result = torchrun(2, "-m", "tpplan", "apply", "--plan", PLAN, "--model", "tpplan.models.hf:llama", "--checkpoint", str(tmp_path / "missing"))
    assert result.returncode != 0
    assert f"TP600 checkpoint '{tmp_path / 'missing'}' does not exist" in result.stdout
    assert "exitcode  : 2" in result.stderr  # unreadable input
    assert f'File "{ROOT / "tpplan"}' not in result.stderr  # torchrun prints its own traceback; ours, none


@pytest.mark.slow  # ~24 s; the MoE checkpoint is loaded rank by rank in one process by default (test_checkpoint_moe)
def test_moe_checkpoint_loads_into_expert_tp_on_two_gloo_ranks(tmp_path):
    """A Qwen3-MoE checkpoint (transformers writes its experts per expert) into expert_tp
    (packed gate/up as _StridedShard) at TP 2, checked against one device."""
    torch.manual_seed(4)
    hf_models.qwen3_moe().save_pretrained(tmp_path / "moe")
    result = torchrun(
        2, "-m", "tpplan", "apply", "--model", f"hf:{tmp_path / 'moe'}", "--plan", str(ROOT / "plans/hf/qwen3_moe_tp.yaml"),
        "--format", "json", "--checkpoint", str(tmp_path / "moe"), "--check", "--steps", "1", "--save", str(tmp_path / "tp2"), timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["check"]["passed"] and report["check"]["max_abs_diff"] < 1e-4, report["check"]
    ckpt = report["checkpoint"]
    assert (ckpt["missing"], ckpt["unexpected"]) == ([], [])
    assert ckpt["rank_read_bytes"] == [report["params"]["per_rank_bytes"]] * 2 < [ckpt["checkpoint_bytes"]] * 2
    print("qwen3_moe_tp torchrun TP2 check max_abs_diff", report["check"]["max_abs_diff"])

    # The DCP save of expert_tp: the packed gate/up is written as each rank's plain chunks
    # (torch reports overlapping chunks for a _StridedShard DTensor), and reads back at
    # TP 4 (--check) and on one device, equal.
    with torch.device("meta"):
        one = hf_models.qwen3_moe()
    load_checkpoint(one, tmp_path / "tp2")
    trained = logits(one)
    assert not torch.allclose(trained, logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")))
    result = torchrun(
        4, "-m", "tpplan", "apply", "--model", "tpplan.models.hf:qwen3_moe", "--plan", str(ROOT / "plans/hf/qwen3_moe_tp.yaml"),
        "--format", "json", "--checkpoint", str(tmp_path / "tp2"), "--check", "--save", str(tmp_path / "tp4"), timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["check"]["passed"] and report["tp"] == 4
    with torch.device("meta"):
        again = hf_models.qwen3_moe()
    load_checkpoint(again, tmp_path / "tp4")  # 2 -> 4 -> 1
    assert torch.equal(logits(again), trained)
