"""A dry run builds the model once per degree (+ the single-device reference of
--check), and --check is one engine in every mode: with --checkpoint too, a
failure is located at its first differing tensor and replicas are compared (TP506)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tpplan.models import llama, mlp
from tpplan.runtime.dryrun import dry_run
from tpplan.runtime.options import ApplyOptions
from tpplan.simulation.training import TrainOptions

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
LLAMA_COMMS = {"forward": {"all_gather": 1, "all_reduce": 5}, "backward": {"all_reduce": 5}}

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


@pytest.fixture
def counted(monkeypatch):
    """`counted:tiny` (tpplan.models.llama:tiny, TP 8 divides it), `counted:mlp` and
    `counted:scaled`, and the number of times each factory was called."""
    calls = {"n": 0}

    def wrap(factory):
        def build():
            calls["n"] += 1
            return factory()
        return build

    from test_check_trust import scaled_mlp

    module = types.ModuleType("counted")
    module.tiny, module.mlp, module.scaled = wrap(llama.tiny), wrap(mlp.tiny), wrap(scaled_mlp)
    monkeypatch.setitem(sys.modules, "counted", module)
    return calls


def saved(model: torch.nn.Module, path: Path) -> str:
    path.mkdir()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    return str(path)


@pytest.mark.parametrize(("more", "builds"), [
    ({}, 1),  # fake tensors
    ({"check": True}, 2),  # fake tensors (sizing it), and the reference with real values: no fake pass
    ({"train": TrainOptions(batch=2, seq=8)}, 1),  # the memory plan's fake tensors
])
def test_a_dry_run_at_tp_8_builds_the_model_once_plus_the_reference(counted, more, builds):
    report = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model="counted:tiny", tp=8, **more))
    assert report.ok, report.problems
    assert counted["n"] == builds
    assert report.comms == LLAMA_COMMS
    assert len(report.params) == 21 and report.world_size == 8


def test_check_with_a_checkpoint_at_tp_8_builds_one_model_that_both_sides_load(counted, tmp_path):
    torch.manual_seed(5)
    path = saved(llama.tiny(), tmp_path / "ckpt")
    report = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model="counted:tiny", tp=8, check=True, checkpoint=path))
    assert report.ok, report.problems
    assert counted["n"] == 1  # was 11: one meta model per rank, one more, and the reference
    assert report.check.passed and report.comms == LLAMA_COMMS
    assert report.checkpoint["loaded"] == 21 and len(set(report.checkpoint["rank_read_bytes"])) == 1


def test_check_passes_give_the_collectives_of_the_fake_pass():
    for plan, model in (("llama_tp_sp.yaml", "tpplan.models.llama:tiny"), ("mlp_tp.yaml", "tpplan.models.mlp:tiny")):
        fake = dry_run(ApplyOptions(plan=str(PLANS / plan), model=model, tp=4))
        checked = dry_run(ApplyOptions(plan=str(PLANS / plan), model=model, tp=4, check=True))
        assert checked.ok and checked.check.passed, checked.problems
        assert checked.comms == fake.comms and checked.params == fake.params and checked.rule_of == fake.rule_of


def test_a_failed_check_with_a_checkpoint_names_the_first_differing_tensor_at_its_rule(counted, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text((PLANS / "mlp_tp.yaml").read_text().replace("blocks.*.out_proj: rowwise", "blocks.*.out_proj: {style: rowwise, output_layouts: partial}"))
    path = saved(mlp.tiny(), tmp_path / "ckpt")
    report = dry_run(ApplyOptions(plan=str(broken), model="counted:mlp", tp=2, check=True, checkpoint=path))
    [problem] = report.problems
    assert (problem.code, problem.line, problem.column) == ("TP505", 15, 3)
    assert "; the output of 'blocks.0.out_proj' is the first tensor that differs (rank 0: by up to " in problem.message
    assert problem.message.endswith("; located at rule 'blocks.*.out_proj' (its rule)")
    assert counted["n"] == 1


def test_diverging_replicas_are_found_with_a_checkpoint_too(counted, tmp_path):
    from test_check_trust import SCALED_PLAN, scaled_mlp

    plan = tmp_path / "scaled.yaml"
    plan.write_text(SCALED_PLAN)
    path = saved(scaled_mlp(), tmp_path / "ckpt")
    report = dry_run(ApplyOptions(plan=str(plan), model="counted:scaled", tp=2, check=True, checkpoint=path))
    assert [(p.code, p.line, p.column) for p in report.problems] == [("TP506", 3, 3), ("TP506", 3, 3)]
    assert report.problems[0].message.startswith(
        "at TP 2, replicated parameter '0.scale': its gradient differs between ranks after backward (rank 1 from rank 0 by up to ")


def test_a_checkpoint_that_does_not_fit_is_reported_once_and_not_checked(tmp_path):
    model = llama.tiny()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state["norm.weightx"] = state.pop("norm.weight")
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / "model.safetensors")
    report = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model="tpplan.models.llama:tiny", tp=2, check=True,
                                  checkpoint=str(tmp_path / "bad")))
    assert [p.code for p in report.problems] == ["TP601", "TP602"]  # was each twice: the metadata check and the load
    assert report.check is None and report.comms == LLAMA_COMMS


@pytest.mark.parametrize(("check", "builds"), [(False, 2), (True, 2)])  # were 3 and 4
def test_a_model_fake_tensors_cannot_run_is_built_once_more_with_values(tmp_path, monkeypatch, check, builds):
    from test_dryrun import GATED, GATED_PLAN

    (tmp_path / "gated.py").write_text(GATED + "\nCALLS = []\n\n\ndef counted():\n    CALLS.append(1)\n    return Gated()\n")
    (tmp_path / "gated.yaml").write_text(GATED_PLAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gated", raising=False)
    report = dry_run(ApplyOptions(plan=str(tmp_path / "gated.yaml"), model="gated:counted", tp=2, check=check))
    assert report.ok, report.problems
    assert report.comms == {"forward": {"all_reduce": 1}, "backward": {}}
    assert len(sys.modules["gated"].CALLS) == builds


def test_a_plan_that_fails_with_check_is_located_as_without_it():
    # the values pass fails first; the fake pass after it says where (no sizes of its left in DTensor's cache)
    plain = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model="tpplan.models.llama:tiny", tp=3))
    checked = dry_run(ApplyOptions(plan=str(PLANS / "llama_tp.yaml"), model="tpplan.models.llama:tiny", tp=3, check=True))
    assert [str(p) for p in checked.problems] == [str(p) for p in plain.problems]
    assert "shape '[2, 8, -1, 8]' is invalid for input of size 688" in plain.problems[0].message
