"""torchtitan 0.2.2's own models (tpplan.titan_models) with plans written from its
own parallelize functions (plans/titan/): the lint is clean, the dry run's
collectives equal those of torchtitan's function applied to the same model in
the same simulated world, and --check passes. torchtitan is a development
dependency only (README, development); without it these tests skip."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

if importlib.util.find_spec("torchtitan") is None:  # torchtitan itself needs triton: tpplan.titan_models imports it without
    pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.2.2, README)", allow_module_level=True)

import torch  # noqa: E402

from tpplan import load_plan  # noqa: E402
from tpplan.lint import lint_model  # noqa: E402
from tpplan.runtime.dryrun import dry_run  # noqa: E402
from tpplan.runtime.options import ApplyOptions  # noqa: E402
from tpplan.runtime.simulate import count_collectives, default_inputs, simulated_world, tp_mesh  # noqa: E402
from tpplan.titan_models import titan  # noqa: E402

PLANS = Path(__file__).resolve().parent.parent / "plans" / "titan"
# Qwen3 (DTensor q/k/v into SDPA, the device-faithful rules) in the default suite, the rest under -m slow
MODELS = [pytest.param("llama3", marks=pytest.mark.slow), "qwen3", pytest.param("deepseek_v3", marks=pytest.mark.slow)]

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def _torchtitan_tp(name: str, model, mesh) -> None:
    """torchtitan's own TP function for `name`, as its parallelize_* calls it
    without float8, loss parallel, async TP or context parallel."""
    if name == "llama3":
        titan("models.llama3.infra.parallelize").apply_tp(model, mesh, False, False)
    elif name == "qwen3":
        titan("models.qwen3.infra.parallelize").apply_non_moe_tp(model, mesh, False, False, False, False)
    elif name == "deepseek_v3":
        titan("models.deepseek_v3.infra.parallelize").apply_non_moe_tp(model, mesh, False, False, False)
    else:
        parallelize = titan("models.llama4.infra.parallelize")
        parallelize.apply_non_moe_tp(model, mesh, False, False)
        parallelize.apply_moe_ep_tp(model, mesh, None, None, None)  # TP only: experts sharded on their hidden dim


def _model(name: str):
    import tpplan.titan_models as models

    torch.manual_seed(0)
    return getattr(models, name)()


def torchtitan_comms(name: str, tp: int) -> dict:
    """Collectives of one forward and backward of the model parallelized by torchtitan itself."""
    with simulated_world(tp):
        model = _model(name)
        _torchtitan_tp(name, model, tp_mesh(tp))
        return count_collectives(model, default_inputs(model))


@pytest.mark.parametrize("name", MODELS)
def test_torchtitan_plan_is_clean_against_its_model_at_tp_2_and_4(name):
    with torch.device("meta"):
        model = _model(name)
    problems = lint_model(load_plan(PLANS / f"{name}_tp.yaml"), model, [2, 4])
    assert [str(p) for p in problems] == []


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_dry_run_collectives_equal_torchtitans_own_function(name, tp):
    report = dry_run(ApplyOptions(plan=str(PLANS / f"{name}_tp.yaml"), model=f"tpplan.titan_models:{name}", tp=tp))
    assert report.ok, [str(p) for p in report.problems]
    # 2 layers: per layer 2 all-gathers and 2 reduce-scatters each way, the output
    # layer's all-gather forward, the embedding's reduce-scatter and the final norm's
    # all-gather forward; its gradient all-gather is the first layer's reduce-scatter's
    assert report.comms == torchtitan_comms(name, tp) == {
        "forward": {"all_gather": 6, "reduce_scatter": 5},
        "backward": {"all_gather": 5, "reduce_scatter": 5},
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_dry_run_check_matches_one_device(name, tp):
    report = dry_run(ApplyOptions(plan=str(PLANS / f"{name}_tp.yaml"), model=f"tpplan.titan_models:{name}", tp=tp, check=True))
    assert report.ok, [str(p) for p in report.problems]
    assert report.check is not None and report.check.passed


def test_qwen3_plan_wrong_on_gpu_too_fails_here_at_its_rule(tmp_path):
    # wk and wv hand SDPA plain tensors while wq hands it a DTensor: DTensor refuses the
    # mix on any device, so the device-faithful rules must not hide it (TP502, not TP507)
    text = (PLANS / "qwen3_tp.yaml").read_text()
    text = text.replace("layers.*.attention.w{q,k,v}: {style: colwise, use_local_output: false}",
                        "layers.*.attention.wq: {style: colwise, use_local_output: false}\n"
                        "  layers.*.attention.w{k,v}: colwise")
    text = text.replace("layers.*.attention.{q,k}_norm: {style: sequence_parallel, sequence_dim: 2}",
                        "layers.*.attention.q_norm: {style: sequence_parallel, sequence_dim: 2}")
    plan = tmp_path / "wrong.yaml"
    plan.write_text(text)
    report = dry_run(ApplyOptions(plan=str(plan), model="tpplan.titan_models:qwen3", tp=2))
    assert [(p.code, p.line) for p in report.problems] == [("TP502", 22)]
    assert "mixed torch.Tensor and DTensor" in report.problems[0].message
    assert Counter(p.code for p in report.problems)["TP507"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_llama4_with_whole_experts_passes_check_with_fewer_collectives_than_torchtitans_sharded_experts(tp):
    plan = PLANS / "llama4_tp.yaml"
    with torch.device("meta"):
        model = _model("llama4")
    assert [p.code for p in lint_model(load_plan(plan), model, [tp])] == ["TP360"]  # the experts stay whole: said, a warning
    report = dry_run(ApplyOptions(plan=str(plan), model="tpplan.titan_models:llama4", tp=tp, check=True))
    assert report.ok and report.check.passed, [str(p) for p in report.problems]
    # the MoE's replicated output needs no reduce-scatter forward, nor its replicated
    # router and experts an all-reduce of their input gradients backward
    assert report.comms == {"forward": {"all_gather": 6, "reduce_scatter": 3}, "backward": {"all_gather": 5, "reduce_scatter": 3}}
    assert torchtitan_comms("llama4", tp) == {
        "forward": {"all_gather": 6, "reduce_scatter": 5},
        "backward": {"all_gather": 5, "all_reduce": 6, "reduce_scatter": 3},
    }
