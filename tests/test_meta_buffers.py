"""A model built for a checkpoint keeps its real buffers: `meta_parameters()` puts
only the parameters on meta, torchtitan's `init_weights(buffer_device=)` is
recognised, and a model wrapped by peft gets the full prefix in "did you mean".
The models are torchtitan-style decoders (tests/titan_style.py)."""

from __future__ import annotations

import pytest
import torch
import titan_style
from typer.testing import CliRunner

from tpplan import CheckpointError, load_checkpoint, load_plan, meta_parameters, save_checkpoint
from tpplan.simulation.simulated_load import simulated_load
from tpplan.cli.app import app
from tpplan.core.globs import ModuleTree, compile_glob
from tpplan.simulation.modelref import build_model

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, the model saved there): a PlainDecoder with seeded weights, as DCP."""
    torch.manual_seed(3)
    source = titan_style.plain()
    path = tmp_path_factory.mktemp("titan") / "ckpt"
    save_checkpoint(source, path)
    return path, source


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(titan_style.tokens())


def test_meta_parameters_puts_only_the_parameters_on_meta():
    with meta_parameters():
        model = titan_style.plain()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.freqs_cis.device.type == "cpu" and model.freqs_cis.dtype == torch.complex64
    assert torch.equal(model.freqs_cis, titan_style.plain().freqs_cis)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    # the hook is gone afterwards
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_a_model_whose_buffer_comes_from_its_constructor_loads(saved):
    path, source = saved
    with meta_parameters():
        model = titan_style.plain()
    result = load_checkpoint(model, path)
    assert result.recomputed_buffers == []  # nothing to recompute: the buffer is the constructor's
    assert torch.equal(logits(model), logits(source))


def test_torchtitans_init_weights_buffer_device_recreates_a_meta_buffer(saved):
    path, source = saved
    with torch.device("meta"):
        model = titan_style.tiny()
    calls = titan_style.Decoder.init_weights_calls
    result = load_checkpoint(model, path)
    assert titan_style.Decoder.init_weights_calls == calls + 1
    assert result.recomputed_buffers == ["freqs_cis"]
    assert model.freqs_cis.device.type == "cpu"
    # init_weights initialised the parameters first; the read then overwrote them all
    assert torch.equal(logits(model), logits(source))


def test_a_meta_buffer_nothing_recomputes_names_meta_parameters(saved):
    path, _ = saved
    with torch.device("meta"):
        model = titan_style.plain()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, path)
    [problem] = info.value.problems
    assert problem.code == "TP607"
    assert problem.message.startswith("the non-persistent buffers freqs_cis of '' (PlainDecoder) were on the meta device")
    assert "no init_weights(buffer_device=)" in problem.message
    assert problem.message.endswith("build the model under tpplan.meta_parameters() (parameters on meta, buffers computed as written)")


def test_build_model_for_a_checkpoint_keeps_real_buffers():
    model = build_model("titan_style:plain", "meta", real_buffers=True)
    assert {p.device.type for p in model.parameters()} == {"meta"} and model.freqs_cis.device.type == "cpu"
    assert build_model("titan_style:plain", "meta").freqs_cis.device.type == "meta"


def test_simulated_load_at_tp_2_matches_the_single_device_model(saved):
    path, source = saved
    plan = load_plan(text=titan_style.PLAN)
    tokens = titan_style.tokens()  # outside LocalTensorMode, where random ops differ per rank
    with simulated_load(titan_style.plain, plan, 2, str(path)) as loaded:
        outputs = [out.detach().clone() for out in loaded.run(tokens)]
    assert len(outputs) == 2
    for out in outputs:
        torch.testing.assert_close(out, logits(source), rtol=0, atol=1e-5)


def test_dry_run_check_with_a_checkpoint_passes_for_constructor_buffers(saved, tmp_path):
    path, _ = saved
    plan = tmp_path / "plan.yaml"
    plan.write_text(titan_style.PLAN)
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--tp", "2", "--model", "titan_style:plain", "--inputs", "titan_style:tokens",
                                      "--plan", str(plan), "--checkpoint", str(path), "--check"])
    assert result.exit_code == 0, result.output
    assert "check against a single device: passed" in result.output


def test_a_rule_written_for_the_unwrapped_model_names_the_wrappers_prefix():
    names = ["", "base_model", "base_model.model", "base_model.model.model", "base_model.model.model.embed_tokens",
             "base_model.model.model.layers", "base_model.model.model.layers.0", "base_model.model.model.layers.0.q_proj",
             "base_model.model.lm_head"]
    tree = ModuleTree(names)
    assert tree.explain_no_match(compile_glob("model.embed_tokens")) == (
        "the model is wrapped (peft's get_peft_model and the like): under 'base_model.model' it matches "
        "base_model.model.model.embed_tokens; did you mean 'base_model.model.model.embed_tokens'?"
    )
    assert tree.explain_no_match(compile_glob("model.layers.*.q_proj")).endswith("did you mean 'base_model.model.model.layers.*.q_proj'?")
    assert tree.explain_no_match(compile_glob("nothing")) == "no child of the root module matches 'nothing' (children: base_model)"
