"""A version 2 plan's pipeline applied (SPEC §8): the model cut into stages that keep
its parameter names and run its own forward (sharding/pipeline.py), and `tpplan
apply` under torchrun running torch's `PipelineStage`s and schedules on gloo ranks,
compared with one device by `--check` (runtime/pipelined.py)."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest
import torch

from tpplan import load_plan
from tpplan.core.axes import NotAppliedError, mesh_dims, refuse_unapplied
from tpplan.core.stages import rank_stages
from tpplan.sharding.pipeline import keep_stage, output_tensor, stages_of
from tpplan.simulation.modelref import build_model

from test_torchrun import torchrun

TESTS = Path(__file__).resolve().parent
PLANS = TESTS.parent / "plans"


def plan_file(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


PP2 = """\
    version: 2
    mesh: {pp: 2, tp: 1}
    rules: {}
    pipeline:
      layers_per_stage: 1
      schedule: 1F1B
      microbatches: 4
    """


@pytest.mark.parametrize("ref", ["tpplan.models.llama:tiny", "tpplan.models.hf:llama"])
def test_the_stages_keep_the_models_names_and_run_its_forward_one_after_the_other(tmp_path, ref):
    torch.manual_seed(0)
    model = build_model(ref, "cpu").eval()
    plan = load_plan(plan_file(tmp_path, PP2))
    stages, units = stages_of(plan, model)
    names = dict(model.named_parameters())
    parts = []
    for units_of_stage in stages:
        part = keep_stage(copy.deepcopy(model), units, units_of_stage)
        part.register_forward_hook(output_tensor)
        parts.append(part)
    held = [dict(part.named_parameters()) for part in parts]
    # every parameter in exactly one stage, under its own name, the same values
    assert not set(held[0]) & set(held[1]) and set(held[0]) | set(held[1]) == set(names)
    assert all(torch.equal(p, names[name]) for stage in held for name, p in stage.items())
    assert any(name.startswith(("layers.1.", "model.layers.1.")) for name in held[1])  # layers.1 stays layers.1
    tokens = torch.randint(0, 128, (2, 8))
    want = model(tokens)
    want = want.logits if hasattr(want, "logits") else want
    torch.testing.assert_close(parts[1](parts[0](tokens)), want, rtol=0, atol=0)


def test_a_rank_runs_its_stages_looped_or_in_a_v():
    assert [rank_stages(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_stages(r, 4, 1, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]


def test_the_mesh_of_a_pipeline_has_pp_outermost(tmp_path):
    plan = load_plan(plan_file(tmp_path, PP2.replace("{pp: 2, tp: 1}", "{pp: 2, dp_shard: 2, tp: 2}")))
    assert mesh_dims(plan, 8) == ((2, 2, 2), ("pp", "dp_shard", "tp"))
    refuse_unapplied(plan, "torchrun")  # torchrun applies it
    with pytest.raises(NotAppliedError, match="TP130") as raised:
        refuse_unapplied(plan, "api")  # Plan.apply has no ranks to put stages on
    assert "pipeline" in str(raised.value)


def test_experts_beside_a_pipeline_are_refused_at_the_experts_section(tmp_path):
    path = plan_file(tmp_path, textwrap.dedent(PP2).replace("{pp: 2, tp: 1}", "{pp: 2, dp_shard: 2, tp: 1, ep: 2}") +
                     "experts:\n  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}\n")
    with pytest.raises(NotAppliedError) as raised:
        refuse_unapplied(load_plan(path), "torchrun")
    problem = raised.value.problem
    assert (problem.code, problem.line, problem.column) == ("TP130", 8, 1)
    assert "experts with a pipeline" in problem.message


def apply_json(nproc: int, plan: Path, model: str, *extra: str, timeout: float = 300) -> tuple[int, dict]:
    result = torchrun(nproc, "-m", "tpplan", "apply", "--model", model, "--plan", str(plan), "--format", "json", *extra,
                      pythonpath=TESTS, timeout=timeout)
    assert result.stdout, result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout)


def assert_parity(report: dict, steps: int = 3) -> None:
    assert report["ok"] is True and report["problems"] == [], report["problems"]
    assert report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-5
    assert report["steps"]["n"] == steps and report["steps"]["max_abs_diff"] < 1e-4
    losses = report["steps"]["losses"]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))  # it trains


def test_pp2_1f1b_with_four_microbatches_matches_one_device_after_three_adamw_steps(tmp_path):
    code, report = apply_json(2, plan_file(tmp_path, PP2), "tpplan.models.llama:tiny", "--check", "--steps", "3")
    assert code == 0
    assert_parity(report)
    assert report["mesh"] == {"pp": 2, "tp": 1}
    assert report["pipeline"] == {"schedule": "1F1B", "microbatches": 4, "stages": [
        {"stage": 0, "modules": ["tok_embeddings", "layers.0"], "pp_rank": 0},
        {"stage": 1, "modules": ["layers.1", "norm", "output"], "pp_rank": 1}]}
    assert ("pipeline: 1F1B over pp 2, 2 stages, 4 microbatches per step (stage 0 on pp 0: tok_embeddings, layers.0; "
            "stage 1 on pp 1: layers.1, norm, output)") in report["notes"]


INTERLEAVED = """\
    version: 2
    mesh: {pp: 2, tp: 1}
    rules: {}
    pipeline:
      stages: [[model.embed_tokens], [model.layers.0], [model.layers.1], [model.norm, lm_head]]
      schedule: Interleaved1F1B
      virtual_stages: 2
      microbatches: 4
    """


@pytest.mark.slow
def test_interleaved_1f1b_with_two_stages_per_rank_matches_one_device_on_a_transformers_llama(tmp_path):
    code, report = apply_json(2, plan_file(tmp_path, INTERLEAVED), "tpplan.models.hf:llama", "--check", "--steps", "3")
    assert code == 0
    assert_parity(report)
    assert [stage["pp_rank"] for stage in report["pipeline"]["stages"]] == [0, 1, 0, 1]


@pytest.mark.slow
def test_the_shipped_pp2_by_tp2_plan_matches_one_device():
    code, report = apply_json(4, PLANS / "llama_pp_tp.yaml", "tpplan.models.llama:tiny", "--check", "--steps", "3")
    assert code == 0
    assert_parity(report)
    assert (report["tp"], report["mesh"]) == (2, {"pp": 2, "tp": 2})
    assert [stage["modules"] for stage in report["pipeline"]["stages"]] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


@pytest.mark.slow
def test_pp2_by_fsdp2_with_checkpointing_and_gpipe_matches_one_device(tmp_path):
    plan = plan_file(tmp_path, """\
        version: 2
        mesh: {pp: 2, dp_shard: 2, tp: 1}
        rules: {}
        fsdp: {units: ["model.layers.*"]}
        checkpointing: {modules: ["model.layers.*"]}
        pipeline: {layers_per_stage: 1, schedule: GPipe, microbatches: 4}
        """)
    code, report = apply_json(4, plan, "tpplan.models.hf:llama", "--check", "--steps", "3")
    assert code == 0
    assert_parity(report)
    assert any(note.startswith("FSDP2 (fully_shard on model.layers.* and the root) over dp_shard 2") for note in report["notes"])


@pytest.mark.slow
def test_a_forward_that_computes_between_modules_runs_again_in_every_stage_and_check_fails(tmp_path):
    # ScaledEmbeddings scales the embeddings in its own forward, not in a module: stage 1
    # runs that forward too and scales the hidden states a second time.
    code, report = apply_json(2, plan_file(tmp_path, PP2), "pipeline_models:scaled_embeddings", "--check")
    assert code == 1
    assert report["check"]["passed"] is False
    [problem] = report["problems"]
    # the loss (stage 1's rank) and the gradients before it (stage 0's) differ
    assert problem["code"] == "TP505" and problem["message"].startswith("--check failed: rank 0: tok_embeddings.weight.grad differs")


@pytest.mark.slow
def test_a_sequence_parallel_boundary_into_a_forward_that_reads_the_sequence_length_is_tp158(tmp_path):
    plan = plan_file(tmp_path, f"version: 2\nextends: {PLANS / 'llama_tp_sp.yaml'}\nrules: {{}}\nmesh: {{pp: 2, tp: 2}}\n"
                               "pipeline:\n  layers_per_stage: 1\n  schedule: 1F1B\n  microbatches: 4\n")
    result = torchrun(4, "-m", "tpplan", "apply", "--model", "tpplan.models.llama:tiny", "--plan", str(plan), timeout=300)
    assert result.returncode == 1  # the rank of stage 1 says why; the others, that it died
    assert f"{plan}:5:1: TP158 pipeline: the model's forward fails on this rank's stage 1 (layers.1, norm, output)" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout
