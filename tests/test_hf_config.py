"""One reader of a transformers config (tpplan.hf.config) behind `import-hf SOURCE`
and `--model hf:SPEC`: the same source is read, or refused for the same reason, by both."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from tpplan.cli.app import app  # noqa: E402
from tpplan.hf.config import HfConfigError, load_config  # noqa: E402
from tpplan.simulation.modelref import ModelRefError, build_model  # noqa: E402


def _import_hf_error(source: str) -> str:
    result = CliRunner().invoke(app, ["import-hf", source], env={"TPPLAN_DEBUG": None})
    assert result.exit_code == 2, result.output
    return result.output


def _model_hf_error(spec: str) -> str:
    with pytest.raises(ModelRefError) as raised:
        build_model(f"hf:{spec}", "meta")
    return str(raised.value)


@pytest.mark.parametrize(
    "write, reason",
    [
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not JSON"),
        (lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 8})), "config.json has no model_type"),
        (lambda d: (d / "notes.txt").write_text("x"), "the directory has no config.json"),
    ],
    ids=["not-json", "no-model-type", "no-config-json"],
)
def test_a_bad_directory_is_refused_for_the_same_reason_by_import_hf_and_model_hf(tmp_path, write, reason):
    write(tmp_path)
    assert reason in _import_hf_error(str(tmp_path))
    message = _model_hf_error(str(tmp_path))
    assert message.startswith(f"--model hf:{tmp_path}: ") and reason in message


def test_an_unknown_model_type_is_refused_with_the_closest_types_by_both():
    assert "neither a config path nor a transformers model type" in _import_hf_error("lama")
    assert "did you mean llama" in _import_hf_error("lama")
    assert "did you mean llama" in _model_hf_error("lama")


def test_a_config_file_by_any_name_reads_as_its_directory_would(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    renamed = tmp_path / "llama-small.json"
    renamed.write_text((tmp_path / "config.json").read_text())
    assert load_config(tmp_path).hidden_size == load_config(renamed).hidden_size == 64
    with pytest.raises(HfConfigError, match="no such directory or file"):
        load_config(tmp_path / "missing" / "dir")
