"""LoRA adapters follow their base layer: the plan written for transformers' Llama
and Qwen3 applies as it is to the models with peft's LoRA adapters on every
projection (tpplan.hf_models:llama_lora, qwen3_lora: r 4, only adapters train);
the base layer is sharded by the rule, the adapters' placements are derived."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tpplan import PlanError, hf_models, load_plan  # noqa: E402
from tpplan.cli.app import app  # noqa: E402
from tpplan.lint.checks import check_model  # noqa: E402
from tpplan.runtime.simulate import simulated_world, tp_mesh  # noqa: E402

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


def test_a_peft_model_names_the_full_prefix_in_did_you_mean():
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = get_peft_model(hf_models.llama(), LoraConfig(r=4, target_modules=hf_models.LORA_TARGETS))
    with pytest.raises(PlanError) as info:
        load_plan(PLANS / "llama_tp.yaml").match(model)
    first = info.value.problems[0]
    assert first.code == "TP200"
    assert first.message.endswith("did you mean 'base_model.model.model.embed_tokens'?")
    # the model inside the wrapper takes the plan as it is
    assert len(load_plan(PLANS / "llama_tp.yaml").match(model.base_model.model)) > 0


def dry_run(model: str, plan: str, tp: int, *more: str):
    return CliRunner().invoke(app, ["apply", "--dry-run", "--tp", str(tp), "--model", f"tpplan.hf_models:{model}",
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
