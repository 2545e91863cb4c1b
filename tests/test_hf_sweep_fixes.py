"""What the causal-LM sweep (tests/test_hf_sweep.py) found wrong in tpplan, each fixed
and held here on a small model: the collective counter on a module called twice, a
local_params rule naming a parameter its module lacks, import-hf's per-head attention
sinks (transformers' local_params + a colwise parameter entry) and MLA's rotary key
(transformers' mla_kv_a_proj: sum_output_grad)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch import nn

from tpplan import load_plan
from tpplan.lint.fixes import added_rules

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


class _SharedActivation(nn.Module):
    """One activation module called twice in one forward, as a loop over experts does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.lin(x)) + self.act(x)


def test_collectives_are_counted_on_a_module_called_twice_in_one_forward():
    # torch's CommDebugMode tracker raised IndexError at the second call, and left hooks behind
    from tpplan.simulation.simulate import count_collectives

    model = _SharedActivation()
    for _ in range(2):  # a second forward on the same model: no hook left from the first
        assert count_collectives(model, torch.randn(2, 4, requires_grad=True)) == {"forward": {}, "backward": {}}
    assert not model.act._forward_hooks and not model.lin._forward_hooks


def test_local_params_naming_a_parameter_its_module_lacks_is_tp501_at_its_rule(tmp_path):
    from tpplan.core.problems import PlanError
    from tpplan.simulation.locate import apply_located
    from tpplan.simulation.simulate import simulated_world, tp_mesh

    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n  lin: colwise\n  act: {style: local_params, params: {sinks: shard(0)}}\n")
    with simulated_world(2), pytest.raises(PlanError) as raised:
        apply_located(load_plan(path), _SharedActivation(), tp_mesh(2))
    (problem,) = raised.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP501", 4, 3)
    assert "local_params: SiLU has no parameter 'sinks' (its own parameters: none)" in problem.message


def _imported(tmp_path, model_type: str, minimal: bool = False) -> str:
    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import tiny_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_config(model_type).save_pretrained(tmp_path)
        return import_hf(tmp_path, minimal=minimal, lint_fixes=added_rules).text


def test_attention_sinks_are_sharded_by_local_params_on_the_modules_that_own_them(tmp_path):
    from tpplan.models.hf_any import build
    from tpplan.lint.checks import check_model

    text = _imported(tmp_path, "granite_swa")
    # transformers: "layers.*.self_attn": "local_params" + "layers.*.self_attn.sinks": "colwise"
    assert "  model.layers.*.self_attn: {style: local_params, params: {sinks: shard(0)}}\n" in text
    assert "left out" not in text.lower() and "#   model.layers.*.self_attn: lays out sinks (colwise) as shard(0)" in text
    (tmp_path / "hf.yaml").write_text(text)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("granite_swa")
    # the layout flow follows the sharded sinks: `lse - sinks` is shard against shard (TP322 before)
    assert [p for p in check_model(load_plan(tmp_path / "hf.yaml"), model, [2]) if p.severity == "error"] == []
    # MiMo-V2-Flash: sinks on its sliding-window layer only; --minimal's shared input leaves that one alone
    mimo = _imported(tmp_path / "mimo", "mimo_v2_flash", minimal=True)
    assert "  model.layers.1.self_attn: {style: local_params, params: {sinks: shard(0)}}\n" in mimo
    rules = mimo.split("\nrules:\n", 1)[1]
    assert "  model.layers.0.self_attn: {style: prepare_module_input," in rules and "model.layers.*.self_attn:" not in rules


def test_mla_rotary_key_gradient_is_summed_as_transformers_does(tmp_path):
    from tpplan.core.aliases import suggestion
    from tpplan.models.hf_any import build
    from tpplan.hf.transformers_runtime import apply_transformers_plan
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.torchrun import ApplyOptions
    from tpplan.check.verify import check_parity

    from tpplan.hf.config import load_config
    from tpplan.hf.importer import causal_lm_class, experts_only_in_ep_plan

    text = _imported(tmp_path, "glm4_moe_lite")
    assert "  model.layers.*.self_attn.kv_a_proj_with_mqa: {style: sum_output_grad, last: 8}\n" in text  # qk_rope_head_dim
    # transformers' TP runtime leaves whole the experts it plans for expert parallelism only (all of them from
    # 5.25), to which the import gives expert_tp: compared without it; with it, its one layer of experts
    # (the first is dense) costs one forward and two backward all-reduces
    config = load_config(tmp_path)
    whole = experts_only_in_ep_plan(config, causal_lm_class(config))
    for key in whole:
        text = text.replace(f"  {key}: expert_tp\n", "")
    moe = 0 if whole else 1
    (tmp_path / "hf.yaml").write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = dry_run(ApplyOptions(plan=str(tmp_path / "hf.yaml"), model="tpplan.models.hf_any:glm4_moe_lite", tp=2, check=True))
        theirs = check_parity(lambda: build("glm4_moe_lite"), apply_transformers_plan, 2)
    # outputs and every gradient as one device, replicas equal (TP506 on kv_a_proj_with_mqa without it)
    assert report.problems == [] and report.check.passed and theirs.passed
    # per layer one backward all-reduce of the rotary key, as transformers' _AllReduceBackward
    assert report.comms == theirs.comms == {"forward": {"all_gather": 1, "all_reduce": 3 + moe}, "backward": {"all_reduce": 9 + 2 * moe}}
    assert "write {style: sum_output_grad, last: N}" in suggestion("mla_kv_a_proj")


def test_sum_output_grad_sums_only_the_last_features_gradient():
    from torch.distributed.tensor import DTensor

    from tpplan.simulation.simulate import simulated_world, tp_mesh
    from tpplan.core.problems import StyleInputError
    from tpplan.sharding.grad_sum import SumOutputGrad

    with simulated_world(2):
        mesh = tp_mesh(2)
        model = nn.Linear(4, 6)
        model = SumOutputGrad(last=2)._apply(model, mesh)
        x = torch.randn(3, 4, requires_grad=True)
        out = model(x)
        assert not isinstance(out, DTensor) and torch.equal(out, nn.functional.linear(x, model.weight, model.bias))
        counts = Counter()
        from tpplan.simulation.simulate import _counting

        with _counting(counts):
            out.sum().backward()
        assert counts == {"all_reduce": 1}  # the last 2 features' gradient (a no-op sum under the fake group)
        with pytest.raises(StyleInputError, match="last: 7 is more than the 6 features"):
            SumOutputGrad(last=7)._apply(nn.Linear(4, 6), mesh)(x)
