"""expert_parallel with `dispatch: all_to_all` (tokens sharded over the mesh, sent to the
rank holding their expert and back).

Its split sizes depend on the routing and differ per rank, so parity cannot run under
LocalTensorMode (one process holding every rank's values): it runs on real gloo ranks
under torchrun, the experts module alone with skewed routing (ragged splits, a rank
that receives no token) and the shipped SP plan through `tpplan apply --check`. The dry
run (fake process group: no data moves, routing taken as balanced) counts collectives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lint_helpers import meta_model
from test_torchrun import torchrun
from typer.testing import CliRunner

pytest.importorskip("transformers")

from tpplan import load_plan  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.cli.app import app  # noqa: E402
from tpplan.lint.checks import check_model  # noqa: E402
from tpplan import PlanError  # noqa: E402
from tpplan.core.placements import PlacementSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLAN = "plans/hf/qwen3_moe_ep_sp.yaml"
L = hf_models.TINY["num_hidden_layers"]  # 2
# Per MoE layer: forward 3 all-to-alls (per-expert counts, tokens, results), backward 2
# (the reverse of the token and result exchanges); the block itself adds nothing (it runs
# on the rank's own sequence shard). Attention: 1 all-gather and 1 reduce-scatter each way;
# plus the embedding's reduce-scatter and the head's input and output all-gathers.
EP_SP = {
    "forward": {"all_gather": L + 2, "all_to_all": 3 * L, "reduce_scatter": L + 1},
    "backward": {"all_gather": L + 1, "all_to_all": 2 * L, "reduce_scatter": L + 1},
}


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


@pytest.mark.parametrize("family, nproc", [("qwen3_moe", 2), pytest.param("qwen3_moe", 4, marks=pytest.mark.slow),
                                          pytest.param("gpt_oss", 2, marks=pytest.mark.slow)])  # each torchrun ~8 s
def test_experts_module_matches_one_device_with_ragged_splits_on_real_ranks(family, nproc):
    result = torchrun(nproc, "tests/a2a_worker.py", family, pythonpath=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    names = {"output", "hidden grad", "weights grad", "gate_up_proj grad", "down_proj grad"}
    if family == "gpt_oss":
        names |= {"gate_up_proj_bias grad", "down_proj_bias grad"}
    assert set(report["diffs"]) == names
    assert max(report["diffs"].values()) < 1e-5, report["diffs"]
    splits = report["splits"]  # per rank: (rows sent to each rank, rows received from each rank)
    sent = [s for rank in splits for s in rank[0]]
    assert len(set(sent)) > 1 and 0 in sent  # ragged, and some rank is sent nothing by some rank
    for r, (_, received) in enumerate(splits):  # what r receives from q is what q sends to r
        assert received == [splits[q][0][r] for q in range(nproc)]
    assert report["forward"] == {"all_to_all": 3} and report["backward"] == {"all_to_all": 2}


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_shipped_sequence_parallel_plan_passes_check_on_real_ranks(nproc):
    steps = ("--steps", "2") if nproc == 2 else ()
    result = torchrun(
        nproc, "-m", "tpplan", "apply", "--model", "tpplan.models.hf:qwen3_moe", "--plan", PLAN,
        "--check", *steps, "--format", "json", timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["check"]["passed"] is True and report["check"]["max_abs_diff"] < 1e-4
    assert report["comms"] == EP_SP


@pytest.mark.parametrize("tp", [2, 4])
def test_dry_run_counts_the_all_to_alls_and_halves_the_experts(tp):
    result = _cli("apply", "--model", "tpplan.models.hf:qwen3_moe", "--plan", PLAN, "--dry-run", "--tp", str(tp), "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["comms"] == EP_SP
    layer = report["parameters"]
    experts = layer["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["placements"] == "shard(0)" and experts["local_shapes"] == [[4 // tp, 64, 64]] * tp


def test_dry_run_check_says_values_cannot_be_simulated():
    result = _cli("apply", "--model", "tpplan.models.hf:qwen3_moe", "--plan", PLAN, "--dry-run", "--tp", "2", "--check")
    assert result.exit_code == 1
    assert f"{PLAN}:1:1: TP502 the --check run with real values fails at TP 2: UnsimulatableDispatch: " in result.output
    assert "check its parity under torchrun" in result.output
    assert "internal error" not in result.output


def test_shipped_plan_is_clean_and_the_lint_guards_the_dispatch(tmp_path):
    plan = load_plan(ROOT / PLAN)
    problems = check_model(plan, meta_model("tpplan.models.hf:qwen3_moe"), [2, 4])
    # Clean: the MoE block's view(-1, hidden) of the sequence shard is followed as a strided
    # shard of the tokens (each rank's block in every batch row) through the router and the
    # all_to_all experts, and viewed back to shard(1) (it stopped the flow once: TP328).
    assert problems == []
    # TP305: 4 experts over 8 ranks.
    assert [p.code for p in check_model(plan, meta_model("tpplan.models.hf:qwen3_moe"), [8]) if p.severity == "error"] == ["TP305"]
    # all_to_all on replicated tokens (the all_reduce plan's layout): the flow sees it.
    replicated = (ROOT / "plans/hf/qwen3_moe_ep.yaml").read_text().replace("dispatch: all_reduce", "dispatch: all_to_all")
    problems = check_model(load_plan(text=replicated), meta_model("tpplan.models.hf:qwen3_moe"), [2])
    assert [p.code for p in problems if p.severity == "error"] == ["TP320"]
    assert "expert_parallel 'model.layers.0.mlp.experts'" in problems[0].message and "as shard(0)" in problems[0].message


def test_all_to_all_layouts_are_the_token_dim():
    text = "version: 1\nrules:\n  a.experts: {style: expert_parallel, dispatch: all_to_all, output_layouts: replicate}\n"
    with pytest.raises(PlanError) as raised:
        load_plan(text=text)
    (problem,) = raised.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP105", 3, 61)  # at the option, as every cross-field rule
    assert problem.message == (
        "rule 'a.experts': with dispatch all_to_all, 'output_layouts' must be shard(0) "
        "(the token dim of the experts' [T, H] input), not replicate"
    )


def test_all_to_all_reports_both_layouts_and_takes_any_spelling_of_shard_0():
    text = "version: 1\nrules:\n  e: {style: expert_parallel, dispatch: all_to_all, input_layouts: shard(1), output_layouts: replicate}\n"
    with pytest.raises(PlanError) as raised:
        load_plan(text=text)
    line = text.splitlines()[2]
    assert [(p.code, p.line, p.column) for p in raised.value.problems] == [
        ("TP105", 3, line.index("input_layouts") + 1), ("TP105", 3, line.index("output_layouts") + 1),
    ]
    spelled = "version: 1\nrules:\n  e: {style: expert_parallel, dispatch: all_to_all, input_layouts: ' SHARD( -00 )', output_layouts: 'packed_shard(0, 1)'}\n"
    assert load_plan(text=spelled).rules[0].spec.output_layouts == PlacementSpec("shard", 0)
