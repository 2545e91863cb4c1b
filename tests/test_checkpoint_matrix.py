"""Every load a training job starts from, then every way it saves: on 2 gloo ranks
at TP 2 (tests/ckpt_matrix_worker.py) a tiny HF Llama is loaded from safetensors
(zero-copy: parameters view the file), from DCP, or not at all; trained one AdamW
step; saved synchronously or asynchronously (training going on during the write);
and loaded back into a fresh model and optimizer. The loaded model and optimizer
state equal the saved ones bitwise on every rank, key by key, and no save leaves a
lock file. The dry run counts the two shard files of such a save."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from test_checkpoint import PLANS, run  # noqa: E402
from test_torchrun import torchrun  # noqa: E402
from tpplan import save_checkpoint  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402

PLAN = PLANS["llama"]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(directory, the worker's report, the saved model) of one torchrun of the worker."""
    directory = tmp_path_factory.mktemp("matrix")
    torch.manual_seed(7)
    model = hf_models.llama()
    model.save_pretrained(directory / "hf")
    save_checkpoint(model, directory / "dcp")
    result = torchrun(2, "tests/ckpt_matrix_worker.py", str(directory), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, json.loads(result.stdout.strip().splitlines()[-1]), model


def test_hf_dcp_and_no_load_by_sync_and_async_save_load_back_bitwise(matrix):
    directory, report, model = matrix
    tensors = len(model.state_dict())
    cases = report["cases"]
    assert report["locks"] == []
    assert sorted(cases) == sorted(f"{load}-{mode}" for load in ("hf", "dcp", "none") for mode in ("sync", "async"))
    for case, ranks in cases.items():
        for rank, got in enumerate(ranks):
            where = f"{case} rank {rank}"
            assert got["differ"] == [], where
            assert got["tensors"] == tensors * 4, where  # the model's, and AdamW's step, exp_avg, exp_avg_sq of each
            assert (got["step"], got["saved"]) == (1, str(directory / "saves" / case / "step-1")), where
            # the safetensors load maps every tensor but the dim-1 shards (o_proj, down_proj: 2 per layer)
            assert got["mapped"] == (tensors - 2 * model.config.num_hidden_layers if case.startswith("hf") else 0), where


def test_the_dry_run_counts_both_shard_files_of_a_two_rank_dcp_save(matrix):
    directory = matrix[0]
    saved = directory / "saves" / "dcp-sync" / "step-1"
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    args = ["apply", "--dry-run", "--tp", "2", "--model", f"hf:{directory / 'hf'}", "--plan", str(PLAN), "--checkpoint", str(saved)]
    report = json.loads(run(*args, "--format", "json").stdout)
    assert (report["checkpoint"]["format"], report["checkpoint"]["files"], report["checkpoint"]["loaded"]) == ("dcp", 2, 21)
    assert f"checkpoint {saved} (dcp, 2 files, " in run(*args).stdout
