"""`tpplan fit` over ep (SPEC §7, §9): ep is no factor of the world but borrows its ranks
from dp_shard·cp·tp, so where the base plan has an experts section each split of the
world is weighed at every ep dividing those ranks; a variant is dropped by the plan's
own checks (the experts' count over ep, TP127, as `validate --model` says it), and
an ep layout's written plan dry-runs to its peak with no flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan import fit
from tpplan.cli.app import app
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tpplan.models.hf:qwen3_moe"  # 2 layers, each with 4 routed experts
PLAN = str(ROOT / "plans" / "qwen3_moe_fsdp_ep.yaml")  # the experts over ep, FSDP2 over dp_shard
# a slow GPU (10 GFLOP/s), as tests/test_fit.py: the tiny model's compute outweighs the links' latency
ASKED = dict(seq=16, batch=4, plan=PLAN, jobs=1, peak_flops=1e10)


@pytest.fixture(scope="module")
def every():
    """Every layout of 4 ranks over dp_shard and ep, simulated: ep 1, 2 and 4 of dp_shard 4
    (ep 4 is the dp_shard group itself)."""
    return fit(MODEL, world=4, memory="1GiB", axes=("dp_shard", "ep"), top=100, exhaustive=True, **ASKED)


def test_each_split_is_weighed_at_every_ep_its_ranks_allow_and_each_ep_layouts_plan_dry_runs_to_its_peak(every, tmp_path):
    assert {(r.layout.mesh["dp_shard"], r.layout.mesh["ep"], r.layout.checkpointing) for r in every.ranked} == {
        (4, ep, checkpointing) for ep in (1, 2, 4) for checkpointing in (False, True)}
    assert every.rejected == [] and any("ep, each divisor of dp_shard·cp·tp" in note for note in every.notes)
    for ranked in every.ranked:
        ep = ranked.layout.mesh["ep"]
        if ep == 1:  # the experts on no axis of their own: the base plan's section, FSDP2 over dp_shard·cp·tp
            assert "ep:" not in every.plan_text(ranked)
            continue
        path = tmp_path / "layout.yaml"
        path.write_text(every.plan_text(ranked, str(path)))
        assert f"\n  ep: {ep}\n" in path.read_text()
        report = dry_run(ApplyOptions(plan=str(path), model=MODEL))  # no flags: its training section sizes the step
        assert report.problems == []
        assert report.memory.per_rank_peak_bytes == ranked.peak_bytes, ranked.layout.describe()


def test_eps_all_to_all_is_exposed_and_the_bounds_and_the_dominance_rule_hold(every):
    from tpplan.fitting.bounds import Bounds, read_model
    from tpplan.fitting.space import needs_no_less

    for ranked in every.ranked:
        # ep 4 is the dp_shard group: the dry run files its all_to_all there, and it still waits on the critical path
        # (the data axes' FSDP2 traffic, ep 1's all of it, hides behind the slow GPU's compute)
        assert (ranked.step.comm > 0) == (ranked.layout.mesh["ep"] > 1), ranked.layout.describe()
    bounds = Bounds(read_model(every.options, lambda _: None), every.options)
    peaks = {r.layout: r.peak_bytes for r in every.ranked}
    for layout, peak in peaks.items():
        assert bounds.memory_bytes(layout) <= peak, layout.describe()
    pairs = [(a, b) for a in peaks for b in peaks if a != b and needs_no_less(a, b)]
    assert pairs and all(a.mesh["ep"] == b.mesh["ep"] for a, b in pairs)  # ep never compared with another ep
    for more, less in pairs:
        assert peaks[more] >= peaks[less], (more.describe(), less.describe())


def test_an_ep_that_does_not_divide_the_experts_is_rejected_by_the_expert_count_check():
    # 8 ranks: ep 8 divides dp_shard 8 but not the 4 experts; 1 KiB: every other layout over the memory bound
    result = fit(MODEL, world=8, memory="1KiB", axes=("dp_shard", "ep"), **{**ASKED, "batch": 8})
    assert result.simulated == 0
    by_ep = {r.layout.mesh["ep"]: r for r in result.rejected}
    assert set(by_ep) == {1, 2, 4, 8}
    uneven = [r for r in result.rejected if r.layout.mesh["ep"] == 8]
    assert uneven and all((r.kind, r.code) == ("check", "TP127") for r in uneven)
    assert uneven[0].reason.startswith("mesh.ep: 8 does not divide the 4 experts of 'model.layers.0.mlp.experts' (and 1 more) "
                                       "(experts rule 'model.layers.*.mlp.experts', line ")
    assert uneven[0].reason.endswith("make ep one of 1, 2, 4")
    assert all(r.kind == "memory" for r in result.rejected if r.layout.mesh["ep"] != 8)


def test_the_cli_searches_ep_beside_dp_shard_and_tp_and_its_json_mesh_says_ep():
    # nothing fits 1 KiB: every layout is weighed by the checks and the bound alone, none simulated
    result = CliRunner().invoke(app, ["fit", "--model", MODEL, "--world", "4", "--seq", "16", "--batch", "4", "--plan", PLAN,
                                      "--axes", "dp_shard,tp,ep", "--memory", "1KiB", "--jobs", "1", "--format", "json"])
    assert result.exit_code == 1, result.output
    found = json.loads(result.stdout)
    meshes = {(r["mesh"]["dp_shard"], r["mesh"]["tp"], r["mesh"]["ep"]) for r in found["rejected"]}
    assert meshes == {(4, 1, 1), (4, 1, 2), (4, 1, 4), (2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 4, 1), (1, 4, 2), (1, 4, 4)}
    assert found["counts"]["simulated"] == 0 and found["layouts"] == []


def test_what_the_dry_run_would_refuse_is_rejected_before_it_runs(tmp_path):
    # the experts beside a pipeline, and an experts rule the ep axis does not carry: TP130, as the dry run says it
    base = tmp_path / "expert_tp.yaml"
    base.write_text(f"version: 2\nextends: {PLAN}\nrules: {{}}\nexperts:\n  model.layers.*.mlp.experts: expert_tp\n")
    for plan, world, axes, what in ((PLAN, 4, ("pp", "tp", "ep"), "experts with a pipeline"),
                                     (str(base), 2, ("tp", "ep"), "experts rule 'model.layers.*.mlp.experts' is expert_tp")):
        result = fit(MODEL, world=world, memory="1KiB", axes=axes, **{**ASKED, "plan": plan})  # 1 KiB: nothing else simulated
        assert result.simulated == 0 and result.ranked == []
        refused = [r for r in result.rejected if r.code == "TP130"]
        assert refused and all(r.kind == "check" and r.reason.startswith(f"not applied yet: {what}") for r in refused)
        assert {r.layout.mesh["ep"] for r in refused} == {1, 2}
