"""`tpplan fit` (SPEC §9) on a world small enough to simulate every layout: each peak
is the dry run of the layout's written plan, the bound never drops a layout of the top,
rejections name their check, and the chosen plan validates, dry-runs to its peak and
runs under torchrun with --check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan import fit
from tpplan.cli.app import app
from tpplan.core.loader import load_plan
from tpplan.fitting.flops import count_flops
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions

from test_torchrun import torchrun

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tpplan.models.llama:tiny"  # 2 blocks: pp 2 at most
PLAN = str(ROOT / "plans" / "llama_tp.yaml")
# a slow GPU (10 GFLOP/s): the tiny model's compute outweighs the links' latency, as a large model's does
ASKED = dict(world=2, seq=64, batch=4, plan=PLAN, axes=("pp", "dp_replicate", "dp_shard", "tp"), jobs=1, peak_flops=1e10)
LIMIT = 3_300_000  # bytes per rank: some layouts fit, some do not


@pytest.fixture(scope="module")
def every():
    """Every layout its checks and its memory bound let through, simulated."""
    return fit(MODEL, memory=LIMIT, top=100, exhaustive=True, **ASKED)


def _kind(layout) -> tuple:
    """The axes a layout spreads over, its checkpointing and its schedule: what its written plan's sections differ by."""
    return tuple(axis for axis, size in layout.mesh.items() if size > 1), layout.checkpointing, layout.schedule


# the default suite dry-runs the best layout of each kind (about 6 s); -m slow every one
@pytest.mark.parametrize("which", ["one of each kind", pytest.param("every", marks=pytest.mark.slow)])
def test_each_ranked_peak_is_the_dry_run_of_its_written_plan_given_no_flags(every, tmp_path, which):
    assert len(every.ranked) >= 3 and every.counts()["rejected_by_memory"] >= 1
    chosen = every.ranked if which == "every" else list({_kind(r.layout): r for r in reversed(every.ranked)}.values())
    assert {_kind(r.layout) for r in chosen} == {_kind(r.layout) for r in every.ranked}
    for ranked in chosen:
        path = tmp_path / "layout.yaml"
        path.write_text(every.plan_text(ranked, str(path)))  # extends the base plan by a path relative to it
        report = dry_run(ApplyOptions(plan=str(path), model=MODEL))
        assert report.problems == []
        assert report.memory.per_rank_peak_bytes == ranked.peak_bytes, ranked.layout.describe()
        assert ranked.peak_bytes <= LIMIT


def test_the_bound_drops_no_layout_of_the_top_and_reruns_rank_alike(every):
    top = 3
    bounded = fit(MODEL, memory=LIMIT, top=top, **ASKED)
    assert [r.to_json() for r in bounded.ranked[:top]] == [r.to_json() for r in every.ranked[:top]]
    assert bounded.simulated < every.simulated  # the bounds spared some dry runs
    simulated = {r.layout: r for r in every.ranked}
    peaks = {**{r.layout: r.peak_bytes for r in every.ranked}, **{r.layout: r.peak_bytes for r in every.rejected if r.peak_bytes}}
    kth = bounded.ranked[top - 1].step.total
    for dropped in bounded.rejected:
        if dropped.kind == "ranked out" and dropped.layout in simulated:  # no faster than the last of the top
            assert simulated[dropped.layout].step.total >= kth
        if dropped.kind == "memory" and "needs no more memory" in dropped.reason:  # dropped for another: over the limit too
            assert peaks[dropped.layout] > LIMIT, dropped.layout.describe()


def test_the_memory_bound_never_exceeds_the_simulated_peak(every):
    """Every layout simulated, fitting or not, pipelined or not: the bound (parameters and optimizer
    state, and the larger of the gradients and, without checkpointing, the blocks' saved activations
    when backward starts) is at most its peak, and the activations are what decide it somewhere."""
    from tpplan.fitting.bounds import Bounds, read_model

    bounds = Bounds(read_model(every.options, lambda _: None), every.options)
    peaks = {**{r.layout: r.peak_bytes for r in every.ranked}, **{r.layout: r.peak_bytes for r in every.rejected if r.peak_bytes}}
    assert {layout.mesh["pp"] for layout in peaks} == {1, 2} and any(not layout.checkpointing for layout in peaks)
    for layout, peak in peaks.items():
        assert bounds.memory_bytes(layout) <= peak, layout.describe()
    assert any(bounds.memory_bytes(layout) > bounds.static_bytes(layout) for layout in peaks)  # activations above gradients


def test_rejections_name_their_check_the_search_rule_or_the_memory(every):
    reasons = {(r.kind, r.code): r.reason for r in every.rejected}
    assert "1F1B needs at least as many microbatches as pipeline ranks (pp = 2), not 1" in reasons[("check", "TP152")]
    assert "stages for the model's 2 blocks: each stage needs a block" in reasons[("search", None)]
    over = [r for r in every.rejected if r.kind == "memory"]
    assert over and all(" > 3.15 MiB" in r.reason for r in over), [r.reason for r in over]


def test_a_batch_the_data_ranks_do_not_split_and_cp_without_its_section_are_rejected_with_their_reasons():
    result = fit(MODEL, world=2, seq=64, batch=3, plan=PLAN, memory="1GiB", axes=("dp_shard", "cp"), jobs=1)
    assert result.ranked == [] and result.simulated == 0
    codes = {r.code: r.reason for r in result.rejected}
    assert codes["TP123"].startswith("training.global_batch: 3 sequences do not split evenly over dp_replicate·dp_shard = 1·2 = 2")
    assert codes["TP128"].startswith("cp 2: the base plan has no context_parallel section")


def test_the_compute_is_the_counted_flops_over_the_gpus_peak(every):
    flops = count_flops(MODEL, 64, "bf16")
    forward, backward = flops.total
    recomputed = flops.of(["layers.0", "layers.1"])[0]  # the checkpointed blocks' forward, again in backward
    whole = [r for r in every.ranked if r.layout.mesh["pp"] == 1]
    assert {(r.layout.mesh["tp"], r.layout.checkpointing) for r in whole} >= {(1, True), (2, True)}
    for ranked in whole:
        mesh = ranked.layout.mesh
        sequences = 4 // ranked.layout.dp  # each data-parallel rank's share of the batch of 4
        per_rank = (forward + backward + (recomputed if ranked.layout.checkpointing else 0)) * sequences / mesh["tp"]
        assert ranked.step.compute == pytest.approx(per_rank / (1e10 * 0.4))
        assert ranked.step.bubble == 0 and ranked.step.total == pytest.approx(ranked.step.compute + ranked.step.comm)
        assert ranked.tokens_per_second_per_gpu == pytest.approx(4 * 64 / ranked.step.total / 2)


def test_the_cli_writes_spec_9s_json_and_the_best_plan_which_validates_and_runs_under_torchrun_check(tmp_path):
    written = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["fit", "--model", MODEL, "--world", "2", "--seq", "64", "--batch", "4", "--plan", PLAN,
                                      "--memory", str(LIMIT), "--axes", "dp_shard,tp", "--jobs", "1", "-o", str(written),
                                      "--format", "json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert set(found) >= {"layouts", "rejected", "assumptions", "plan"}
    first = found["layouts"][0]
    assert set(first) >= {"mesh", "checkpointing", "microbatches", "schedule", "peak_bytes", "fits", "step_seconds",
                          "compute_seconds", "comm_seconds", "bubble_seconds", "tokens_per_second_per_gpu", "megatron_peak_bytes"}
    assert first["fits"] is True and first["step_seconds"] == pytest.approx(
        first["compute_seconds"] + first["comm_seconds"] + first["bubble_seconds"])
    assert found["plan"] and load_plan(written).version == 2
    checked = CliRunner().invoke(app, ["validate", str(written)])
    assert checked.exit_code == 0, checked.output
    report = dry_run(ApplyOptions(plan=str(written), model=MODEL))
    assert report.memory.per_rank_peak_bytes == first["peak_bytes"]
    ran = torchrun(2, "-m", "tpplan", "apply", "--model", MODEL, "--plan", str(written), "--check", "--format", "json")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout)["check"]["passed"] is True


def test_a_layout_that_needs_no_less_memory_than_another_takes_no_less(every):
    pairs = _checked_pairs(every)
    kinds = {(a.mesh["dp_shard"] != b.mesh["dp_shard"], a.checkpointing != b.checkpointing, a.schedule != b.schedule,
              a.microbatches != b.microbatches) for a, b in pairs}
    assert {(True, False, False, False), (False, True, False, False), (False, False, True, False), (False, False, False, True)} <= kinds


def test_interleaved_1f1b_holds_no_less_than_1f1b(tmp_path):
    from tpplan.fitting.space import Layout, needs_no_less

    # a search with nothing to simulate (cp without its section), for its plans of a 4-block model
    result = fit("pipeline_models:four_layers", memory="1GiB", **{**ASKED, "axes": ("cp",), "batch": 2})
    assert result.simulated == 0
    interleaved, one = (Layout((2, 1, 1, 1, 1, 1), False, schedule, 2, virtual) for schedule, virtual in (("Interleaved1F1B", 2), ("1F1B", 1)))
    assert needs_no_less(interleaved, one) and not needs_no_less(one, interleaved)
    assert result.evaluate(interleaved).peak_bytes >= result.evaluate(one).peak_bytes


@pytest.mark.slow
def test_interleaved_1f1b_holds_no_less_than_1f1b_at_every_layout():
    four = fit("pipeline_models:four_layers", memory="1GiB", top=100, exhaustive=True, **{**ASKED, "axes": ("pp",), "batch": 2})
    pairs = _checked_pairs(four)
    assert sum(a.schedule == "Interleaved1F1B" and b.schedule == "1F1B" for a, b in pairs) >= 2


def _checked_pairs(result) -> list:
    """Every pair of simulated layouts (a, b) where a needs no less memory than b, each checked."""
    from tpplan.fitting.space import needs_no_less

    peaks = {**{r.layout: r.peak_bytes for r in result.ranked}, **{r.layout: r.peak_bytes for r in result.rejected if r.peak_bytes}}
    pairs = [(a, b) for a in peaks for b in peaks if a != b and needs_no_less(a, b)]
    for more, less in pairs:
        assert peaks[more] >= peaks[less], (more.describe(), less.describe())
    return pairs


def test_the_text_report_shows_the_cost_model_the_top_and_each_kind_of_rejection(every):
    from rich.console import Console

    from tpplan.render.fit_report import render_fit

    console = Console(record=True, width=300)
    render_fit(every, console)
    text = console.export_text()
    assert "cost model: H100 SXM: 0.01 TFLOP/s × efficiency 0.4, 80.00 GiB, 8 per node; inside a node 450 GB/s" in text
    assert f"Top {len(every.ranked)} layouts" in text and "rejected (check TP152): 2" in text and "rejected (search): " in text
    assert "1F1B needs at least as many microbatches as pipeline ranks (pp = 2), not 1" in text
    assert "(--format json lists each)" in text
    # the command prints it
    result = CliRunner().invoke(app, ["fit", "--model", MODEL, "--world", "2", "--seq", "64", "--batch", "4", "--plan", PLAN,
                                      "--axes", "tp", "--jobs", "1", "--top", "1"])
    assert result.exit_code == 0 and "Top 1 layouts" in result.output, result.output


def test_the_clis_choices_are_the_searchs_and_ep_without_an_experts_section_is_noted():
    from tpplan.cli import fit as command
    from tpplan.core.axes_spec import AXES
    from tpplan.fitting.cost import GPUS

    assert command._GPUS == tuple(GPUS) and command._AXES == AXES
    # a dense base plan: ep has nothing to place (tests/test_fit_ep.py searches it on an MoE model); 1 KiB: nothing simulated
    result = CliRunner().invoke(app, ["fit", "--model", MODEL, "--world", "2", "--seq", "64", "--batch", "4", "--plan", PLAN,
                                      "--axes", "tp,ep", "--memory", "1KiB", "--format", "json"])
    assert result.exit_code == 1, result.output  # nothing fits
    found = json.loads(result.stdout)
    assert {r["mesh"]["ep"] for r in found["rejected"]} == {1}
    assert any(note.startswith("ep is not searched: the base plan has no experts section") for note in found["notes"])


def test_context_parallel_layouts_come_from_the_base_plans_section_and_the_sequence_check(tmp_path):
    base = tmp_path / "cp_base.yaml"
    base.write_text(f"version: 2\nextends: {PLAN}\nrules: {{}}\ncontext_parallel:\n  modules: layers.*.attention\n")
    uneven = fit(MODEL, world=2, seq=66, batch=2, plan=str(base), memory="1GiB", axes=("cp",), jobs=1)
    assert uneven.ranked == [] and {r.code for r in uneven.rejected} == {"TP124"}
    assert uneven.rejected[0].reason.startswith("training.seq: 66 is not divisible by 2·cp = 2·2 = 4")
    even = fit(MODEL, world=2, seq=64, batch=2, plan=str(base), memory="1GiB", axes=("cp",), jobs=1)
    assert [r.layout.mesh["cp"] for r in even.ranked] == [2, 2]  # with and without activation checkpointing
    best = even.ranked[0]
    assert "context_parallel:" in even.plan_text(best) and best.step.comm > 0  # the ring's collectives over cp, exposed
    path = tmp_path / "cp.yaml"
    path.write_text(even.plan_text(output=str(path)))
    assert dry_run(ApplyOptions(plan=str(path), model=MODEL)).memory.per_rank_peak_bytes == best.peak_bytes


def test_without_a_base_plan_the_rules_are_inits_written_beside_the_best_plan_which_extends_them(tmp_path):
    """SPEC §9: "the TP rules come from --plan or from init on the model". init's plan, proven at
    the tp degrees searched (2), is the base every layout extends; -o writes it beside the best."""
    from tpplan.init import run_init
    from tpplan.models.llama import tiny

    written = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["fit", "--model", MODEL, "--world", "2", "--seq", "64", "--batch", "4", "--memory", str(LIMIT),
                                      "--axes", "dp_shard,tp", "--jobs", "1", "-o", str(written), "--format", "json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    rules = tmp_path / "best.rules.yaml"
    assert found["rules"] == rules.read_text() == run_init(tiny, ref=MODEL, tp=[2]).text
    assert "extends: best.rules.yaml" in written.read_text() and load_plan(written).rules  # init's rules, through extends:
    assert {(layout["mesh"]["dp_shard"], layout["mesh"]["tp"]) for layout in found["layouts"]} <= {(2, 1), (1, 2)}
    assert dry_run(ApplyOptions(plan=str(written), model=MODEL)).memory.per_rank_peak_bytes == found["layouts"][0]["peak_bytes"]


def test_without_a_base_plan_and_tp_not_searched_the_rules_are_none():
    result = fit(MODEL, world=2, seq=64, batch=4, memory=LIMIT, axes=("dp_shard",), jobs=1)
    assert load_plan(text=result.rules).rules == [] and [r.layout.mesh["dp_shard"] for r in result.ranked] == [2]
    assert result.rules_written_to("out/best.yaml") == "out/best.rules.yaml"
