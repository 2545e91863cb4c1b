"""Memory planning in `apply --dry-run`: per-rank memory of one training step from
torch's MemTracker / FSDPMemTracker on fake tensors, and bytes per collective.

Expected figures are derived from the model config (tests/expected.py), not
copied from a run: what stays between steps is exactly the parameters (sharded
by TP, and by FSDP on dp) and AdamW's two moments plus one step counter per
parameter; collective bytes are activation, logit and parameter sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from expected import FP32, llama_bytes
from tpplan.cli.app import app
from tpplan.models import llama, mlp
from tpplan.runtime.dryrun import dry_run
from tpplan.memory.memory import measure_training_step, parse_size
from tpplan.simulation.comm_axes import collective_bytes
from tpplan.runtime.torchrun import ApplyOptions
from tpplan.check.training import compare_training
from tpplan.simulation.training import TrainOptions, train_steps

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
TINY = "tpplan.models.llama:tiny"
CFG = llama.tiny().config
N_PARAMS = 3 + 9 * CFG.n_layers  # embedding, final norm, head + per layer 2 norms and 7 Linears

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def plan_memory(plan: str = "llama_tp.yaml", **train) -> dict:
    tp = train.pop("tp", 2)
    report = dry_run(ApplyOptions(plan=str(PLANS / plan), model=TINY, tp=tp, train=TrainOptions(**train)))
    assert report.ok, report.problems
    return report.to_json()


def run(*args: str):
    return CliRunner().invoke(app, ["apply", *args], env={"FORCE_COLOR": None, "NO_COLOR": None})


@pytest.mark.parametrize("text, size", [("80GiB", 80 * 2**30), ("40 GB", 40 * 10**9), ("1.5MiB", 3 * 2**19), ("512", 512)])
def test_sizes_read_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


def test_a_size_without_a_number_is_refused():
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_tp_alone_keeps_the_tp_shard_of_the_parameters_and_adamw_state_between_steps():
    report = plan_memory(optimizer="adamw")
    _, per_rank = llama_bytes(CFG, 2)
    memory = report["memory"]
    assert memory["parameters"] == per_rank  # every parameter is alive at the peak
    assert memory["after_step"]["parameters"] == per_rank
    assert memory["after_step"]["gradients"] == 0
    assert memory["after_step"]["optimizer"] == 2 * per_rank + FP32 * N_PARAMS  # exp_avg, exp_avg_sq, step
    assert memory["per_rank_peak_bytes"] == sum(memory[k] for k in ("parameters", "gradients", "optimizer", "activations", "temporaries"))
    assert memory["fits"] is None and report["world_size"] == 2


def test_fsdp_on_dp_halves_what_stays_and_gathers_and_scatters_the_tp_shards():
    report = plan_memory(fsdp=2, optimizer="adamw")
    _, per_rank = llama_bytes(CFG, 2)  # every dim FSDP shards is even: no padding
    assert (report["world_size"], report["tp"], report["dp"]) == (4, 2, 2)
    assert report["memory"]["after_step"]["parameters"] == per_rank // 2
    assert report["memory"]["after_step"]["optimizer"] == per_rank + FP32 * N_PARAMS
    batch, seq = 2, 8
    activation, logits = batch * seq * CFG.dim * FP32, batch * seq * CFG.vocab_size * FP32
    # FSDP all-gathers each block's (and the root's) TP shard before the forward and
    # reduce-scatters its gradients after the backward; the plan's own collectives beside them.
    assert report["comm_bytes"]["forward"] == {"all_gather": per_rank + logits, "all_reduce": (2 * CFG.n_layers + 1) * activation}
    assert report["comm_bytes"]["backward"]["reduce_scatter"] == per_rank
    assert report["comms"]["forward"] == {"all_gather": 1 + CFG.n_layers + 1, "all_reduce": 2 * CFG.n_layers + 1}


def test_collective_bytes_of_tp_are_activation_and_logit_sizes():
    report = plan_memory(batch=4, seq=16, optimizer="none")
    activation, logits = 4 * 16 * CFG.dim * FP32, 4 * 16 * CFG.vocab_size * FP32
    assert report["comm_bytes"] == {
        "forward": {"all_gather": logits, "all_reduce": (2 * CFG.n_layers + 1) * activation},
        "backward": {"all_reduce": (2 * CFG.n_layers + 1) * activation},
    }
    assert report["memory"]["optimizer"] == 0 and report["memory"]["after_step"]["gradients"] == 0
    assert (report["memory"]["batch"], report["memory"]["seq"]) == (4, 16)


def test_bf16_halves_the_parameters():
    fp32, bf16 = plan_memory(optimizer="sgd"), plan_memory(optimizer="sgd", dtype="bf16")
    assert bf16["memory"]["after_step"]["parameters"] * 2 == fp32["memory"]["after_step"]["parameters"]
    assert bf16["memory"]["dtype"] == "bfloat16" and fp32["memory"]["after_step"]["optimizer"] == 0  # SGD keeps no state


def test_loss_parallel_keeps_the_logits_sharded_and_skips_their_all_gather():
    step = dict(batch=2, seq=128, optimizer="none")  # the logits dominate the peak
    plain, sharded = plan_memory("llama_tp_sp.yaml", **step), plan_memory("llama_tp_sp_loss_parallel.yaml", **step)
    logits = 2 * 128 * CFG.vocab_size * FP32
    assert plain["comm_bytes"]["forward"]["all_gather"] - sharded["comm_bytes"]["forward"]["all_gather"] == logits
    assert sharded["memory"]["per_rank_peak_bytes"] < plain["memory"]["per_rank_peak_bytes"]


def test_the_peak_is_located_at_a_module_or_the_loss():
    memory = plan_memory(batch=2, seq=64, fsdp=2)["memory"]
    site = memory["peak_module"]
    names = {name for name, _ in llama.tiny().named_modules()}
    assert site in ("loss", "loss (backward)", "optimizer step") or site.rsplit(" (", 1)[0] in names | {"<root>"}, site


def test_the_same_measurement_runs_on_real_tensors():
    torch.manual_seed(0)
    model = llama.tiny()
    step = measure_training_step(model, (torch.randint(0, CFG.vocab_size, (2, 8)),), "sgd")
    _, whole = llama_bytes(CFG, 1)
    assert step.after_step["parameters"] == whole and step.categories["parameters"] == whole
    assert all(loss == loss and loss > 0 for loss in step.losses)  # real values: not NaN


def test_a_transformers_model_plans_on_fake_tensors_what_it_measures_on_real_ones():
    """transformers' masks: on fake position ids it cannot see that nothing is packed and
    would build a causal mask the real run skips (hf/masks.py); with the real run's answer
    every category of one step is equal, the model built inside fake mode as the dry run
    builds it (transformers loaded by the factory)."""
    pytest.importorskip("transformers")
    from tpplan.models.hf import qwen3_moe
    from tpplan.simulation.modelref import build_model
    from tpplan.simulation.simulate import default_inputs, fake_tensors, simulated_world

    torch.manual_seed(0)
    model = qwen3_moe()
    real = measure_training_step(model, (default_inputs(model, 1, 256),), "adamw")
    with simulated_world(1, 0), fake_tensors():
        model = build_model("tpplan.models.hf:qwen3_moe", "cpu")
        fake = measure_training_step(model, (default_inputs(model, 1, 256),), "adamw")
    assert fake.categories == real.categories and fake.peak_bytes == real.peak_bytes


def test_memory_limit_says_which_plan_degrees_fit(tmp_path):
    small = plan_memory(tp=8, optimizer="adamw")["memory"]["per_rank_peak_bytes"]
    large = plan_memory(tp=2, optimizer="adamw")["memory"]["per_rank_peak_bytes"]
    limit = (small + large) // 2
    result = run("--plan", str(PLANS / "llama_tp.yaml"), "--model", TINY, "--dry-run", "--memory-limit", str(limit), "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["tp"]: row["fits"] for row in report["memory_by_tp"]}
    assert rows == {2: False, 4: rows[4], 8: True}
    assert report["tp"] == min(tp for tp, fits in rows.items() if fits)  # the smallest degree that fits
    assert report["memory"]["fits"] is True and report["memory"]["limit_bytes"] == limit


def test_the_text_report_has_a_bar_per_category_and_the_verdict():
    result = run("--plan", str(PLANS / "llama_tp.yaml"), "--model", TINY, "--dry-run", "--tp", "2", "--fsdp", "2", "--memory-limit", "1KiB")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Memory per rank, one training step (TP 2 x FSDP 2, batch 2," in out.replace("\n", " ")
    assert "seq 8, float32, optimizer adamw)" in out.replace("\n", " ")
    for category in ("parameters", "gradients", "optimizer", "activations", "temporaries"):
        assert f"│ {category} " in out
    assert "█" in out and "limit 1.00 KiB per rank: does not fit" in out
    assert "forward bytes" in out and "backward bytes" in out


@pytest.mark.parametrize("args, message", [
    (["--memory-limit", "much"], "--memory-limit: 'much' is not a size"),
    (["--dtype", "fp8"], "'fp8' is not one of"),
])
def test_bad_memory_options_are_usage_errors(args, message):
    result = run("--plan", str(PLANS / "llama_tp.yaml"), "--model", TINY, "--dry-run", "--tp", "2", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_without_memory_options_the_dry_run_reports_no_memory():
    report = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model=TINY, tp=2)).to_json()
    assert "memory" not in report and "comm_bytes" not in report


def test_collective_bytes_take_the_larger_buffer():
    full, shard = torch.empty(8, 4), torch.empty(2, 4)
    assert collective_bytes((full, shard, None), (full, object())) == full.numel() * 4  # all-gather: its output
    assert collective_bytes((shard, "sum", 4, "group"), shard) == shard.numel() * 4


def test_training_comparison_catches_a_run_that_trained_differently():
    torch.manual_seed(0)
    model, inputs = mlp.tiny(), (torch.randn(4, 8, 32),)
    reference = mlp.tiny()
    reference.load_state_dict(model.state_dict())
    losses, _ = train_steps(model, inputs, 3, "adamw")
    assert compare_training(model, reference, inputs, losses, "adamw").passed
    reference.load_state_dict(model.state_dict())  # the reference now starts where the trained model ended
    wrong = compare_training(model, reference, inputs, losses, "adamw")
    assert not wrong.passed and wrong.problems[0].startswith("step 1: loss ")


def test_under_torchrun_fsdp_takes_the_world_that_tp_leaves():
    from tpplan.runtime.devices import fsdp_tp
    from tpplan.runtime.options import ApplyOptionsError

    assert fsdp_tp(8, None, 2) == 4
    assert fsdp_tp(8, 4, 2) == 4
    assert fsdp_tp(8, 2, None) == 2  # no FSDP: the TP degree as given
    with pytest.raises(ApplyOptionsError) as info:
        fsdp_tp(8, None, 3)
    assert (info.value.option, info.value.kind, info.value.facts) == ("fsdp", "not-a-divisor", {"fsdp": 3, "world": 8})
    with pytest.raises(ApplyOptionsError) as info:
        fsdp_tp(8, 2, 2)
    assert (info.value.option, info.value.kind) == ("fsdp", "world-mismatch")


def test_the_planned_step_frees_the_logits_in_the_losss_backward_as_a_plain_training_loop_does():
    """A vocabulary-heavy step measured by measure_training_step and by torch's MemTracker
    around a plain loop (forward, cross-entropy, backward): the same peak. Holding the
    logits past the loss (they live only in its graph) was a 10% error at 405B."""
    import copy

    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = llama.Transformer(llama.LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=8192))
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, 8192, (1, 128))
    planned = measure_training_step(model, (tokens,), "none")

    targets = torch.randint(0, 8192, (1, 128))
    tracker = MemTracker()
    tracker.track_external(plain, tokens)
    with tracker:
        loss = F.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
    peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    logits = 128 * 8192 * 4
    assert abs(planned.peak_bytes - peak) < logits / 4, (planned.peak_bytes, peak)
