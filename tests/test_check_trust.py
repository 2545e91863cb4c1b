"""`--check` never fails a correct plan for reasons outside the plan (dropout), and a
failing check names the first differing tensor at the rule to blame."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.first_difference import owning_rule
from tpplan.runtime.torchrun import ApplyOptions

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def test_a_model_with_dropout_passes_check_with_dropout_off_and_says_so(tmp_path):
    pytest.importorskip("transformers")
    from tpplan.hf.importer import import_hf
    from tpplan.hf.tiny import tiny_config

    config = tiny_config("seed_oss")
    assert config.attention_dropout == 0.1 and config.residual_dropout == 0.1  # Seed-OSS trains with dropout
    config.save_pretrained(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text(import_hf(tmp_path, output=plan).text)
    report = dry_run(ApplyOptions(plan=str(plan), model="tpplan.hf.tiny:seed_oss", tp=2, check=True))
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
    assert problem.message.endswith(", located at its rule 'blocks.*.out_proj'")


def test_the_rule_to_blame_is_the_modules_own_or_its_closest_planned_ancestors():
    claimed = {"layers.0.attn": "R_attn", "layers.0.attn.wq": "R_wq", "layers.0.mlp.up": "R_up"}
    order = ["layers.0.norm", "layers.0.attn.wq", "layers.0.attn", "layers.0.mlp.act", "layers.0.mlp.up", "layers.0.mlp"]
    assert owning_rule(claimed, "layers.0.attn.wq", order) == ("R_wq", "its rule")
    assert owning_rule(claimed, "layers.0.attn.inner.x", order) == ("R_attn", "the rule of its closest planned ancestor 'layers.0.attn'")
    # no planned ancestor: the last planned module that ran before it produced its input
    assert owning_rule(claimed, "layers.0.mlp.act", order) == ("R_attn", "the rule of 'layers.0.attn', the last planned module that ran before it")
    assert owning_rule(claimed, "layers.0.norm", order) == (None, None)
