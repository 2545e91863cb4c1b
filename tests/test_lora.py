"""LoRA adapters follow their base layer: the plan written for transformers' Llama
and Qwen3 applies as it is to the models with peft's LoRA adapters on every
projection (tpplan.models.hf:llama_lora, qwen3_lora: r 4, only adapters train);
the base layer is sharded by the rule, the adapters' placements are derived."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tpplan import PlanError, load_plan  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.cli.app import app  # noqa: E402
from tpplan.lint.checks import check_model  # noqa: E402
from tpplan.simulation.simulate import simulated_world, tp_mesh  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

PLANS = Path(__file__).resolve().parent.parent / "plans" / "hf"


def applied(factory, tp: int):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = factory()
    with simulated_world(tp):
        load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(tp))
    return model


def placement(t) -> object:
    return t.placements[0] if isinstance(t, DTensor) else None


def test_colwise_and_rowwise_bases_derive_their_adapters():
    model = applied(hf_models.llama_lora, 2)
    attn = model.model.layers[0].self_attn
    q, o = attn.q_proj, attn.o_proj
    assert placement(q.base_layer.weight) == Shard(0)
    assert placement(q.lora_A["default"].weight) == Replicate() and placement(q.lora_B["default"].weight) == Shard(0)
    assert placement(o.base_layer.weight) == Shard(1)
    assert placement(o.lora_A["default"].weight) == Shard(1) and placement(o.lora_B["default"].weight) == Replicate()
    down = model.model.layers[0].mlp.down_proj
    assert placement(down.lora_A["default"].weight) == Shard(1) and placement(down.lora_B["default"].weight) == Replicate()
    # only the adapters train, as peft left them; scaling and dropout untouched
    assert not q.base_layer.weight.requires_grad and q.lora_A["default"].weight.requires_grad
    assert q.scaling == {"default": 2.0} and isinstance(q.lora_dropout["default"], torch.nn.Identity)


def trainable_bytes(model) -> int:
    """This rank's bytes of trainable parameters (local shards)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )


@pytest.mark.parametrize("factory", [hf_models.llama_lora, hf_models.qwen3_lora])
@pytest.mark.parametrize("tp, expected", [(1, 32768), (2, 23552), (4, 18944)])
def test_per_rank_trainable_bytes(factory, tp, expected):
    # Per layer (r 4, hidden 64, 4 KV heads of 8, intermediate 128), fp32: replicated
    # q/k/v/gate/up lora_A and o/down lora_B, 1792 elements; sharded q/k/v/gate/up
    # lora_B and o/down lora_A, 2304 / tp. Two layers.
    if tp == 1:
        torch.manual_seed(0)
        model = factory()
    else:
        model = applied(factory, tp)
    assert trainable_bytes(model) == expected == 2 * (1792 + 2304 // tp) * 4


def test_the_models_plan_lints_clean_on_the_lora_model():
    plan = load_plan(PLANS / "llama_tp.yaml")
    with torch.device("meta"):
        model = hf_models.llama_lora()
    assert [str(p) for p in check_model(plan, model, [2, 4]) if p.severity == "error"] == []


def peft_model():
    from peft import get_peft_model

    with torch.device("meta"):
        return get_peft_model(hf_models.llama(), hf_models._lora_config())


def test_the_models_plan_applies_to_the_peft_model_under_base_model_model():
    # people hold peft's PeftModel: the plan written for the model applies to it as it
    # is, to the same modules as on the model inside (whose paths the prefix lengthens)
    model = peft_model()
    plan = load_plan(PLANS / "llama_tp.yaml")
    inner = plan.match(model.base_model.model)
    assert list(plan.match(model)) == [f"base_model.model.{fqn}" for fqn in inner] and len(inner) == 20
    with simulated_world(2):
        plan.apply(model, tp_mesh(2))
    q = model.base_model.model.model.layers[1].self_attn.q_proj
    assert placement(q.base_layer.weight) == Shard(0) and placement(q.lora_B["default"].weight) == Shard(0)
    assert placement(q.lora_A["default"].weight) == Replicate()
    assert placement(model.base_model.model.lm_head.weight) == Shard(0)


def test_a_plan_written_with_the_prefix_still_applies_at_the_root():
    plan = load_plan(PLANS / "llama_tp.yaml")
    prefixed = load_plan(text="version: 1\nrules:\n  base_model.model.model.layers.*.mlp.down_proj: rowwise\n")
    assert list(prefixed.match(peft_model())) == ["base_model.model.model.layers.0.mlp.down_proj", "base_model.model.model.layers.1.mlp.down_proj"]
    assert plan.module_tree(peft_model())[1] == "base_model.model" and prefixed.module_tree(peft_model())[1] == ""


def test_a_rule_matching_nothing_in_the_peft_model_is_explained_below_the_prefix():
    with pytest.raises(PlanError) as info:
        load_plan(text="version: 1\nrules:\n  model.layerz.*.mlp: no_parallel\n").match(peft_model())
    [problem] = info.value.problems
    assert problem.code == "TP200" and (problem.line, problem.column) == (3, 3)
    assert problem.message == ("rule 'model.layerz.*.mlp' matches no module of the model at 'base_model.model': no child of modules matching 'model' matches "
                               "'layerz' (children: embed_tokens, layers, norm, rotary_emb); did you mean 'model.layers.*.mlp'?")


def dry_run(model: str, plan: str, tp: int, *more: str):
    return CliRunner().invoke(app, ["apply", "--dry-run", "--tp", str(tp), "--model", f"tpplan.models.hf:{model}",
                                    "--plan", str(PLANS / plan), "--check", *more])


def test_lora_llama_at_tp_2_matches_one_device_over_3_training_steps():
    result = dry_run("llama_lora", "llama_tp.yaml", 2, "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "check against a single device: passed" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("model, plan, tp", [
    ("llama_lora", "llama_tp.yaml", 4),
    ("qwen3_lora", "qwen3_tp.yaml", 2),
    ("qwen3_lora", "qwen3_tp.yaml", 4),
    ("llama_kv2_lora", "llama_tp.yaml", 4),  # KV heads replicated: lora_B of k/v too
])
def test_lora_models_match_one_device_over_3_training_steps(model, plan, tp):
    result = dry_run(model, plan, tp, "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "check against a single device: passed" in result.output


PEFT_NOTE = "the model is peft's PeftModel: the plan's rules apply to the model it wraps, at 'base_model.model'"


def test_the_peft_model_at_tp_2_matches_one_device_with_one_note():
    result = dry_run("llama_peft", "llama_tp.yaml", 2, "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["check"]["passed"] is True
    assert report["notes"].count(PEFT_NOTE) == 1
    assert report["modules"]["base_model.model.lm_head"] == "colwise" and len(report["modules"]) == 20


@pytest.mark.slow
def test_the_peft_model_at_tp_4_matches_one_device_over_3_training_steps_with_one_note():
    result = dry_run("llama_peft", "llama_tp.yaml", 4, "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "check against a single device: passed" in result.output
    assert result.output.count("note: " + PEFT_NOTE) == 1
