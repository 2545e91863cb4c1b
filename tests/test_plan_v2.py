"""Plan version 2 (SPEC §7), plan-only: the named mesh and the sections load into one
Plan; each located check fails one plan at its key with its numbers and passes its
fixed twin; `apply` refuses what it does not apply yet; a version 2 plan with only
mesh.tp and rules applies as the same version 1 plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan import PlanError, load_plan
from tpplan.cli.app import app
from tpplan.core.axes import NotAppliedError, section_warnings, world_problems

ROOT = Path(__file__).resolve().parent.parent


def problems_of(path: Path, world: int | None = None) -> list:
    """What `validate [--world N]` finds in a plan without a model: the loader's errors, or
    the checks against the world and the warnings of a plan that loads."""
    try:
        plan = load_plan(path)
    except PlanError as exc:
        return exc.problems
    return (world_problems(plan, world) if world else []) + section_warnings(plan)


# (code, world, failing plan, its (line, column), words of the message, the passing twin)
TABLE = [
    ("TP120", None,
     "version: 2\nmesh:\n  dp_shard: -1\n  cp: -1\nrules: {}\n", (4, 7),
     "mesh: dp_shard and cp are both -1",
     "version: 2\nmesh:\n  dp_shard: -1\n  cp: 2\nrules: {}\n"),
    ("TP101", None,
     "version: 2\nmesh:\n  dp_shard: 0\nrules: {}\n", (3, 13),
     "'mesh.dp_shard': an axis size is a whole number >= 1, or -1 for the rest of the world, not 0",
     "version: 2\nmesh:\n  dp_shard: 1\nrules: {}\n"),
    ("TP121", 8,
     "version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: 3\n  tp: 2\nrules: {}\n", (2, 1),
     "mesh: dp_replicate 2 × dp_shard 3 × tp 2 = 12, not the world size 8",
     "version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: 2\n  tp: 2\nrules: {}\n"),
    ("TP121", 8,
     "version: 2\nmesh:\n  dp_replicate: 3\n  dp_shard: -1\nrules: {}\n", (4, 13),
     "mesh.dp_shard: -1 takes world / (the other axes), and 8 / (dp_replicate 3) = 2.66667 is not a whole number",
     "version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: -1\nrules: {}\n"),
    ("TP122", None,
     "version: 2\nmesh:\n  dp_shard: 2\n  tp: 2\n  ep: 8\nrules: {}\n", (5, 7),
     "mesh.ep: 8 does not divide dp_shard·cp·tp = 2·1·2 = 4: expert parallelism borrows its ranks from these axes; "
     "make ep one of 1, 2, 4",
     "version: 2\nmesh:\n  dp_shard: 2\n  tp: 2\n  ep: 4\nrules: {}\n"),
    # the -1 axis resolved by the world, then ep checked against it
    ("TP122", 4,
     "version: 2\nmesh:\n  dp_shard: -1\n  tp: 2\n  ep: 8\nrules: {}\n", (5, 7),
     "mesh.ep: 8 does not divide dp_shard·cp·tp = 2·1·2 = 4",
     None),
    ("TP123", None,
     "version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: 4\nrules: {}\ntraining:\n  global_batch: 30\n", (7, 17),
     "training.global_batch: 30 sequences do not split evenly over dp_replicate·dp_shard = 2·4 = 8 data-parallel "
     "ranks: make it a multiple of 8 (24 or 32)",
     "version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: 4\nrules: {}\ntraining:\n  global_batch: 32\n"),
    ("TP124", None,
     "version: 2\nmesh:\n  cp: 4\nrules: {}\ntraining:\n  seq: 1004\n", (6, 8),
     "training.seq: 1004 is not divisible by 2·cp = 2·4 = 8 (load_balance: headtail gives each cp rank a head and "
     "a tail chunk): make it a multiple of 8 (e.g. 1008)",
     "version: 2\nmesh:\n  cp: 4\nrules: {}\ntraining:\n  seq: 1008\n"),
    ("TP124", None,
     "version: 2\nmesh:\n  cp: 4\nrules: {}\ncontext_parallel:\n  modules: attn\n  load_balance: none\ntraining:\n  seq: 1002\n",
     (9, 8), "training.seq: 1002 is not divisible by cp = 4",
     "version: 2\nmesh:\n  cp: 4\nrules: {}\ncontext_parallel:\n  modules: attn\n  load_balance: none\ntraining:\n  seq: 1004\n"),
    ("TP125", None,
     "version: 2\nmesh:\n  dp_shard: 8\nrules: {}\nfsdp:\n  reshard_after_forward: 3\n", (6, 26),
     "fsdp.reshard_after_forward: 3 does not divide dp_shard = 8",
     "version: 2\nmesh:\n  dp_shard: 8\nrules: {}\nfsdp:\n  reshard_after_forward: 4\n"),
    ("TP101", None,
     "version: 2\nmesh:\n  dp_shard: 2\nrules: {}\nfsdp:\n  mixed_precision:\n    param_dtype: bfloat16\n", (7, 18),
     "'fsdp.mixed_precision.param_dtype': 'bfloat16' is not one of bf16, fp16, fp32; did you mean 'bf16'?",
     "version: 2\nmesh:\n  dp_shard: 2\nrules: {}\nfsdp:\n  mixed_precision:\n    param_dtype: bf16\n"),
    ("TP100", None,
     "version: 2\nmesh:\n  cp: 2\nrules: {}\ncontext_parallel:\n  modules: attn\n  rotat: alltoall\n", (7, 3),
     "unknown key 'rotat' in 'context_parallel'; did you mean 'rotate'?",
     "version: 2\nmesh:\n  cp: 2\nrules: {}\ncontext_parallel:\n  modules: attn\n  rotate: alltoall\n"),
    ("TP103", None,
     "version: 2\nmesh:\n  ep: 2\n  tp: 2\nrules: {}\nexperts:\n  moe.experts: colwise\n", (7, 16),
     "experts rule 'moe.experts' names style 'colwise': the experts section places experts over the ep axis with "
     "expert_parallel or expert_tp",
     "version: 2\nmesh:\n  ep: 2\n  tp: 2\nrules: {}\nexperts:\n  moe.experts: expert_parallel\n"),
    # pipelines (SPEC §8): the section's own choices, then what its numbers must satisfy
    ("TP101", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  stages: [[a], [b]]\n", (6, 3),
     "'pipeline': give the stages either as module lists (stages) or as a count (layers_per_stage), not both",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  stages: [[a], [b]]\n"),
    ("TP101", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  schedule: 1F1B\n", (6, 3),
     "'pipeline': give the stages either as module lists (stages) or as a count (layers_per_stage): neither is given",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n"),
    ("TP150", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  stages: [[a], [b], [c]]\n", (6, 11),
     "pipeline.stages: 3 stages, but pp·virtual_stages = 2·1 = 2: each of the pp ranks runs virtual_stages stages; "
     "give 2 stages, or set mesh.pp to 3",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  stages: [[a], [b]]\n"),
    ("TP151", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  schedule: ZBVZeroBubble\n", (7, 13),
     "pipeline.schedule: ZBVZeroBubble runs exactly 2 stages per rank (stage r and 2·pp − 1 − r, in a V), but "
     "virtual_stages is 1: set virtual_stages: 2",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  schedule: ZBVZeroBubble\n  virtual_stages: 2\n"),
    ("TP152", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  microbatches: 1\n", (7, 17),
     "pipeline.microbatches: 1F1B needs at least as many microbatches as pipeline ranks (pp = 2), not 1",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  microbatches: 2\n"),
    ("TP152", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  schedule: Interleaved1F1B\n  virtual_stages: 2\n  microbatches: 3\n", (9, 17),
     "pipeline.microbatches: Interleaved1F1B sends the microbatches round the pp ranks in groups of pp = 2, and 3 is "
     "not a multiple of it: give 4 or 2",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  schedule: Interleaved1F1B\n  virtual_stages: 2\n  microbatches: 4\n"),
    ("TP153", None,
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  microbatches: 4\ntraining:\n  global_batch: 6\n", (7, 17),
     "pipeline.microbatches: each data-parallel rank's batch of 6 sequences (training.global_batch 6 / "
     "dp_replicate·dp_shard 1) does not split into 4 microbatches",
     "version: 2\nmesh:\n  pp: 2\nrules: {}\npipeline:\n  layers_per_stage: 2\n  microbatches: 3\ntraining:\n  global_batch: 6\n"),
    ("TP126", None,
     "version: 2\nmesh:\n  tp: 2\nrules: {}\nexperts:\n  moe.experts: expert_parallel\n", (5, 1),
     "experts: mesh.ep is 1, so these rules place no expert on another rank",
     "version: 2\nmesh:\n  tp: 2\n  ep: 2\nrules: {}\nexperts:\n  moe.experts: expert_parallel\n"),
    ("TP126", None,
     "version: 2\nmesh:\n  tp: 2\nrules: {}\ncontext_parallel:\n  modules: attn\n", (5, 1),
     "context_parallel: mesh.cp is 1, so no sequence is split",
     "version: 2\nmesh:\n  tp: 2\n  cp: 2\nrules: {}\ncontext_parallel:\n  modules: attn\n"),
    ("TP126", None,
     "version: 2\nmesh:\n  tp: 2\nrules: {}\nfsdp:\n  offload: false\n", (5, 1),
     "fsdp: mesh.dp_replicate and mesh.dp_shard are 1, so FSDP shards nothing",
     "version: 2\nmesh:\n  tp: 2\n  dp_replicate: 2\nrules: {}\nfsdp:\n  offload: false\n"),
]


@pytest.mark.parametrize("code, world, failing, at, words, passing", TABLE, ids=[f"{row[0]}-{i}" for i, row in enumerate(TABLE)])
def test_each_check_fails_its_plan_at_the_key_and_passes_the_fixed_one(tmp_path, code, world, failing, at, words, passing):
    plan = tmp_path / "plan.yaml"
    plan.write_text(failing)
    [problem] = problems_of(plan, world)
    assert (problem.code, problem.file, (problem.line, problem.column)) == (code, str(plan), at)
    assert words in problem.message
    if passing is None:  # the same plan in a world where it fits
        assert problems_of(plan, 16) == []
        return
    plan.write_text(passing)
    assert problems_of(plan, world) == []


def test_validate_world_prints_the_product_located_and_exits_1(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: 3\n  tp: 2\nrules: {}\n")
    result = CliRunner().invoke(app, ["validate", str(plan), "--world", "8"])
    assert result.exit_code == 1
    assert f"{plan}:2:1: TP121 mesh: dp_replicate 2 × dp_shard 3 × tp 2 = 12, not the world size 8" in result.output
    assert CliRunner().invoke(app, ["validate", str(plan), "--world", "12"]).exit_code == 0


def test_a_version_1_plan_has_no_world_to_check(tmp_path):
    # version 1 names the TP axis only; its degree comes from the run (--tp), any world
    assert problems_of(ROOT / "plans" / "llama_tp.yaml", 6) == []


def test_the_plan_knows_every_axis_and_section():
    plan = load_plan(text="version: 2\nmesh:\n  dp_replicate: 2\n  dp_shard: -1\n  cp: 2\n  tp: [4, 8]\n  ep: 8\nrules: {}\n"
                     "fsdp:\n  reshard_after_forward: false\ntraining:\n  global_batch: 64\n")
    assert plan.mesh.sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": -1, "cp": 2, "tp": None, "ep": 8}
    assert plan.mesh.tp_degrees == (4, 8) and plan.mesh_sizes == [4, 8] and plan.mesh_axis == "tp"
    assert plan.mesh.resolve(128, tp=8) == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 8, "ep": 8}
    assert plan.fsdp.reshard_after_forward is False and plan.training.global_batch == 64
    assert plan.experts is None and plan.context_parallel is None and plan.checkpointing is None
    v1 = load_plan(ROOT / "plans" / "llama_tp.yaml")
    assert v1.mesh.sizes["dp_shard"] == 1 and v1.mesh.tp_degrees == (2, 4, 8) and v1.fsdp is None


def test_tp_left_out_takes_the_rest_unless_another_axis_does():
    assert load_plan(text="version: 2\nrules: {}\n").mesh.resolve(8)["tp"] == 8
    assert load_plan(text="version: 2\nmesh: {dp_shard: -1}\nrules: {}\n").mesh.resolve(8) == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "ep": 1}


def test_a_version_2_plan_extends_a_version_1_plan_and_takes_its_promised_degrees(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"version: 2\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nmesh:\n  dp_shard: 2\nrules:\n  output: null\n")
    plan = load_plan(child)
    assert plan.version == 2 and plan.mesh_sizes == [2, 4, 8] and plan.mesh.sizes["dp_shard"] == 2
    assert "output" not in {rule.pattern for rule in plan.rules} and "tok_embeddings" in {rule.pattern for rule in plan.rules}


def test_a_version_1_plan_cannot_extend_a_version_2_plan(tmp_path):
    (tmp_path / "parent.yaml").write_text("version: 2\nmesh: {dp_shard: 2}\nrules: {}\n")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: parent.yaml\nrules: {}\n")
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path / "child.yaml")
    [problem] = info.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP107", 2, 10)
    assert "a version 1 plan cannot extend" in problem.message


# -- apply: what is not applied yet is refused, never ignored ---------------------------------------


def _llama_tp_as_version_2() -> str:
    text = (ROOT / "plans" / "llama_tp.yaml").read_text(encoding="utf-8")
    return text.replace("version: 1", "version: 2").replace("mesh:\n  axis: tp\n  sizes: [2, 4, 8]", "mesh:\n  tp: [2, 4, 8]")


def test_apply_refuses_a_section_it_does_not_apply_yet_located_exit_2(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(_llama_tp_as_version_2().replace("  tp: [2, 4, 8]", "  pp: 2\n  tp: [2, 4, 8]"))
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--tp", "2", "--world", "4", "--plan", str(plan), "--model", "tpplan.models.llama:tiny"])
    assert result.exit_code == 2
    line = next(n for n, text in enumerate(plan.read_text().splitlines(), 1) if "pp:" in text)
    assert f"{plan}:{line}:3: TP130 mesh.pp is 2 but the plan has no pipeline section" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_plan_apply_refuses_before_touching_the_model():
    import torch

    plan = load_plan(text="version: 2\nmesh:\n  pp: 2\n  tp: 2\nrules:\n  '': colwise\n")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(NotAppliedError) as info:
        plan.apply(model, None)
    assert (info.value.problem.code, info.value.problem.line, info.value.problem.column) == ("TP130", 3, 3)
    assert "not applied yet: mesh.pp" in str(info.value)
    assert type(model.weight) is torch.nn.Parameter  # untouched


def _dry_run_json(plan: Path) -> dict:
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--tp", "2", "--plan", str(plan), "--model",
                                      "tpplan.models.llama:tiny", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    del report["plan"]
    return report


def test_a_version_2_plan_of_tp_and_rules_applies_as_the_same_version_1_plan(tmp_path):
    v2 = tmp_path / "v2.yaml"
    v2.write_text(_llama_tp_as_version_2())
    assert re.search(r"^version: 2$", v2.read_text(), re.M) and "sizes" not in v2.read_text()
    assert _dry_run_json(v2) == _dry_run_json(ROOT / "plans" / "llama_tp.yaml")
