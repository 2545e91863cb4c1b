"""`--check` never fails a correct plan for reasons outside the plan (dropout), and a
failing check names the first differing tensor at the rule to blame."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpplan.runtime.dryrun import dry_run
from tpplan.check.first_difference import owning_rule
from tpplan.runtime.torchrun import ApplyOptions

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def test_a_model_with_dropout_passes_check_with_dropout_off_and_says_so(tmp_path):
    pytest.importorskip("transformers")
    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import tiny_config

    config = tiny_config("seed_oss")
    assert config.attention_dropout == 0.1 and config.residual_dropout == 0.1  # Seed-OSS trains with dropout
    config.save_pretrained(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text(import_hf(tmp_path, output=plan).text)
    report = dry_run(ApplyOptions(plan=str(plan), model="tpplan.models.hf_any:seed_oss", tp=2, check=True))
    assert report.ok, report.problems
    assert report.check.passed and report.check.max_abs_diff < 1e-4
    [note] = [n for n in report.notes if "dropout" in n]
    assert note == (
        "--check ran both sides in eval mode, so dropout is off (it draws different masks on each side): "
        "attention_dropout=0.1, residual_dropout=0.1"
    )


def test_a_model_without_dropout_gets_no_note():
    report = dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny", tp=2, check=True))
    assert report.ok and not any("dropout" in n for n in report.notes)


def test_a_failed_check_names_the_first_differing_tensor_at_its_rule(tmp_path):
    broken = tmp_path / "broken.yaml"
    # Row-parallel out_proj whose partial sums are never reduced (line 15 of the plan)
    broken.write_text((PLANS / "mlp_tp.yaml").read_text().replace("blocks.*.out_proj: rowwise", "blocks.*.out_proj: {style: rowwise, output_layouts: partial}"))
    report = dry_run(ApplyOptions(plan=str(broken), model="tpplan.models.mlp:tiny", tp=2, check=True))
    [problem] = report.problems
    assert (problem.code, problem.file, problem.line, problem.column) == ("TP505", str(broken), 15, 3)
    assert problem.message.startswith("--check failed at TP 2: output: rank 0 differs by up to ")
    # blocks.0.in_proj's output is a local shard (not comparable); blocks.0.out_proj's is the first that differs
    assert "; the output of 'blocks.0.out_proj' is the first tensor that differs (rank 0: by up to " in problem.message
    assert problem.message.endswith("; located at rule 'blocks.*.out_proj' (its rule)")


def test_the_rule_to_blame_is_the_modules_own_or_its_closest_planned_ancestors():
    claimed = {"layers.0.attn": "R_attn", "layers.0.attn.wq": "R_wq", "layers.0.mlp.up": "R_up"}
    order = ["layers.0.norm", "layers.0.attn.wq", "layers.0.attn", "layers.0.mlp.act", "layers.0.mlp.up", "layers.0.mlp"]
    assert owning_rule(claimed, "layers.0.attn.wq", order) == ("R_wq", "its rule")
    assert owning_rule(claimed, "layers.0.attn.inner.x", order) == ("R_attn", "the rule of its closest planned ancestor 'layers.0.attn'")
    # no planned ancestor: the last planned module that ran before it produced its input
    assert owning_rule(claimed, "layers.0.mlp.act", order) == ("R_attn", "the rule of 'layers.0.attn', the last planned module that ran before it")
    assert owning_rule(claimed, "layers.0.norm", order) == (None, None)


# -- replica consistency (TP506) and --steps in the dry run ---------------------------------------------


class ScaledBlock(__import__("torch").nn.Module):
    """in_proj -> relu -> * scale -> out_proj: a learnable scalar between colwise and rowwise."""

    def __init__(self):
        import torch

        super().__init__()
        self.in_proj = torch.nn.Linear(16, 32)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.out_proj = torch.nn.Linear(32, 16)

    def forward(self, x):
        import torch

        return x + self.out_proj(torch.relu(self.in_proj(x)) * self.scale)


def scaled_mlp():
    import torch

    return torch.nn.Sequential(ScaledBlock(), ScaledBlock())


SCALED_PLAN = "version: 1\nrules:\n  '*.in_proj': colwise\n  '*.out_proj': rowwise\n"


@pytest.mark.parametrize("steps", [0, 2])
def test_a_replicated_parameter_on_sharded_activations_is_located_with_its_parameter(tmp_path, steps):
    plan = tmp_path / "scaled.yaml"
    plan.write_text(SCALED_PLAN)
    report = dry_run(ApplyOptions(plan=str(plan), model="test_check_trust:scaled_mlp", tp=2, check=True, steps=steps))
    assert [(p.code, p.line, p.column) for p in report.problems] == [("TP506", 3, 3), ("TP506", 3, 3)]
    for problem, block in zip(report.problems, ("0", "1")):
        # each rank sums the scale's gradient over its own half of the hidden features; nothing reduces it
        assert problem.message.startswith(
            f"at TP 2, replicated parameter '{block}.scale': its gradient differs between ranks after backward (rank 1 from rank 0 by up to "
        )
        assert problem.message.endswith(
            f"; located at rule '*.in_proj' (the rule of '{block}.in_proj', the first planned module inside '{block}')"
        )
    assert not report.check.passed


@pytest.mark.parametrize("plan, model", [("mlp_tp.yaml", "tpplan.models.mlp:tiny"),
                                         pytest.param("llama_tp_sp.yaml", "tpplan.models.llama:tiny", marks=pytest.mark.slow)])  # ~9 s
def test_steps_with_check_in_the_dry_run_match_one_device_after_each_adamw_step(plan, model):
    report = dry_run(ApplyOptions(plan=str(PLANS / plan), model=model, tp=2, check=True, steps=3))
    assert report.ok, report.problems
    assert report.check.passed and report.check.max_abs_diff < 1e-4


def test_replicas_are_compared_after_each_step():
    import torch

    from tpplan import load_plan
    from tpplan.check.verify import check_parity

    inputs = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    result = check_parity(scaled_mlp, load_plan(text=SCALED_PLAN), 2, inputs, steps=2)
    found = {(r.parameter, r.kind, r.when) for r, _, _ in result.replicas}
    # then the scale itself differs: each rank moved it by its own gradient
    assert {("0.scale", "gradient", "after backward"), ("0.scale", "gradient", "after step 1"), ("0.scale", "value", "after step 2"),
            ("1.scale", "value", "after step 2")} <= found
    assert all(r.parameter.endswith(".scale") for r, _, _ in result.replicas)
    assert {rule.pattern for _, rule, _ in result.replicas} == {"*.in_proj"}


def test_tp506_is_in_the_codes_catalog():
    from tpplan.lint.codes import find

    entry = find("TP506")
    assert entry.name == "replicas-diverge" and "learnable scale between a colwise and a rowwise Linear" in entry.doc


# -- the same under real torchrun gloo ranks ------------------------------------------------------------


def _torchrun_check(tmp_path, plan_text: str, model: str, *extra: str) -> dict:
    import json

    from test_torchrun import torchrun

    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text)
    result = torchrun(2, "-m", "tpplan", "apply", "--model", model, "--plan", str(plan), "--check", "--format", "json", *extra,
                      pythonpath=Path(__file__).parent, timeout=240)
    assert result.returncode in (0, 1) and result.stdout, result.stderr[-3000:]
    return json.loads(result.stdout)


FUSED_PLAIN_COLWISE = """\
version: 1
rules:
  blocks.*.attn.qkv: colwise
  blocks.*.attn.proj: rowwise
"""


def test_under_torchrun_a_failed_check_names_the_first_differing_tensor_and_blames_the_rule_the_dry_run_blames(tmp_path):
    # A fused qkv sharded plain colwise: each rank's local slice is right, the attention
    # splits it into q, k and v as if whole, and attn.proj's output differs first.
    report = _torchrun_check(tmp_path, FUSED_PLAIN_COLWISE, "tpplan.models.fused:tiny")
    [problem] = report["problems"]
    assert problem["message"].startswith("--check failed: rank 0: output 0 differs by up to ")
    # every rank gathered every module's output: blocks.0.attn.qkv's is a local shard, blocks.0.attn.proj's differs first
    assert "; the output of 'blocks.0.attn.proj' is the first tensor that differs (rank 0: by up to " in problem["message"]
    # ... but rerun on the single-device run's inputs, attn (not proj) computes wrong: the qkv rule is blamed
    blame = ("; located at rule 'blocks.*.attn.qkv' (the rule of 'blocks.0.attn.qkv', the first planned module inside 'blocks.0.attn'; "
             "given the single-device run's own inputs, 'blocks.0.attn' still computes wrong values, 'blocks.0.attn.proj' right ones)")
    assert problem["message"].endswith(blame)
    dry = dry_run(ApplyOptions(plan=str(tmp_path / "plan.yaml"), model="tpplan.models.fused:tiny", tp=2, check=True))
    [simulated] = dry.problems
    assert simulated.message.endswith(blame)
    assert (problem["code"], problem["file"], problem["line"], problem["column"]) == (
        simulated.code, simulated.file, simulated.line, simulated.column) == ("TP505", str(tmp_path / "plan.yaml"), 3, 3)


def test_under_torchrun_diverging_replicas_are_found_by_checksum_after_backward_and_each_step(tmp_path):
    report = _torchrun_check(tmp_path, SCALED_PLAN, "test_check_trust:scaled_mlp", "--steps", "2", "--optimizer", "sgd")
    assert report["ok"] is False and report["check"]["passed"] is False
    assert {(p["code"], p["line"], p["column"]) for p in report["problems"]} == {("TP506", 3, 3)}
    messages = [p["message"] for p in report["problems"]]
    assert len(messages) == 2  # each parameter once, at its first difference
    for message, block in zip(messages, ("0", "1")):
        assert message.startswith(
            f"at TP 2, replicated parameter '{block}.scale': its gradient differs between ranks after backward (rank 1 from rank 0 by up to "
        )
        assert message.endswith(f"; located at rule '*.in_proj' (the rule of '{block}.in_proj', the first planned module inside '{block}')")


@pytest.mark.slow  # torchrun cost; in-process and other real-rank tests cover it by default
def test_under_torchrun_a_model_with_dropout_passes_check_with_dropout_off_and_says_so(tmp_path):
    pytest.importorskip("transformers")
    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import tiny_config

    tiny_config("seed_oss").save_pretrained(tmp_path)  # attention_dropout and residual_dropout 0.1
    report = _torchrun_check(tmp_path, import_hf(tmp_path).text, "tpplan.models.hf_any:seed_oss", "--steps", "1")
    assert report["ok"] is True and report["problems"] == [], report["problems"]
    assert report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-4
    assert ("--check ran both sides in eval mode, so dropout is off (it draws different masks on each side): "
            "attention_dropout=0.1, residual_dropout=0.1") in report["notes"]


def test_replica_digests_are_compared_within_each_tp_group_of_a_dp_x_tp_world():
    """Four ranks as threads (dp 2 x tp 2), `gather` an all-gather between them: rank 1's
    gradient and rank 3's value differ from their TP group's first rank, each by 0.5."""
    import threading

    import torch

    from tpplan.check.replicas import differences_across_ranks

    world, tp = 4, 2
    models = [torch.nn.Linear(3, 2) for _ in range(world)]
    for model in models:
        torch.nn.init.constant_(model.weight, 1.0)
        torch.nn.init.constant_(model.bias, 0.25)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    with torch.no_grad():
        models[1].bias.grad[1] += 0.5
        models[3].weight[0, 2] -= 0.5
    slots, barrier, found = [None] * world, threading.Barrier(world), [None] * world

    def rank(r):
        def gather(value):
            slots[r] = value
            barrier.wait()
            everyone = list(slots)
            barrier.wait()
            return everyone

        found[r] = differences_across_ranks(models[r], "after step 1", gather, tp)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f == found[0] for f in found)  # every rank made the same calls and got the same answer
    assert [(d.parameter, d.kind, d.rank, d.base, d.diff) for d in found[0]] == [
        ("bias", "gradient", 1, 0, 0.5), ("weight", "value", 3, 2, 0.5)]
    assert found[0][1].describe() == (
        "replicated parameter 'weight': its value differs between ranks after step 1 (rank 3 from rank 2 by up to 0.5)")


def test_train_steps_hands_each_steps_gradients_to_after_step_then_clears_them():
    import torch

    from tpplan.simulation.training import train_steps

    model = torch.nn.Linear(4, 4)
    seen = []
    train_steps(model, (torch.randn(2, 4),), 3, "sgd", after_step=lambda step: seen.append((step, model.weight.grad is not None)))
    assert seen == [(1, True), (2, True), (3, True)] and model.weight.grad is None
