"""What the runtime blames on whom: failed collectives told apart by type and
place (not message text), tpplan's own bugs escaping instead of becoming the
user's TP501/TP502, and the one verification engine."""

from __future__ import annotations

import inspect
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tpplan import load_plan
from tpplan.core.placements import parse_placement, placement_text
from tpplan.core.problems import PlanError, first_line
from tpplan.models import mlp
from tpplan.check.result import CheckResult
from tpplan.runtime.report import ApplyReport
from tpplan.simulation.layouts import ParamLayout
from tpplan.simulation.comm import is_comm_failure
from tpplan.runtime.dryrun import dry_run
from tpplan.simulation.locate import FailureLocator, apply_located, run_located
from tpplan.runtime.options import ApplyOptions
from tpplan.simulation.simulate import forward_backward, scalar_loss, simulated_world, tp_mesh
from tpplan.check.verify import Pair, check_parity, compare, compare_with_reference

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


# -- failed collectives: by type and place ---------------------------------------------


def test_a_value_error_that_mentions_a_timeout_is_not_a_failed_collective():
    assert not is_comm_failure(ValueError("bad config: timeout_ms must be positive"))
    assert not is_comm_failure(RuntimeError("socket of the tokenizer closed; gloo is a word"))


def test_distributed_errors_and_runtime_errors_inside_a_collective_are_failed_collectives():
    assert is_comm_failure(dist.DistNetworkError("Connection closed by peer"))
    assert is_comm_failure(dist.DistBackendError("NCCL error"))
    assert is_comm_failure(RuntimeError("[gloo] wait"), in_collective=True)
    assert not is_comm_failure(ValueError("x"), in_collective=True)


def test_under_the_fake_process_group_nothing_is_a_failed_collective():
    with simulated_world(2):
        assert not is_comm_failure(dist.DistNetworkError("Connection closed by peer"))


# -- tpplan's own bugs escape; the user's model and plan are located ---------------------


def _mlp_plan():
    return load_plan(PLANS / "mlp_tp.yaml")


def test_a_tpplan_bug_during_apply_escapes_instead_of_blaming_a_rule(monkeypatch):
    import tpplan.sharding.apply

    # A KeyError inside tpplan's own apply code (raised from C, so tpplan's frame is innermost).
    monkeypatch.setattr(tpplan.sharding.apply, "shared_parameters", {}.__getitem__)
    with simulated_world(2), pytest.raises(KeyError):
        apply_located(_mlp_plan(), mlp.tiny(), tp_mesh(2))


def test_a_tpplan_bug_while_sharding_a_module_escapes_both_appliers_unchanged(monkeypatch):
    import tpplan.sharding.apply

    # Raised from C inside the applier's own step: tpplan's frame is innermost, no rule is blamed.
    monkeypatch.setattr(tpplan.sharding.apply, "parallelize_module", {}.__getitem__)
    with simulated_world(2):
        with pytest.raises(TypeError):
            apply_located(_mlp_plan(), mlp.tiny(), tp_mesh(2))
        with pytest.raises(TypeError):
            _mlp_plan().apply(mlp.tiny(), tp_mesh(2))


def test_plan_apply_and_the_located_path_blame_one_rule_with_one_problem():
    from tpplan.sharding.apply import ModuleShardingError

    text = "version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.act: colwise\n"
    with simulated_world(2):
        with pytest.raises(ModuleShardingError) as direct:
            load_plan(text=text, file="p.yaml").apply(mlp.tiny(), tp_mesh(2))
        with pytest.raises(PlanError) as located:
            apply_located(load_plan(text=text, file="p.yaml"), mlp.tiny(), tp_mesh(2))
    failed = direct.value
    # descendants first, in reverse module order: the last block's activation fails first
    assert (failed.rule.pattern, failed.rule.where, failed.fqn, type(failed.module).__name__, failed.tp) == (
        "blocks.*.act", "p.yaml:4", "blocks.1.act", "GELU", 2)
    assert isinstance(failed.error, NotImplementedError) and failed.__cause__ is failed.error  # torch's own error
    assert type(located.value) is PlanError and located.value.problems == failed.problems
    (problem,) = failed.problems
    assert (problem.code, problem.line, problem.column) == ("TP501", 4, 3)
    # torchrun ranks pickle errors to each other: it travels as the PlanError it is
    assert type(pickle.loads(pickle.dumps(failed))) is PlanError
    assert pickle.loads(pickle.dumps(failed)).problems == failed.problems


def test_a_tpplan_bug_in_the_forward_hooks_escapes_instead_of_becoming_tp502(monkeypatch):
    import tpplan.simulation.locate

    plan, model = _mlp_plan(), mlp.tiny()
    with simulated_world(2):
        rules = apply_located(plan, model, tp_mesh(2))
        monkeypatch.setattr(tpplan.simulation.locate, "_arg_shapes", {}.__getitem__)
        locator = FailureLocator(plan, model, rules, 2)
        with pytest.raises(KeyError):
            run_located(locator, lambda: forward_backward(model, torch.randn(2, 4, 32)))


def test_a_tpplan_bug_in_a_dry_run_escapes(monkeypatch):
    import tpplan.simulation.locate

    monkeypatch.setattr(tpplan.simulation.locate, "_arg_shapes", {}.__getitem__)
    with pytest.raises(KeyError):
        dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny", tp=2))


def test_an_error_of_the_users_model_is_still_located_at_its_rule():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(8, 8)

        def forward(self, x):
            raise ValueError("the user's forward is wrong")

    plan = load_plan(text="version: 1\nrules:\n  up: colwise\n", file="p.yaml")
    model = Broken()
    with simulated_world(2):
        rules = apply_located(plan, model, tp_mesh(2))
        with pytest.raises(PlanError) as caught:
            run_located(FailureLocator(plan, model, rules, 2), lambda: model(torch.randn(2, 8)))
    (problem,) = caught.value.problems
    assert problem.code == "TP502" and "the user's forward is wrong" in problem.message


def test_a_model_without_float_outputs_is_the_models_problem_not_a_bug():
    class Ints(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(8, 8)

        def forward(self, x):
            self.up(x)
            return {"ids": torch.zeros(2, dtype=torch.long)}

    plan = load_plan(text="version: 1\nrules:\n  up: colwise\n", file="p.yaml")
    model = Ints()
    with simulated_world(2):
        rules = apply_located(plan, model, tp_mesh(2))
        with pytest.raises(PlanError) as caught:
            run_located(FailureLocator(plan, model, rules, 2), lambda: scalar_loss(model(torch.randn(2, 8))).backward())
    assert caught.value.problems[0].code == "TP502"
    assert "holds no floating-point tensor" in caught.value.problems[0].message


# -- one verification engine ---------------------------------------------------------------


def test_compare_reports_differences_in_order_the_first_first():
    a, b = torch.ones(3), torch.zeros(2)
    result = compare([Pair("x", a, a), Pair("y", a + 1, a), Pair("z", b, a), Pair("w", None, a)])
    assert not result.passed
    assert result.first_difference.startswith("y differs by up to 1 (allowed ")
    assert result.problems[1:] == ["z: shape (2,), single device (3,)", "w is missing"]
    assert list(result.diffs) == ["x", "y", "z"] and result.diffs["x"] == 0.0


def test_torchrun_check_and_dry_run_check_return_one_result_type():
    torch.manual_seed(0)
    model, inputs = mlp.tiny(), (torch.randn(2, 4, 32),)
    output = model(*inputs)
    output.pow(2).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    local = compare_with_reference(model, mlp.tiny(), inputs, output, grads)
    parity = check_parity(mlp.tiny, _mlp_plan(), 2)
    assert type(local) is type(parity) is CheckResult
    assert local.passed and parity.passed
    assert set(parity.grad_diffs) == {name for name, _ in mlp.tiny().named_parameters()}


# -- texts say what the code does ----------------------------------------------------------


def _comment_values(cls: type, attribute: str) -> list[str]:
    line = next(line for line in inspect.getsource(cls).splitlines() if line.strip().startswith(f"{attribute}:"))
    return re.findall(r'"([^"]+)"', line.partition("#")[2])


def test_param_layout_documents_placements_as_the_code_writes_them():
    examples = [v for v in _comment_values(ParamLayout, "placements") if v != "-"]
    assert examples
    assert all(placement_text(parse_placement(v)) == v for v in examples), examples


def test_apply_report_documents_only_devices_a_run_can_report():
    # dry run: "fake", or "cpu" after the retry with values; torchrun: pick_device's choices.
    assert set(_comment_values(ApplyReport, "device")) <= {"fake", "cpu", "cuda", "npu"}


def test_dry_run_help_says_fake_tensors_not_meta():
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    out = CliRunner().invoke(app, ["apply", "--help"], env={"COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}).output
    flat = " ".join(out.split())
    assert "meta tensors" not in flat and "meta device" not in flat
    assert "fake tensors" in flat


def test_dry_run_report_device_is_fake():
    report = dry_run(ApplyOptions(plan=str(PLANS / "mlp_tp.yaml"), model="tpplan.models.mlp:tiny", tp=2))
    assert report.device == "fake" and report.device in _comment_values(ApplyReport, "device")


# -- written once ---------------------------------------------------------------------------


def test_one_placement_spelling_for_plan_and_torch_placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    assert [placement_text(p) for p in (Shard(0), Shard(-1), Replicate(), Partial("max"))] == ["shard(0)", "shard(-1)", "replicate", "partial(max)"]
    assert placement_text(parse_placement("Partial(avg)")) == "partial(avg)"


def test_first_line_names_the_class_of_non_builtin_errors_or_when_asked():
    class Odd(Exception):
        pass

    assert first_line(ValueError("\n\nfirst\nsecond")) == "first"
    assert first_line(ValueError("first"), with_type=True) == "ValueError: first"
    assert first_line(Odd("x")) == "Odd: x"
    assert len(first_line(ValueError("y" * 400))) == 300


def test_runtime_codes_are_documented_beside_their_names():
    from tpplan.lint.codes import catalog

    names = {entry.code: entry.name for entry in catalog() if entry.code.startswith("TP50")}
    assert names == {
        "TP500": "model-factory", "TP501": "apply-failed", "TP502": "forward-failed",
        "TP503": "ranks-disagree", "TP504": "collective-failed", "TP505": "check-mismatch",
        "TP506": "replicas-diverge", "TP507": "no-dtensor-rule",
    }


def test_shared_runtime_code_does_not_go_through_the_torchrun_module():
    for path in ("tpplan/runtime/dryrun.py", "tpplan/lint/rules/dry_run.py", "tpplan/simulation/ladder.py"):
        assert "torchrun import" not in (ROOT / path).read_text(), path


# -- typed usage errors: the library names the option, the CLI words it -------------------


def test_options_errors_name_the_option_and_leave_flag_names_to_the_cli(tmp_path):
    import pickle

    from tpplan.cli.apply import usage_text
    from tpplan.runtime.devices import mesh_shape
    from tpplan.runtime.options import ApplyOptionsError

    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    with pytest.raises(ApplyOptionsError) as caught:
        dry_run(ApplyOptions(plan=str(plan), model="tpplan.models.mlp:tiny"))
    assert (caught.value.option, caught.value.kind) == ("tp", "missing")
    assert "--" not in str(caught.value)
    assert usage_text(caught.value) == "--dry-run needs --tp N (the plan lists no mesh.sizes to pick from)"

    with pytest.raises(ApplyOptionsError) as caught:
        mesh_shape(4, 3, "tp")
    copied = pickle.loads(pickle.dumps(caught.value))  # it travels between ranks in the consensus
    assert (copied.option, copied.facts) == ("tp", {"tp": 3, "world": 4})
    assert usage_text(copied) == "--tp (3) must divide the world size (4)"


def test_no_library_module_spells_a_usage_error_in_flag_names():
    for path in (ROOT / "tpplan").rglob("*.py"):
        if "cli" in path.relative_to(ROOT / "tpplan").parts:
            continue  # the CLI words them
        for line in path.read_text().splitlines():
            if "ApplyOptionsError(" in line or "UsageError(" in line:
                assert not re.search(r"--[a-z]", line.split("ApplyOptionsError(", 1)[-1]), (path.name, line)


def test_usage_errors_of_ranks_are_worded_per_rank():
    from tpplan.cli.apply import usage_text
    from tpplan.runtime.consensus import usage_errors
    from tpplan.runtime.options import ApplyOptionsError, RanksUsageError

    error = ApplyOptionsError("tp", "not-a-divisor", "3 does not divide the world size (2)", tp=3, world=2)
    states = [{"rank": 0, "host": "h", "usage": None}, {"rank": 1, "host": "h", "usage": error}]
    assert usage_text(RanksUsageError(usage_errors(states))) == "rank 1: --tp (3) must divide the world size (2)"
