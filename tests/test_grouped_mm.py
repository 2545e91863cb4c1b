"""A float32 MoE above the values limit (hf.grouped_mm): transformers' experts call
`aten::_grouped_mm` in float32, which the real CPU and CUDA kernels take and torch's
meta function refused (bfloat16 only), so meta and fake tensors could not run the
model and the ladder could not climb to values. The meta kernel agrees with the
real one; the dry run and init then run on fake tensors, with the collectives a
run with real values makes.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tpplan.hf.grouped_mm import accept_real_dtypes

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

OFFS = [3, 7, 10]
ALIGNED = ((10, 16), ((10, 8), (3, 8, 16)))  # the output's shape, and the gradients' of mat_a and mat_b
# (mat_a, mat_b, transposed, what float32/float16/bfloat16 give): transformers passes
# its [E, out, in] weights transposed; a row of 6 is not a multiple of 16 bytes
LAYOUTS = [((10, 8), (3, 8, 16), False, ALIGNED), ((10, 8), (3, 16, 8), True, ALIGNED),
           ((10, 8), (3, 8, 6), False, "refused"), ((10, 6), (3, 6, 16), False, "refused"),
           ((10, 8), (3, 6, 8), True, "refused")]  # forward takes it, the backward's gradient rows do not


def _grouped_mm(device: str, dtype: torch.dtype, a_shape, b_shape, transposed: bool):
    """(output shape, (grad a, grad b) shapes), or "refused" (the messages differ: torch's
    meta function words its checks its own way)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(a_shape, generator=generator).to(dtype).to(device).requires_grad_()
    b = torch.randn(b_shape, generator=generator).to(dtype).to(device)
    b = (b.transpose(-2, -1) if transposed else b).detach().requires_grad_()
    try:
        out = torch.nn.functional.grouped_mm(a, b, offs=torch.tensor(OFFS, dtype=torch.int32, device=device))
        grads = torch.autograd.grad(out, (a, b), torch.ones(out.shape, dtype=dtype, device=device))
    except RuntimeError:
        return "refused"
    return tuple(out.shape), tuple(tuple(g.shape) for g in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}x{layout[1]}{'T' if layout[2] else ''}")
def test_meta_grouped_mm_takes_and_refuses_what_the_real_cpu_kernel_does(dtype, layout):
    accept_real_dtypes()
    *shapes, want = layout
    real = _grouped_mm("cpu", dtype, *shapes)
    assert real == (want if dtype != torch.float64 else "refused")
    assert _grouped_mm("meta", dtype, *shapes) == real


def test_torchs_own_meta_function_refused_float32():
    """What the kernel is for: without it, torch's meta function wants bfloat16."""
    from torch._meta_registrations import meta_grouped_mm

    a, b = torch.empty(10, 8, device="meta"), torch.empty(3, 8, 16, device="meta")
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        meta_grouped_mm(a, b, offs=torch.empty(3, dtype=torch.int32, device="meta"))


OLMOE_PLAN = """\
version: 1
rules:
  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: {style: colwise, output_layouts: replicate}
  model.layers.*.self_attn.o_proj: {style: rowwise, input_layouts: replicate}
  model.layers.*.mlp.experts: expert_tp
  lm_head: {style: colwise, output_layouts: replicate}
"""


# transformers' imported plan for OLMoE at TP 2, 2 layers: forward, per layer 3 gathered
# q/k/v and 2 all-reduces (o_proj, experts), and lm_head's gather; backward, per layer
# 5 all-reduces (the replicated inputs of q/k/v, experts) and o_proj's gather, and the embedding's input
OLMOE_COMMS = {"forward": {"all_gather": 7, "all_reduce": 4}, "backward": {"all_gather": 2, "all_reduce": 11}}


def _olmoe_dry_run(tmp_path, monkeypatch):
    from tpplan.simulation import simulate
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    (tmp_path / "p.yaml").write_text(OLMOE_PLAN)
    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    return dry_run(ApplyOptions(plan=str(tmp_path / "p.yaml"), model="tpplan.models.hf_any:olmoe", tp=2))


def test_a_float32_moe_above_the_values_limit_is_dry_run_on_fake_tensors(tmp_path, monkeypatch):
    """transformers' imported plan for OLMoE (its experts: grouped_mm in float32), on a
    model above the (lowered) values limit: fake tensors run it (before, TP502: the
    fake forward failed and the retry with values was refused)."""
    pytest.importorskip("transformers")
    report = _olmoe_dry_run(tmp_path, monkeypatch)
    assert report.ok, report.problems
    assert (report.device, report.notes) == ("fake", [])
    assert report.comms == OLMOE_COMMS


@pytest.mark.slow
def test_the_fake_run_counts_the_collectives_of_real_values(tmp_path, monkeypatch):
    """Faithful: one rank's real values (the CPU kernel computes grouped_mm) under the
    fake process group make the collectives the fake run counts."""
    pytest.importorskip("transformers")
    from tpplan.core.loader import load_plan
    from tpplan.models.hf_any import olmoe
    from tpplan.simulation import simulate

    report = _olmoe_dry_run(tmp_path, monkeypatch)
    with simulate.simulated_world(2):
        torch.manual_seed(0)
        model = olmoe()
        assert model.config._experts_implementation == "grouped_mm"
        load_plan(tmp_path / "p.yaml").apply(model, simulate.tp_mesh(2))
        real = simulate.count_collectives(model, simulate.default_inputs(model))
    assert real == report.comms == OLMOE_COMMS


def test_init_infers_a_float32_moe_above_the_values_limit(monkeypatch):
    """Before: TP329, the forward fails on meta and fake tensors and values are refused."""
    pytest.importorskip("transformers")
    from tpplan.models.hf_any import olmoe
    from tpplan.init import run_init
    from tpplan.simulation import simulate

    monkeypatch.setattr(simulate, "VALUES_LIMIT_BYTES", 1024)
    inferred = run_init(olmoe, ref="tpplan.models.hf_any:olmoe", tp=[2])
    assert not inferred.checked
    rules = yaml.safe_load(inferred.text)["rules"]
    assert rules["model.layers.*.mlp.experts"] == "expert_tp"
    # OLMoE's q_norm/k_norm normalize the whole projection: the attention pair is gathered between
    # its halves (transformers' colwise_gather_output / rowwise_split_input for OLMoE)
    assert rules["model.layers.*.self_attn.o_proj"] == {"style": "rowwise", "input_layouts": "replicate"}
    # 2 layers: q, k, v gathered (6) and the head (1); o_proj, experts (2 each) and the embedding summed
    assert inferred.proven.results[2].to_json()["comms"] == {"forward": {"all_gather": 7, "all_reduce": 5},
                                                             "backward": {"all_gather": 2, "all_reduce": 11}}
