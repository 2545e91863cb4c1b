"""Every load a training job starts from, then every way it saves: on 2 gloo ranks
at TP 2 (tests/ckpt_matrix_worker.py) a tiny HF Llama is loaded from safetensors
(zero-copy: parameters view the file), from DCP, or not at all; trained one AdamW
step; saved synchronously or asynchronously (training going on during the write);
and loaded back into a fresh model and optimizer. The loaded model and optimizer
state equal the saved ones bitwise on every rank, key by key, and no save leaves a
lock file."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from test_torchrun import torchrun  # noqa: E402
from tpplan import hf_models, save_checkpoint  # noqa: E402


def test_hf_dcp_and_no_load_by_sync_and_async_save_load_back_bitwise(tmp_path):
    torch.manual_seed(7)
    model = hf_models.llama()
    model.save_pretrained(tmp_path / "hf")
    save_checkpoint(model, tmp_path / "dcp")
    tensors = len(model.state_dict())
    result = torchrun(2, "tests/ckpt_matrix_worker.py", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    cases = report["cases"]
    assert report["locks"] == []
    assert sorted(cases) == sorted(f"{load}-{mode}" for load in ("hf", "dcp", "none") for mode in ("sync", "async"))
    for case, ranks in cases.items():
        for rank, got in enumerate(ranks):
            where = f"{case} rank {rank}"
            assert got["differ"] == [], where
            assert got["tensors"] == tensors * 4, where  # the model's, and AdamW's step, exp_avg, exp_avg_sq of each
            assert (got["step"], got["saved"]) == (1, str(tmp_path / "saves" / case / "step-1")), where
            # the safetensors load maps every tensor but the dim-1 shards (o_proj, down_proj: 2 per layer)
            assert got["mapped"] == (tensors - 2 * model.config.num_hidden_layers if case.startswith("hf") else 0), where
