"""`tpplan apply --dry-run`: one process simulates N ranks on fake tensors (FakeTensorMode).

The expected bytes and collective counts (tests/expected.py) are derived from
the model configs, not copied from a run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expected import llama_bytes, llama_comms, mlp_bytes, mlp_comms
from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.runtime.dryrun import dry_run
from tpplan.models import llama, mlp
from tpplan.models.llama import LlamaConfig
from tpplan.cli.apply import worded
from tpplan.runtime.options import ApplyOptions, UsageError

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"


pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def run(*args: str):
    return CliRunner().invoke(app, ["apply", *args], env={"FORCE_COLOR": None, "NO_COLOR": None})


def _expected(file: str):
    if file == "mlp_tp.yaml":
        model = mlp.tiny()
        return "tpplan.models.mlp:tiny", lambda tp: mlp_bytes(model, tp), mlp_comms(len(model.blocks))
    cfg = llama.tiny().config
    return "tpplan.models.llama:tiny", lambda tp: llama_bytes(cfg, tp), llama_comms(file, cfg.n_layers)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("file", ["llama_tp.yaml", "llama_tp_sp.yaml", "mlp_tp.yaml"])
def test_shipped_plan_dry_run_reports_exact_bytes_and_collectives(file, tp):
    model, bytes_at, comms = _expected(file)
    report = dry_run(ApplyOptions(plan=str(PLANS / file), model=model, tp=tp))
    assert report.ok, report.problems
    total, per_rank = bytes_at(tp)
    assert (report.total_bytes, report.rank_bytes) == (total, [per_rank] * tp)
    assert report.comms == comms
    assert report.world_size == tp
    assert set(report.modules) == set(load_plan(PLANS / file).match(build(model)))


def build(ref: str):
    return {"tpplan.models.mlp:tiny": mlp.tiny, "tpplan.models.llama:tiny": llama.tiny}[ref]()


@pytest.mark.parametrize("file", ["llama_tp.yaml", pytest.param("llama_tp_sp.yaml", marks=pytest.mark.slow)])  # each ~10 s
def test_llama3_8b_at_tp8_costs_no_memory_and_reports_its_real_sizes(file):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = dry_run(ApplyOptions(plan=str(PLANS / file), model="tpplan.models.llama:llama3_8b", tp=8))
    assert report.ok, report.problems
    cfg = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336)
    total, per_rank = llama_bytes(cfg, 8)
    assert (report.total_bytes, report.per_rank_bytes) == (total, per_rank)
    assert total > 32e9  # 8.03e9 float32 parameters, none of them allocated:
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB
    assert report.comms == llama_comms(file, 32)
    wq = next(p for p in report.params if p.name == "layers.31.attention.wq.weight")
    assert (wq.global_shape, wq.local_shapes[7], wq.placements) == ((4096, 4096), (512, 4096), "shard(0)")


def test_dry_run_check_compares_real_per_rank_values_with_one_device():
    report = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp_sp.yaml"), model="tpplan.models.llama:tiny", tp=4, check=True))
    assert report.ok, report.problems
    assert report.check.passed and report.check.max_abs_diff < 1e-5


def test_dry_run_check_failure_is_an_error_with_the_difference(tmp_path):
    broken = tmp_path / "broken.yaml"
    # Row-parallel out_proj whose partial sums are never reduced: every rank is wrong.
    broken.write_text((PLANS / "mlp_tp.yaml").read_text().replace("blocks.*.out_proj: rowwise", "blocks.*.out_proj: {style: rowwise, output_layouts: partial}"))
    result = run("--plan", str(broken), "--model", "tpplan.models.mlp:tiny", "--dry-run", "--tp", "2", "--check", "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["check"]["passed"] is False and report["check"]["max_abs_diff"] > 1e-3
    (problem,) = report["problems"]
    assert problem["code"] == "TP505"
    assert problem["message"].startswith("--check failed at TP 2: output: rank 0 differs by up to")


def test_json_report_has_the_spec_keys_and_shapes():
    result = run("--plan", str(PLANS / "mlp_tp.yaml"), "--model", "tpplan.models.mlp:tiny", "--dry-run", "--tp", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {"ok", "problems", "world_size", "modules", "params", "comms", "check"} <= set(report)
    assert report["ok"] is True and report["problems"] == [] and report["world_size"] == 2 and report["check"] is None
    assert report["modules"] == {
        "blocks.0.in_proj": "colwise",
        "blocks.0.out_proj": "rowwise",
        "blocks.1.in_proj": "colwise",
        "blocks.1.out_proj": "rowwise",
    }
    assert report["params"] == dict(zip(("total_bytes", "per_rank_bytes"), mlp_bytes(mlp.tiny(), 2)))
    assert report["comms"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 1}}
    assert report["parameters"]["blocks.0.in_proj.weight"] == {
        "dtype": "float32",
        "global_shape": [128, 32],
        "local_shapes": [[64, 32], [64, 32]],
        "placements": "shard(0)",
    }


def test_text_report_shows_styles_memory_and_collectives():
    result = run("--plan", str(PLANS / "llama_tp_sp.yaml"), "--model", "tpplan.models.llama:tiny", "--dry-run", "--tp", "4")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "tpplan apply llama-tp-sp on tpplan.models.llama:tiny: 4 simulated ranks (fake process group, fake tensors)" in out
    assert re.search(r"│ layers\.\*\.attention\.w\{q,k,v\} +│ colwise +│ +6 │ .*llama_tp_sp\.yaml:24 +│", out)
    # Both layers' wq in one row: 2 x 32 x 128 floats on each rank.
    assert re.search(r"│ layers\.\*\.attention\.wq\.weight +│ +2 │ \(128, 128\) │ \(32, 128\) +│ shard\(0\) +│ +32\.00 KiB │", out)
    total, per_rank = llama_bytes(llama.tiny().config, 4)
    assert re.search(rf"│ ranks 0-3 +│ +{per_rank} │", out) and re.search(rf"│ all \(unsharded\) +│ +{total} │", out)
    assert re.search(r"│ reduce_scatter │ +5 │ +5 │", out)


def test_heads_that_the_degree_does_not_divide_name_module_rule_and_shapes():
    result = run("--plan", str(PLANS / "llama_tp.yaml"), "--model", "tpplan.models.llama:tiny", "--dry-run", "--tp", "3")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    plan = load_plan(PLANS / "llama_tp.yaml")
    rule = next(r for r in plan.rules if r.pattern == "layers.*.attention.w{q,k,v}")
    expected = (
        f"{PLANS / 'llama_tp.yaml'}:{rule.line}:{rule.column}: TP502 the forward of 'layers.0.attention' (Attention, input (2, 8, 128), (8, 4, 2)) "
        "fails at TP 3: shape '[2, 8, -1, 8]' is invalid for input of size 688; "
        f"rule 'layers.*.attention.w{{q,k,v}}' (colwise, {rule.where}) shards layers.0.attention.wq.weight (128, 128) "
        "into (43, 128) on rank 0 (shard(0)), not divisible: dim 0 is 128, 128 % 3 = 2"
    )
    assert expected in result.stdout
    assert "note: TP 3 is not among the degrees the plan promises (mesh.sizes [2, 4, 8])" in result.stdout


def test_a_style_the_module_cannot_take_is_located_at_its_rule(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.act: rowwise\n")
    result = run("--plan", str(plan), "--model", "tpplan.models.mlp:tiny", "--dry-run", "--tp", "2", "--format", "json")
    assert result.exit_code == 1
    (problem,) = json.loads(result.stdout)["problems"]
    assert (problem["code"], problem["line"], problem["column"]) == ("TP501", 4, 3)
    assert problem["message"].startswith("rowwise cannot shard 'blocks.1.act' (GELU) at TP 2: RowwiseParallel currently only support nn.Linear and nn.Embedding")


def test_a_rule_matching_no_module_stops_the_dry_run_before_sharding(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.outproj: rowwise\n")
    result = run("--plan", str(plan), "--model", "tpplan.models.mlp:tiny", "--dry-run", "--tp", "2", "--format", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [(p["code"], p["line"]) for p in report["problems"]] == [("TP200", 4)]
    assert report["modules"] == {} and report["comms"] == {"forward": {}, "backward": {}}


def test_without_tp_the_largest_promised_degree_is_simulated_and_said():
    report = dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny"))
    assert report.tp == 8
    assert report.notes == ["--tp not given: simulating TP 8, the largest of the plan's mesh.sizes [2, 4, 8]"]


def test_plan_without_sizes_needs_tp(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    with pytest.raises(UsageError, match=r"--dry-run needs --tp N"), worded():
        dry_run(ApplyOptions(plan=str(plan), model="tpplan.models.mlp:tiny"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "3"], "--steps trains on real ranks (torchrun)"),
        (["--tp", "0"], "Invalid value for '--tp'"),
        (["--inputs", "nowhere"], "--inputs 'nowhere' must be MODULE:FUNCTION"),
    ],
)
def test_usage_errors_exit_2_without_a_traceback(args, message):
    result = run("--plan", str(PLANS / "mlp_tp.yaml"), "--model", "tpplan.models.mlp:tiny", "--dry-run", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_unreadable_plan_exits_2_with_tp001():
    result = run("--plan", "missing.yaml", "--model", "tpplan.models.mlp:tiny", "--dry-run", "--format", "json")
    assert result.exit_code == 2
    (problem,) = json.loads(result.stdout)["problems"]
    assert (problem["code"], problem["file"]) == ("TP001", "missing.yaml")


GATED = '''\
import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        if x.abs().sum().item() == 0:  # data-dependent: fake tensors cannot answer it
            return x
        return self.down(torch.relu(self.up(x)))


def build():
    return Gated()
'''
GATED_PLAN = "version: 1\nrules:\n  up: colwise\n  down: rowwise\n"


@pytest.fixture
def gated(tmp_path, monkeypatch):
    (tmp_path / "gated.py").write_text(GATED)
    (tmp_path / "gated.yaml").write_text(GATED_PLAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "gated.yaml"


def test_a_small_model_that_needs_values_is_counted_with_real_ones(gated):
    report = dry_run(ApplyOptions(plan=str(gated), model="gated:build", tp=2))
    assert report.ok, report.problems
    assert report.comms == {"forward": {"all_reduce": 1}, "backward": {}}
    assert report.device == "cpu"
    (note,) = report.notes
    assert note.startswith("fake tensors could not run the forward and backward (DataDependentOutputException: aten._local_scalar_dense")
    # (16 x 64 + 64) + (64 x 16 + 16) float32 parameters.
    assert note.endswith("the collectives were counted with real values of rank 0 (8.31 KiB model)")


def test_a_big_model_that_needs_values_is_not_materialized(gated, monkeypatch):
    from tpplan.simulation import simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    report = dry_run(ApplyOptions(plan=str(gated), model="gated:build", tp=2))
    (problem,) = report.problems
    assert problem.code == "TP502"
    assert problem.message.startswith("the forward of '<root>' (Gated, input (2, 8, 16)) fails at TP 2: ")
    assert problem.message.endswith("(on fake tensors; a run with real values would need 8.31 KiB: try --check on a smaller configuration, or torchrun)")


def test_huggingface_model_runs_on_fake_tensors():
    pytest.importorskip("transformers")
    report = dry_run(ApplyOptions(plan=str(PLANS / "hf" / "llama_tp.yaml"), model="tpplan.models.hf:llama", tp=2))
    assert report.ok, report.problems
    # transformers skips its data-dependent mask checks on fake tensors: no retry needed.
    assert (report.device, report.notes) == ("fake", [])
    assert report.comms["forward"]["all_reduce"] > 0


BROKEN = '''\
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(x))


def build():
    return Broken()
'''


def test_a_model_that_fails_on_one_device_too_is_its_own_problem_not_the_plans(tmp_path, monkeypatch):
    # up (16 -> 64) feeds down (32 -> 16): at TP 2 down's local shard takes 16 of 32 and
    # the sharded forward fails, but so does the model on one device
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "broken.yaml").write_text(GATED_PLAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = dry_run(ApplyOptions(plan=str(tmp_path / "broken.yaml"), model="broken:build", tp=2))
    (problem,) = report.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(tmp_path / "broken.py"), 11)
    assert problem.message.startswith(
        "the model fails on one device too (on the default inputs (2, 8, 16): a model that needs others takes --inputs MOD:FN), "
        "so the plan is not the cause: without the plan, one forward and backward on one device (broken:build) failed: "
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )


MIXED = """\
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, dtype, heads, cast):
        super().__init__()
        self.heads, self.cast = heads, cast
        self.q = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.o = nn.Linear(dim, dim, bias=False, dtype=dtype)
        # float32 whatever the model's dtype, as rotary tables often are
        self.register_buffer("table", torch.eye(dim, dtype=torch.float32), persistent=False)

    def forward(self, x):
        q = self.q(x)
        if self.heads:  # by the global head count: fails sharded only
            q = q.view(x.shape[0], x.shape[1], self.heads, x.shape[-1] // self.heads).flatten(2)
        out = self.o(q)
        table = self.table.to(out.dtype) if self.cast else self.table
        return torch.einsum("bsd,de->bse", out, table)


class Model(nn.Module):
    def __init__(self, dtype=None, heads=0, cast=False):
        super().__init__()
        self.embed = nn.Embedding(64, 32, dtype=dtype)
        self.attn = Attention(32, dtype, heads, cast)
        self.head = nn.Linear(32, 64, bias=False, dtype=dtype)

    def forward(self, ids):
        return self.head(self.attn(self.embed(ids)))


def rotary():  # in its own float32 it runs; in bfloat16 (--dtype bf16) not even on one device
    return Model()


def rotary_bf16():
    return Model(dtype=torch.bfloat16)


def global_heads():
    return Model(heads=4, cast=True)
"""
MIXED_PLAN = "version: 1\nrules:\n  attn.q: colwise\n  attn.o: rowwise\n"
EINSUM_LINE = MIXED.splitlines().index('        return torch.einsum("bsd,de->bse", out, table)') + 1


@pytest.fixture
def mixed(tmp_path, monkeypatch):
    (tmp_path / "mixed.py").write_text(MIXED)
    (tmp_path / "mixed.yaml").write_text(MIXED_PLAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mixed", raising=False)  # this test's copy, at its own path
    return tmp_path


def _bf16(**options):
    from tpplan.simulation.training import TrainOptions

    return TrainOptions(dtype="bf16", **options)


@pytest.mark.parametrize("big", [True, False], ids=["above-values-limit", "under-it"])
@pytest.mark.parametrize("ref, train", [("mixed:rotary", _bf16()), ("mixed:rotary_bf16", None)], ids=["dtype-bf16", "own-bf16"])
def test_a_model_failing_on_one_device_too_is_its_own_problem_at_any_size(mixed, monkeypatch, big, ref, train):
    # a float32 table multiplied into bf16 activations: the sharded forward fails, and so
    # does the unsharded one. Above the values limit the one-device run is shape-only
    # (fake tensors check dtypes too); under it, it has real values.
    from tpplan.simulation import simulate

    if big:
        monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    extra = {"train": train} if train else {}
    report = dry_run(ApplyOptions(plan=str(mixed / "mixed.yaml"), model=ref, tp=2, **extra))
    (problem,) = report.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(mixed / "mixed.py"), EINSUM_LINE)
    how = ("in bfloat16; " if train else "") + ("a shape-only run on fake tensors, the model being above the values limit; " if big else "")
    assert problem.message.startswith(
        f"the model fails on one device too ({how}on the default inputs (2, 8): a model that needs others takes --inputs MOD:FN), "
        f"so the plan is not the cause: without the plan, one forward and backward on one device ({ref}) failed: RuntimeError: expected scalar type"
    )


def test_the_cli_exits_1_for_a_big_model_failing_in_bf16_on_one_device(mixed, monkeypatch):
    from tpplan.simulation import simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    result = run("--plan", str(mixed / "mixed.yaml"), "--model", "mixed:rotary", "--dry-run", "--tp", "2", "--dtype", "bf16")
    assert result.exit_code == 1, result.output
    assert f"{mixed / 'mixed.py'}:{EINSUM_LINE}:1: TP500 the model fails on one device too (in bfloat16; a shape-only run" in result.output
    assert "TP502" not in result.output


@pytest.mark.parametrize("train", [None, _bf16()], ids=["fake-pass", "memory-planning"])
def test_a_big_model_failing_only_sharded_is_still_the_plans_problem_at_its_rule(mixed, monkeypatch, train):
    from tpplan.simulation import simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    extra = {"train": train} if train else {}
    report = dry_run(ApplyOptions(plan=str(mixed / "mixed.yaml"), model="mixed:global_heads", tp=2, **extra))
    (problem,) = report.problems
    assert (problem.code, problem.file, problem.line) == ("TP502", str(mixed / "mixed.yaml"), 3)
    assert problem.message.startswith("the forward of 'attn' (Attention, input (2, 8, 32)) fails at TP 2: ")
    assert "rule 'attn.q' (colwise" in problem.message


def test_the_lint_does_not_blame_the_plan_for_a_model_failing_on_one_device(mixed, monkeypatch):
    # validate --model: the unsharded trace fails first (TP329), so TP330 is skipped, a warning
    from tpplan.simulation import simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    result = CliRunner().invoke(app, ["validate", str(mixed / "mixed.yaml"), "--model", "mixed:rotary_bf16", "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert "TP330 the shape-level dry run was skipped" in result.output
    assert f"(at {mixed / 'mixed.py'}:{EINSUM_LINE})" in result.output
    assert " fails: " not in result.output




def test_a_model_the_default_inputs_cannot_run_without_a_plan_either_is_told_to_take_inputs_not_blamed_on_the_plan(tmp_path):  # tests/drafter_model.py
    (tmp_path / "drafter.yaml").write_text("version: 1\nrules:\n  up: colwise\n")
    report = dry_run(ApplyOptions(plan=str(tmp_path / "drafter.yaml"), model="drafter_model:build", tp=2))
    (problem,) = report.problems
    assert (problem.code, problem.file, problem.line) == ("TP500", str(Path(__file__).parent / "drafter_model.py"), 12)
    assert problem.message == (
        "the model fails on one device too (on the default inputs (2, 8): a model that needs others takes --inputs MOD:FN), "
        "so the plan is not the cause: without the plan, one forward and backward on one device (drafter_model:build) failed: "
        "ValueError: target_states cannot be None"
    )


def test_an_empty_plan_still_gets_its_report_every_parameter_whole(tmp_path):
    """A plan with no rules runs (exit 0): its report says so instead of printing nothing."""
    plan = tmp_path / "empty.yaml"
    plan.write_text("version: 1\nrules: {}\n")
    result = run("--plan", str(plan), "--model", "tpplan.models.mlp:tiny", "--dry-run", "--tp", "2", "--check")
    assert result.exit_code == 0, result.output
    assert "Parameters at TP 2" in result.output and "Modules and styles" not in result.output
    assert "check against a single device: passed, max |diff| 0" in result.output


def test_a_check_that_would_not_fit_in_memory_is_not_run_and_says_so(monkeypatch):
    """Above the values limit --check runs with real values after the fake pass; where the
    two models' parameters and gradients exceed the free memory it would be killed: the
    report keeps the fake pass, the check is null (not passed) and a note says why."""
    from tpplan.simulation import ladder, simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    monkeypatch.setattr(ladder, "available_memory", lambda: 1 << 16)  # the tiny MLP's check needs 16 B x 16.7 k elements
    report = dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny", tp=2, check=True))
    assert report.ok and report.check is None and report.comms
    assert any(n.startswith("--check was not run: real values would need about 261") for n in report.notes), report.notes
    monkeypatch.setattr(ladder, "available_memory", lambda: 1 << 30)
    report = dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny", tp=2, check=True))
    assert report.check is not None and report.check.passed
