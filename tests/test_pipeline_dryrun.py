"""The dry run of a pipeline (SPEC §8): each stage's microbatch simulated on fake tensors,
each pp rank's step composed in its schedule's order (memory/pipeline_memory.py,
memory/pipeline_dryrun.py), against torch's MemTracker on real gloo ranks running
torch's PipelineStage and schedule (tests/pipeline_memory_worker.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app
from tpplan.core.stages import rank_stages
from tpplan.memory.pipeline_memory import StageMemory, bubble, compose, schedule_bubble, schedule_orders

from test_torchrun import torchrun

TESTS = Path(__file__).resolve().parent
PLANS = TESTS.parent / "plans"
TINY = "tpplan.models.llama:tiny"


def plan_file(tmp_path: Path, schedule: str = "1F1B", microbatches: int = 4, pp: int = 2, per_stage: int = 1,
              dp_shard: int = 1) -> Path:
    path = tmp_path / f"{schedule}.yaml"
    fsdp = "fsdp:\n  units: [layers.*]\n" if dp_shard > 1 else ""
    path.write_text(textwrap.dedent(f"""\
        version: 2
        mesh: {{pp: {pp}, dp_shard: {dp_shard}, tp: 1}}
        rules: {{}}
        pipeline:
          layers_per_stage: {per_stage}
          schedule: {schedule}
          microbatches: {microbatches}
        """) + fsdp)
    return path


def orders(schedule: str, pp: int, m: int, v: int = 1) -> dict:
    return schedule_orders(schedule, pp, m, [rank_stages(r, pp, v, schedule) for r in range(pp)])


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_the_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    for schedule in ("GPipe", "1F1B"):
        assert bubble(orders(schedule, pp, m)) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble(orders("Interleaved1F1B", pp, m, 2)) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    assert bubble(orders("ZBVZeroBubble", pp, m, 2)) < bubble(orders("Interleaved1F1B", pp, m, 2))  # what zero bubble is for
    for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):  # fit's closed forms
        assert schedule_bubble(schedule, pp, m, v) == pytest.approx(bubble(orders(schedule, pp, m, v)))


def test_1f1b_holds_pp_minus_s_microbatches_on_stage_s_and_gpipe_holds_them_all():
    """Stages whose microbatch keeps 1 byte of activations and allocates nothing else: the
    peak is the most microbatches in flight."""
    pp, m = 4, 8

    def alike(index: int) -> StageMemory:
        return StageMemory(index, (), static=0, activations=1, forward=1, forward_parameters=0, backward=0, backward_gradients=0,
                           backward_parameters=0, held=0, held_parameters=0, reduced=0, reduce=0, optimizer=0,
                           input_bytes=0, output_bytes=0, start={})

    stages = {i: alike(i) for i in range(pp)}
    for schedule, held in (("1F1B", [min(pp - s, m) for s in range(pp)]), ("GPipe", [m] * pp)):
        found = orders(schedule, pp, m)
        ranks = [compose(r, found[r], stages, m) for r in range(pp)]
        assert [rank.in_flight[r] for r, rank in enumerate(ranks)] == held
        assert [rank.peak_bytes for rank in ranks] == held  # the last forward's, on top of those before it


def test_the_receive_buffers_of_every_microbatch_and_the_input_gradient_being_sent_are_held():
    stage = StageMemory(1, (), static=100, activations=0, forward=0, forward_parameters=0, backward=0, backward_gradients=0,
                        backward_parameters=0, held=0, held_parameters=0, reduced=0, reduce=0, optimizer=0,
                        input_bytes=3, output_bytes=5, start={})
    rank = compose(1, orders("GPipe", 3, 4)[1], {1: stage}, 4)
    # buffers for 4 inputs and 4 output gradients; one input gradient at a time, until PipelineStage has sent it
    assert rank.peak_bytes == 100 + 4 * (3 + 5) + 3


def measured(path: Path, batch: int, seq: int, ranks: int = 2) -> list[dict]:
    result = torchrun(ranks, str(TESTS / "pipeline_memory_worker.py"), str(path), TINY, str(batch), str(seq), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def dry_run_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--format", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("schedule, dp_shard", [
    ("1F1B", 1), ("GPipe", 1),
    # FSDP2 in each stage, 4 ranks: PipelineStage keeps a backward's weights gathered until the next forward
    pytest.param("1F1B", 2, marks=pytest.mark.slow), pytest.param("GPipe", 2, marks=pytest.mark.slow),
])
def test_each_pp_ranks_planned_peak_is_within_a_tenth_of_torchs_tracker_on_gloo_ranks(tmp_path, schedule, dp_shard):
    path = plan_file(tmp_path, schedule, dp_shard=dp_shard)
    report = dry_run_json("--plan", str(path), "--model", TINY, "--batch", "4", "--seq", "128")
    predicted = {rank["position"]["pp"]: rank["memory"]["per_rank_peak_bytes"] for rank in report["ranks"]}
    real = {rank["pp"]: rank["peak"] for rank in measured(path, 4, 128, ranks=2 * dp_shard)}  # dp_shard ranks alike
    ratios = {pp: predicted[pp] / real[pp] for pp in real}
    print(schedule, dp_shard, {pp: f"{predicted[pp]} / {real[pp]} = {ratio:.4f}" for pp, ratio in ratios.items()})
    assert all(abs(ratio - 1) <= 0.10 for ratio in ratios.values()), ratios
    stages = report["pipeline"]["stages"]
    assert [stage["in_flight"] for stage in stages] == ([2, 1] if schedule == "1F1B" else [4, 4])
    assert stages[0]["activations"] > 0 and stages[0]["p2p_bytes"] == stages[1]["p2p_bytes"] == 1 * 128 * 128 * 4


def test_the_json_is_spec_8s_and_the_text_names_each_stage():
    args = ["--plan", str(PLANS / "llama_pp_tp.yaml"), "--model", TINY, "--seq", "16"]
    report = dry_run_json(*args)
    pipeline = report["pipeline"]
    assert (pipeline["schedule"], pipeline["microbatches"], pipeline["bubble"]) == ("1F1B", 4, pytest.approx(1 / 5))
    assert [stage["modules"] for stage in pipeline["stages"]] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    for stage in pipeline["stages"]:
        assert {"stage", "modules", "per_rank_peak_bytes", "activations", "in_flight", "p2p_bytes"} <= set(stage)
    assert report["memory"]["per_rank_peak_bytes"] == max(stage["per_rank_peak_bytes"] for stage in pipeline["stages"])
    assert report["mesh"] == {"pp": 2, "tp": 2}
    assert report["comms_by_axis"]["pp"]["forward"] == {"send": {"count": 4, "bytes": 4 * 16 * 128 * 4}}
    text = CliRunner().invoke(app, ["apply", "--dry-run", *args]).output
    assert "Pipeline: 1F1B, 4 microbatches per step, bubble 20.0% of the step" in text
    assert "tok_embeddings, layers.0" in text


def test_alike_stages_are_simulated_once_with_the_figures_of_simulating_each(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    path = plan_file(tmp_path, "1F1B", microbatches=4, pp=4)
    args = ["--plan", str(path), "--model", "pipeline_models:four_layers", "--world", "4", "--seq", "32"]
    reused, each = dry_run_json(*args), dry_run_json(*args, "--no-reuse")
    assert "(3 simulated, alike stages reused)" in " ".join(reused["notes"])
    assert "(4 simulated)" in " ".join(each["notes"])
    assert reused["pipeline"] == each["pipeline"] and reused["ranks"] == each["ranks"]
    assert [stage["in_flight"] for stage in reused["pipeline"]["stages"]] == [4, 3, 2, 1]


def test_a_batch_that_does_not_split_into_the_microbatches_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(plan_file(tmp_path)), "--model", TINY, "--batch", "6"])
    assert result.exit_code == 2
    assert "the batch of 6 does not split into pipeline.microbatches 4" in " ".join(result.output.split())


def test_a_stages_repeated_blocks_are_simulated_once_with_the_figures_of_simulating_each(tmp_path, monkeypatch):
    """Two stages of 7 blocks (FSDP2 and activation checkpointing on each block): each stage
    simulates 3 of its blocks and composes the others (memory/reuse.py); every figure is
    that of simulating every block."""
    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 2\nextends: {PLANS / 'llama_tp.yaml'}\nrules: {{}}\nmesh: {{pp: 2, dp_shard: 2, tp: 2}}\n"
                    "fsdp:\n  units: [layers.*]\ncheckpointing:\n  modules: layers.*\n"
                    "pipeline:\n  layers_per_stage: 7\n  schedule: 1F1B\n  microbatches: 4\n")
    args = ["--plan", str(path), "--model", "pipeline_models:fourteen_layers", "--seq", "32"]
    reused, each = dry_run_json(*args), dry_run_json(*args, "--no-reuse")
    notes = " ".join(reused["notes"])
    assert "stage 0: layers.2-5 reused from layers.1 (3 of 7 blocks of 'layers' simulated)" in notes
    assert "stage 1: layers.9-12 reused from layers.8 (3 of 7 blocks of 'layers' simulated)" in notes
    assert (reused["modules"], reused["parameters"], reused["comms_by_axis"]) == (each["modules"], each["parameters"], each["comms_by_axis"])
    assert reused["pipeline"]["stages"] == each["pipeline"]["stages"]


def test_context_parallelism_beside_a_pipeline_is_refused_at_its_section(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(f"version: 2\nextends: {PLANS / 'llama_tp.yaml'}\nrules: {{}}\nmesh: {{pp: 2, cp: 2, tp: 1}}\n"
                    "pipeline:\n  layers_per_stage: 1\n  schedule: 1F1B\n  microbatches: 4\n"
                    "context_parallel:\n  modules: layers.*.attention\n")
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(path), "--model", TINY, "--world", "4", "--seq", "16"])
    assert result.exit_code == 2
    assert f"{path}:9:1: TP130 not applied yet: context parallel with a pipeline" in " ".join(result.output.split())


def test_a_batch_that_is_no_whole_number_of_microbatches_of_microbatch_size_is_the_same_usage_error_as_torchruns(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(plan_file(tmp_path).read_text().replace("microbatches: 4", "microbatch_size: 4"))
    result = CliRunner().invoke(app, ["apply", "--dry-run", "--plan", str(path), "--model", TINY, "--batch", "6"])
    assert result.exit_code == 2
    assert "the batch of 6 does not split into pipeline.microbatch_size 4" in " ".join(result.output.split())


def test_a_pipeline_under_the_other_one_stage_schedule_takes_the_stages_of_its_twin_with_the_same_figures(tmp_path):
    """fit's dry runs (shared_stages): 1F1B and GPipe simulate a stage's microbatch alike, so a
    pipeline run under one after the other takes its stages and composes its own ranks; every
    figure of the report is the fresh dry run's. Outside shared_stages nothing is taken."""
    from tpplan.memory import pipeline_dryrun
    from tpplan.memory.pipeline_dryrun import shared_stages
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    def report(schedule: str) -> tuple[dict, list[str]]:
        path = tmp_path / f"{schedule}.yaml"
        path.write_text(textwrap.dedent(f"""\
            version: 2
            extends: {PLANS / 'llama_tp.yaml'}
            rules: {{}}
            mesh: {{pp: 2, dp_shard: 2, tp: 1}}
            pipeline: {{stages: [[tok_embeddings, layers.0], [layers.1, norm, output]], schedule: {schedule}, microbatches: 4}}
            fsdp: {{units: [layers.*]}}
            training: {{global_batch: 8, seq: 64, dtype: bf16, optimizer: adamw}}
            """))
        found = dry_run(ApplyOptions(plan=str(path), model=TINY))
        assert found.problems == []
        figures = found.to_json()
        return {key: value for key, value in figures.items() if key not in ("notes", "plan")}, found.notes

    fresh = {schedule: report(schedule)[0] for schedule in ("GPipe", "1F1B")}
    assert fresh["GPipe"]["memory"] != fresh["1F1B"]["memory"]  # the composition differs: the test could fail
    taken = lambda notes: [note for note in notes if note.startswith("the stages were taken")]  # noqa: E731
    pipeline_dryrun._SHARED.clear()  # what an earlier test of this process left
    with shared_stages():
        first = report("1F1B")[0]
        second, second_notes = report("GPipe")
    assert first == fresh["1F1B"] and second == fresh["GPipe"]
    assert taken(second_notes) and "under 1F1B" in taken(second_notes)[0]
    assert not taken(report("GPipe")[1])  # outside: simulated again
