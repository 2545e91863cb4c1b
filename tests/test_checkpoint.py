"""Checkpoints in one process: `load_checkpoint` / `save_checkpoint` against
transformers' own `from_pretrained`, loading at TP 2 and 4 simulated rank by
rank, `--model hf:`, the dry run's metadata check, and every bad input.

The checkpoints are tiny transformers models with random weights saved with
`save_pretrained` (one file, and sharded with an index via max_shard_size).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tpplan import CheckpointError, PlanError, load_checkpoint, load_plan, save_checkpoint  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.simulation.simulated_load import simulated_load  # noqa: E402
from tpplan.cli.app import app  # noqa: E402
from tpplan.simulation.modelref import ModelRefError, build_model  # noqa: E402
from tpplan.simulation.simulate import allowed_diff, max_abs_diff, tolerance  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

ROOT = Path(__file__).resolve().parent.parent
PLANS = {"llama": ROOT / "plans/hf/llama_tp.yaml", "qwen2": ROOT / "plans/hf/qwen2_tp.yaml"}
FACTORIES = {"llama": hf_models.llama, "qwen2": hf_models.qwen2, "llama_tied": hf_models.llama_tied}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: directory}: llama, qwen2 and llama_tied in one file; llama and qwen2 sharded too; a bf16 llama."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, factory) in enumerate(FACTORIES.items()):
        torch.manual_seed(10 + i)
        model = factory()
        model.save_pretrained(root / name)
        out[name] = root / name
        if name != "llama_tied":
            model.save_pretrained(root / f"{name}_sharded", max_shard_size="100KB")
            out[f"{name}_sharded"] = root / f"{name}_sharded"
    torch.manual_seed(20)
    hf_models.llama().to(torch.bfloat16).save_pretrained(root / "llama_bf16")
    out["llama_bf16"] = root / "llama_bf16"
    assert (out["llama_sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(out["llama_sharded"].glob("*.safetensors"))) > 1
    return out


def ids():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(ids()).logits


def pretrained(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def meta(name: str):
    with torch.device("meta"):
        return FACTORIES[name.split("_sharded")[0].removesuffix("_bf16")]()


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


# -- loading on one device ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama_sharded", "qwen2", "qwen2_sharded"])
def test_meta_model_loads_to_the_logits_of_from_pretrained(saved, name):
    model = meta(name)
    result = load_checkpoint(model, saved[name])
    assert result.format == "hf" and result.initialized == []
    assert all(p.device.type == "cpu" for p in model.parameters())
    reference = pretrained(saved[name])
    assert torch.equal(logits_of(model.eval()), logits_of(reference))
    # The rotary tables (non-persistent, in no checkpoint) were recomputed.
    assert set(result.recomputed_buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert result.read_bytes == sum(p.numel() * p.element_size() for p in reference.parameters())


def test_a_materialized_model_is_loaded_in_place_and_keeps_its_dtype(saved):
    torch.manual_seed(99)
    model = hf_models.llama().to(torch.float64)
    weight = model.model.layers[0].mlp.up_proj.weight
    load_checkpoint(model, saved["llama"])
    assert model.model.layers[0].mlp.up_proj.weight is weight and weight.dtype == torch.float64  # same Parameter
    reference = pretrained(saved["llama"])
    assert torch.equal(weight.float(), reference.model.layers[0].mlp.up_proj.weight)


def test_tied_weights_stay_one_parameter(saved):
    assert "lm_head.weight" not in load_file(saved["llama_tied"] / "model.safetensors")  # HF saves it once
    model = meta("llama_tied")
    load_checkpoint(model, saved["llama_tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits_of(model.eval()), logits_of(pretrained(saved["llama_tied"])))


def test_dtype_is_the_checkpoints_or_the_requested_one(saved):
    model = meta("llama_bf16")
    load_checkpoint(model, saved["llama_bf16"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs
    assert torch.equal(logits_of(model.eval()), logits_of(pretrained(saved["llama_bf16"])))
    # bf16 checkpoint into an fp32 model ...
    up = meta("llama_bf16")
    load_checkpoint(up, saved["llama_bf16"], dtype=torch.float32)
    assert {p.dtype for p in up.parameters()} == {torch.float32}
    assert torch.equal(logits_of(up.eval()), logits_of(pretrained(saved["llama_bf16"], dtype=torch.float32)))
    # ... and back: an fp32 checkpoint into bf16.
    down = meta("llama")
    load_checkpoint(down, saved["llama"], dtype=torch.bfloat16)
    assert {p.dtype for p in down.parameters()} == {torch.bfloat16}
    assert torch.equal(logits_of(down.eval()), logits_of(pretrained(saved["llama"], dtype=torch.bfloat16)))


def test_a_single_safetensors_file_and_an_index_file_are_checkpoints_too(saved):
    for path in (saved["llama"] / "model.safetensors", saved["llama_sharded"] / "model.safetensors.index.json"):
        model = meta("llama")
        load_checkpoint(model, path)
        assert torch.equal(logits_of(model.eval()), logits_of(pretrained(path.parent)))


# -- saving -----------------------------------------------------------------------------


def test_hf_round_trip_through_from_pretrained(saved, tmp_path):
    model = meta("llama_tied")
    load_checkpoint(model, saved["llama_tied"])
    save_checkpoint(model, tmp_path / "out", format="hf")
    assert (tmp_path / "out/config.json").is_file() and (tmp_path / "out/model.safetensors.index.json").is_file()
    again = pretrained(tmp_path / "out")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(logits_of(again), logits_of(pretrained(saved["llama_tied"])))
    # ... and as bf16.
    save_checkpoint(model, tmp_path / "bf16", format="hf", dtype=torch.bfloat16)
    assert pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_dcp_round_trip_on_one_device(saved, tmp_path):
    model = meta("qwen2")
    load_checkpoint(model, saved["qwen2"])
    save_checkpoint(model, tmp_path / "dcp")
    assert (tmp_path / "dcp/.metadata").is_file()
    again = meta("qwen2")
    assert load_checkpoint(again, tmp_path / "dcp").format == "dcp"
    assert torch.equal(logits_of(again.eval()), logits_of(pretrained(saved["qwen2"])))


# -- loading at TP N, simulated rank by rank ----------------------------------------------


@pytest.mark.parametrize(("name", "tp"), [("llama_sharded", 2), ("qwen2", 2), ("llama", 4)])
def test_each_simulated_rank_reads_its_slices_and_the_logits_match_from_pretrained(saved, name, tp):
    family = name.split("_")[0]
    want = logits_of(pretrained(saved[name]))
    total = sum(p.numel() * p.element_size() for p in pretrained(saved[name]).parameters())
    inputs = ids()  # outside: under LocalTensorMode, random ops draw per rank
    with simulated_load(FACTORIES[family], load_plan(PLANS[family]), tp, str(saved[name])) as sim:
        with torch.no_grad():
            outputs = sim.run(inputs)
        for rank, got in enumerate(outputs):
            assert max_abs_diff(got, want) <= allowed_diff(want, *tolerance(torch.float32)), f"rank {rank}: {max_abs_diff(got, want)}"
        read = [r.read_bytes for r in sim.results]
    # Every rank reads its shards (and the small replicated norms), far less than the whole.
    assert len(set(read)) == 1 and read[0] < total / tp * 1.1


# -- --model hf: ---------------------------------------------------------------------------


def test_model_hf_builds_from_a_directory_a_config_json_and_a_model_type(saved):
    for spec in (str(saved["qwen2"]), str(saved["qwen2"] / "config.json")):
        model = build_model(f"hf:{spec}", "meta")
        assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.hidden_size == 64
        assert model.lm_head.weight.device.type == "meta"
    default = build_model("hf:llama", "meta")
    assert type(default).__name__ == "LlamaForCausalLM" and default.config.hidden_size == 4096  # LlamaConfig()'s
    assert default.config._attn_implementation == "sdpa"


def test_model_hf_builds_a_model_transformers_refuses_sdpa_for_with_eager_attention():
    model = build_model("hf:gpt_oss", "meta")  # transformers raises for gpt-oss with attn_implementation="sdpa"
    assert type(model).__name__ == "GptOssForCausalLM" and model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hf:", "needs a model directory"),
        ("hf:./no/such/dir", "no such directory or file"),
        ("hf:lama", "did you mean llama"),
    ],
)
def test_model_hf_bad_specs_are_usage_errors(spec, message):
    with pytest.raises(ModelRefError, match=message):
        build_model(spec, "meta")


def test_apply_dry_run_with_model_hf_and_checkpoint_reports_what_each_rank_reads(saved):
    result = run("apply", "--dry-run", "--tp", "2", "--model", f"hf:{saved['llama']}", "--plan", str(PLANS["llama"]),
                 "--checkpoint", str(saved["llama_sharded"]), "--check", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ckpt = report["checkpoint"]
    assert (ckpt["format"], ckpt["files"], ckpt["loaded"], ckpt["missing"], ckpt["unexpected"]) == ("hf", 4, 21, [], [])
    assert ckpt["rank_read_bytes"] == [report["params"]["per_rank_bytes"]] * 2
    assert report["check"]["passed"] is True  # each simulated rank read its slices: same as one device
    text = run("apply", "--dry-run", "--tp", "4", "--model", f"hf:{saved['llama']}", "--plan", str(PLANS["llama"]),
               "--checkpoint", str(saved["llama"]))
    assert text.exit_code == 0, text.output
    assert "would load 21 of its 21 tensors" in text.stdout and "ranks 0-3 read " in text.stdout


# -- bad checkpoints -----------------------------------------------------------------------


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the one-file checkpoint `src` with its tensors changed by `change(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def load_error(name: str, path, **kwargs) -> CheckpointError:
    model = meta(name)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, path, **kwargs)
    return info.value


def dry_run(saved, path, *more) -> tuple[int, str]:
    result = run("apply", "--dry-run", "--tp", "2", "--model", "tpplan.models.hf:llama", "--plan", str(PLANS["llama"]), "--checkpoint", str(path), *more)
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_dry_run_finds_a_renamed_key_and_a_wrong_shape(saved, tmp_path):
    def change(t):
        t["model.layers.1.mlp.up_proj.weights"] = t.pop("model.layers.1.mlp.up_proj.weight")
        t["model.norm.weight"] = torch.ones(32)

    bad = rewrite(saved["llama"], tmp_path / "bad", change)
    code, out = dry_run(saved, bad)
    assert code == 1
    assert "TP601 1 tensors of the model are missing from" in out and "model.layers.1.mlp.up_proj.weight" in out
    assert "TP602 1 tensors of" in out and "model.layers.1.mlp.up_proj.weights (the model has model.layers.1.mlp.up_proj.weight)" in out
    assert f"{bad}/model.safetensors:1:1: TP603 model.norm.weight has shape (32,) in {bad}/model.safetensors, the model's is (64,)" in out


def test_missing_keys_fail_unless_allowed_and_then_are_initialised(saved, tmp_path):
    bad = rewrite(saved["qwen2"], tmp_path / "nobias", lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".bias")]])
    error = load_error("qwen2", bad)
    assert [p.code for p in error.problems] == ["TP601"]
    assert "6 tensors of the model are missing" in error.problems[0].message and "model.layers.0.self_attn.q_proj.bias" in error.problems[0].message
    model = meta("qwen2")
    assert all(p.device.type == "meta" for p in model.parameters())
    result = load_checkpoint(model, bad, allow_missing=["*.bias"])
    assert len(result.initialized) == 6
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias.device.type == "cpu" and torch.isfinite(bias).all()
    # The loaded weights are the checkpoint's, not re-initialised with the biases.
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, pretrained(saved["qwen2"]).model.layers[0].self_attn.q_proj.weight)
    code, out = dry_run(saved, bad)  # llama has no biases: fine; the CLI option itself:
    result = run("apply", "--dry-run", "--tp", "2", "--model", "tpplan.models.hf:qwen2", "--plan", str(PLANS["qwen2"]),
                 "--checkpoint", str(bad), "--allow-missing", "*.bias", "--format", "json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["checkpoint"]["allowed_missing"]) == 6


def test_unexpected_keys_and_wrong_shapes_leave_the_model_untouched(saved, tmp_path):
    extra = rewrite(saved["llama"], tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}))
    error = load_error("llama", extra)
    assert [p.code for p in error.problems] == ["TP602"]
    assert "model.layers.0.mlp.gate_proj.bias" in str(error) and str(extra / "model.safetensors") in str(error)
    shaped = rewrite(saved["llama"], tmp_path / "shape", lambda t: t.update({"lm_head.weight": torch.zeros(100, 64)}))
    model = meta("llama")
    with pytest.raises(CheckpointError, match=r"TP603 lm_head.weight has shape \(100, 64\) in .*, the model's is \(128, 64\)"):
        load_checkpoint(model, shaped)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated or read


def test_an_integer_tensor_for_a_float_parameter_is_a_dtype_mismatch(saved, tmp_path):
    bad = rewrite(saved["llama"], tmp_path / "int", lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    error = load_error("llama", bad)
    assert [p.code for p in error.problems] == ["TP604"] and "model.norm.weight is int32" in str(error)


def test_a_checkpoint_of_another_model(saved):
    # torchtitan-named Llama vs a transformers Llama checkpoint: nothing matches.
    with torch.device("meta"):
        from tpplan.models import llama

        model = llama.tiny()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, saved["llama"])
    assert [p.code for p in info.value.problems] == ["TP606"]
    assert "does not look like a checkpoint of this model" in str(info.value) and "tok_embeddings.weight" in str(info.value)


def test_corrupt_and_truncated_files_are_named(saved, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved["llama_sharded"], corrupt)
    victim = sorted(corrupt.glob("*.safetensors"))[1]
    victim.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json header")
    error = load_error("llama", corrupt)
    assert [p.code for p in error.problems] == ["TP605"] and error.problems[0].file == str(victim)
    truncated = tmp_path / "truncated"
    shutil.copytree(saved["llama"], truncated)
    file = truncated / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    error = load_error("llama", truncated)
    assert "TP605" in str(error) and "corrupt or truncated" in str(error) and str(file) in str(error)
    # The index names a file that is not there.
    gone = tmp_path / "gone"
    shutil.copytree(saved["llama_sharded"], gone)
    sorted(gone.glob("*.safetensors"))[0].unlink()
    assert "names files that are missing: model-00001-of-" in str(load_error("llama", gone))


def test_a_truncated_dcp_file_is_found_before_anything_is_allocated(saved, tmp_path):
    model = meta("llama")
    load_checkpoint(model, saved["llama"])
    save_checkpoint(model, tmp_path / "dcp")
    data = next((tmp_path / "dcp").glob("*.distcp"))
    size = data.stat().st_size
    os.truncate(data, size // 3)
    error = load_error("llama", tmp_path / "dcp")  # the manifest's sizes
    assert f"TP609 incomplete checkpoint {tmp_path / 'dcp'}: files differ in size from its manifest: __0_0.distcp ({size // 3} bytes, saved {size})" in str(error)
    (tmp_path / "dcp/.tpplan-checkpoint.json").unlink()  # a DCP checkpoint of another tool: the .metadata's offsets
    fresh = meta("llama")
    with pytest.raises(CheckpointError, match=r"TP609 .* shard files are shorter than its .metadata says: __0_0.distcp \(\d+ of \d+ bytes\)"):
        load_checkpoint(fresh, tmp_path / "dcp")
    assert all(p.device.type == "meta" for p in fresh.parameters())  # nothing allocated
    os.truncate(data, 0)
    data.unlink()
    assert "shard files its .metadata names are missing: __0_0.distcp" in str(load_error("llama", tmp_path / "dcp"))


def test_a_read_that_fails_half_way_says_the_model_is_partly_loaded(saved, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    model = meta("llama")
    load_checkpoint(model, saved["llama"])
    save_checkpoint(model, tmp_path / "dcp")

    def failing(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileSystemReader, "read_data", failing)
    error = load_error("llama", tmp_path / "dcp")
    assert "TP605" in str(error) and "Input/output error" in str(error) and "the model is left partly loaded" in str(error)
    monkeypatch.undo()
    (tmp_path / "dcp/.metadata").write_bytes(b"garbage")
    error = load_error("llama", tmp_path / "dcp")
    assert "TP605 the DCP metadata" in str(error) and ".metadata cannot be read" in str(error)


def test_unreadable_paths_exit_2(saved, tmp_path):
    error = load_error("llama", tmp_path / "nowhere")
    assert error.unreadable and "does not exist" in str(error)
    (tmp_path / "empty").mkdir()
    assert "is not a checkpoint: no *.safetensors" in str(load_error("llama", tmp_path / "empty"))
    code, out = dry_run(saved, tmp_path / "nowhere")
    assert code == 2 and "TP600 checkpoint" in out
    code, out = dry_run(saved, saved["llama"] / "config.json")
    assert code == 2 and "is not a checkpoint" in out


def test_a_meta_buffer_that_nothing_recomputes(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4), persistent=False)

    torch.manual_seed(0)
    save_checkpoint(Scaled(), tmp_path / "c")
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(CheckpointError, match="TP607 the non-persistent buffers scale of '' \\(Scaled\\)"):
        load_checkpoint(model, tmp_path / "c")


def test_save_to_an_unwritable_path(saved, tmp_path):
    model = meta("llama")
    load_checkpoint(model, saved["llama"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"TP608 '{tmp_path / 'file'}' is a file: the checkpoint directory '{tmp_path / 'file' / 'sub'}' cannot be created in it"):
        save_checkpoint(model, tmp_path / "file" / "sub")


def test_checkpoint_errors_are_plan_errors_with_documented_codes():
    from tpplan.lint.codes import find

    assert issubclass(CheckpointError, PlanError)
    for code in ("TP600", "TP601", "TP602", "TP603", "TP604", "TP605", "TP606", "TP607", "TP608", "TP609"):
        assert find(code) is not None
    assert run("rules", "TP603").exit_code == 0
