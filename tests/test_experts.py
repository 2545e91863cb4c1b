"""MoE experts (expert_tp, expert_parallel), KV heads fewer than the TP degree
(colwise with `heads`) and replicated parameters inside sharded regions
(local_params, TP325), simulated in one process: outputs and every parameter
gradient equal one device, exact collective counts, per-rank parameter bytes.
"""

from __future__ import annotations

import functools
import json
from fractions import Fraction
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from expected import llama_comms  # noqa: E402
from tpplan import load_plan  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.models import llama  # noqa: E402
from tpplan.simulation.simulate import simulated_world, tp_mesh  # noqa: E402
from tpplan.check.verify import check_parity  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans" / "hf"
L = hf_models.TINY["num_hidden_layers"]  # 2

# Per MoE layer, expert_tp and expert_parallel (dispatch all_reduce) each add one forward
# all-reduce (the experts' partial output) and two backward all-reduces (the partial input
# gradients of the hidden states and of the routing weights); attention adds one of each
# (o_proj forward, its shared input backward). Plus the vocab-parallel embedding's
# all-reduce and the head's all-gather forward, the head's input all-reduce backward.
# Replicated KV-head and q_norm/k_norm/sinks gradients stay partial until the optimizer
# (as norm weights under sequence parallelism), so they add nothing here.
MOE = {"forward": {"all_gather": 1, "all_reduce": 2 * L + 1}, "backward": {"all_reduce": 3 * L + 1}}

NEW_PLANS = [
    ("qwen3_moe_tp.yaml", "qwen3_moe"),
    ("qwen3_moe_ep.yaml", "qwen3_moe"),
    ("mixtral_tp.yaml", "mixtral"),
    ("mixtral_ep.yaml", "mixtral"),
    ("gpt_oss_tp.yaml", "gpt_oss"),
    ("gpt_oss_ep.yaml", "gpt_oss"),
]


def _assert_parity(result):
    assert result.passed, result.problems
    assert result.max_abs_diff < 1e-4


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("plan_file, family", NEW_PLANS, ids=[p for p, _ in NEW_PLANS])
def test_moe_plan_matches_single_device_with_one_all_reduce_per_expert_layer(plan_file, family, tp):
    plan = load_plan(PLANS / plan_file)
    assert tp in plan.mesh_sizes
    result = check_parity(hf_models.FACTORIES[family], plan, tp)
    _assert_parity(result)
    assert result.comms == MOE


def _bytes(plan, build, tp):
    """(total, per rank) bytes of all parameters and of the experts' (rank 0's shard)."""
    from torch.distributed.tensor import DTensor

    import torch

    with simulated_world(tp), torch.device("meta"):
        model = build()
        plan.apply(model, tp_mesh(tp))
        sizes = {}
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            sizes[name] = (param.numel() * param.element_size(), local.numel() * local.element_size())
    experts = [v for k, v in sizes.items() if ".experts." in k]
    return (
        sum(t for t, _ in sizes.values()),
        sum(r for _, r in sizes.values()),
        sum(t for t, _ in experts),
        sum(r for _, r in experts),
    )


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("plan_file, family", NEW_PLANS, ids=[p for p, _ in NEW_PLANS])
def test_every_expert_parameter_is_split_over_the_degree(plan_file, family, tp):
    total, per_rank, experts, experts_per_rank = _bytes(load_plan(PLANS / plan_file), hf_models.FACTORIES[family], tp)
    model = hf_models.FACTORIES[family]()
    if family == "gpt_oss" and plan_file.endswith("_tp.yaml"):
        # down_proj_bias [E, H] is added after the reduction, once: whole on every rank.
        whole = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("experts.down_proj_bias"))
        assert experts_per_rank == (experts - whole) // tp + whole
    else:
        assert Fraction(experts_per_rank, experts) == Fraction(1, tp)
    # Everything else is sharded too, but norms, routers and rowwise biases (small).
    whole = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if "norm" in n or ".gate." in n or ".router." in n or n.endswith("o_proj.bias") or n.endswith("down_proj_bias")
    )
    if plan_file.endswith("_ep.yaml"):
        whole -= sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("experts.down_proj_bias"))
    assert per_rank == (total - whole) // tp + whole


def test_qwen2_moe_plans_shard_the_routed_experts():
    for plan_file in ("qwen2_moe_tp.yaml", "qwen2_moe_tp_sp.yaml"):
        _, _, experts, experts_per_rank = _bytes(load_plan(PLANS / plan_file), hf_models.qwen2_moe, 2)
        assert Fraction(experts_per_rank, experts) == Fraction(1, 2)


@pytest.mark.parametrize("family, nproc", [pytest.param("qwen3_moe", 4, marks=pytest.mark.slow), ("gpt_oss", 2)])
def test_all_reduce_dispatch_computes_each_routed_pair_once_and_matches_one_device_on_real_ranks(family, nproc):
    from test_torchrun import torchrun

    result = torchrun(nproc, "tests/ep_all_reduce_worker.py", family, pythonpath=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert max(report["diffs"].values()) < 1e-5, report["diffs"]
    # Each rank's experts compute exactly the pairs routed to them: T*k rows over the
    # ranks (not T*E, every local expert on every token), ragged, one rank maybe none.
    assert report["rows"] == report["routed"] and sum(report["rows"]) == report["tokens"] * report["top_k"]
    assert len(set(report["rows"])) > 1
    assert report["forward"] == {"all_reduce": 1} and report["backward"] == {"all_reduce": 2}


def test_under_local_tensor_mode_every_rank_computes_its_largest_experts_share_padded_with_weight_0():
    import torch
    from torch.distributed._local_tensor import LocalTensorMode

    from tpplan.sharding.expert_dispatch import route_local

    index = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1]])  # expert 0: 3 pairs, 1: 3, 2: 1, 3: 1
    weights = torch.full((4, 2), 0.5)
    with simulated_world(2):
        rows, expert, weight, token = route_local(torch.randn(4, 8), index, weights, tp_mesh(2), 4)
        assert token.tolist() == [0, 1, 2, 0, 2, 3]  # rank 0: experts 0 and 1's pairs, token order
        assert expert.squeeze(-1).tolist() == [0, 0, 0, 1, 1, 1] and rows.shape == (6, 8)
        with LocalTensorMode(2):
            rows, expert, weight, token = route_local(torch.randn(4, 8), index, weights, tp_mesh(2), 4)
            # one program for both ranks: 3 rows per local expert (rank 0's most), rank 1's
            # 1 + 1 routed rows padded to 3 + 3 with weight 0
            assert rows.shape == (6, 8) and expert.squeeze(-1).tolist() == [0, 0, 0, 1, 1, 1]
            per_rank = {r: w.squeeze(-1).tolist() for r, w in weight._local_tensors.items()}
    assert per_rank == {0: [0.5] * 6, 1: [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]}


def test_sharding_leaves_no_style_state_on_the_models_modules():
    import torch

    with simulated_world(2), torch.device("meta"):
        model = hf_models.qwen3_moe()
        load_plan(PLANS / "qwen3_moe_ep.yaml").apply(model, tp_mesh(2))
    with simulated_world(8), torch.device("meta"):
        kv = hf_models.llama_kv2()  # 2 KV heads at TP 8: replicated, the attention's groups set
        load_plan(PLANS / "llama_tp.yaml").apply(kv, tp_mesh(8))
    for module in (*model.modules(), *kv.modules()):
        assert not [key for key in vars(module) if key.startswith("_tpplan")], type(module).__name__
    assert model.model.layers[0].mlp.experts.num_experts == 4  # the model's count outside a forward


def test_expert_tp_reduce_scatters_its_output_when_asked_for_a_token_shard():
    """output_layouts shard(0) (tokens): one reduce-scatter forward instead of the all-reduce."""
    import copy

    import torch
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.sharding.experts import ExpertTensorParallel

    torch.manual_seed(0)
    reference = hf_models.mixtral().model.layers[0].mlp.experts
    experts = copy.deepcopy(reference)
    x, index, weights = torch.randn(8, 64), torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
    want = reference(x, index, weights)
    with simulated_world(2), LocalTensorMode(2):
        mesh = tp_mesh(2)
        parallelize_module(experts, mesh, ExpertTensorParallel(output_layouts=Shard(0), use_local_output=False))
        inputs = [DTensor.from_local(t, mesh, (Replicate(),)) for t in (x, index, weights)]
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as comms:
            got = experts(*inputs)
        counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comms.get_comm_counts().items()}
        assert got.placements == (Shard(0),)
        full = got.full_tensor()
    assert counts == {"reduce_scatter_tensor": 1}
    for rank in (0, 1):
        torch.testing.assert_close(full._local_tensors[rank], want, rtol=1e-4, atol=1e-5)


def test_expert_tp_gives_each_rank_matching_gate_and_up_halves():
    import torch
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.sharding.experts import ExpertTensorParallel

    experts = hf_models.qwen3_moe().model.layers[0].mlp.experts
    full = experts.gate_up_proj.detach().clone()
    inter = full.shape[1] // 2
    with simulated_world(4), LocalTensorMode(4):
        parallelize_module(experts, tp_mesh(4), ExpertTensorParallel())
        local = experts.gate_up_proj.to_local()._local_tensors
    chunk = inter // 4
    for rank in range(4):
        gate, up = full[:, rank * chunk:(rank + 1) * chunk], full[:, inter + rank * chunk:inter + (rank + 1) * chunk]
        torch.testing.assert_close(local[rank], torch.cat([gate, up], dim=1), rtol=0, atol=0)


# -- KV heads fewer than the degree --------------------------------------------------------

TP_COUNTS = llama_comms("llama_tp.yaml", L)
TP_SP_COUNTS = llama_comms("llama_tp_sp.yaml", L)


@pytest.mark.parametrize(
    "plan_file, tp, counts",
    [("llama_tp.yaml", 4, TP_COUNTS), ("llama_tp.yaml", 8, TP_COUNTS), ("llama_tp_sp.yaml", 8, TP_SP_COUNTS)],
)
def test_transformers_model_with_two_kv_heads_at_degrees_above_them(plan_file, tp, counts):
    result = check_parity(hf_models.llama_kv2, load_plan(PLANS / plan_file), tp)
    _assert_parity(result)
    assert result.comms == counts  # replicating KV heads costs no collective in the step


@pytest.mark.parametrize("tp", [4, 8])
def test_torchtitan_model_with_two_kv_heads_at_degrees_above_them(tp):
    build = functools.partial(llama.Transformer, llama.LlamaConfig(n_kv_heads=2))
    result = check_parity(build, load_plan(ROOT / "plans" / "llama_tp.yaml"), tp)
    _assert_parity(result)
    assert result.comms == TP_COUNTS


def test_qwen3_plan_at_twice_its_kv_heads():
    result = check_parity(hf_models.qwen3, load_plan(PLANS / "qwen3_tp.yaml"), 8)
    _assert_parity(result)
    assert result.comms == TP_COUNTS


def test_each_rank_holds_its_kv_head_and_attention_repeats_by_the_local_ratio():
    from torch.distributed.tensor import Replicate, Shard

    with simulated_world(8):
        import torch

        with torch.device("meta"):
            model = hf_models.llama_kv2()
        load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(8))
        attention = model.model.layers[0].self_attn
        k = attention.k_proj.weight
        assert (k.device_mesh.mesh.tolist(), k.placements) == ([[0, 1, 2, 3], [4, 5, 6, 7]], (Shard(0), Replicate()))
        assert tuple(k.to_local().shape) == (8, 64)  # one head of 8 on each rank
        assert attention.num_key_value_groups == 1  # 8 / 8 query heads per rank, one KV head
        assert tuple(attention.q_proj.weight.to_local().shape) == (8, 64)


def test_colwise_heads_at_a_degree_that_divides_them_is_torch_colwise():
    from torch.distributed.tensor import Shard

    import torch

    with simulated_world(2), torch.device("meta"):
        model = hf_models.llama_kv2()
        load_plan(PLANS / "llama_tp.yaml").apply(model, tp_mesh(2))
        attention = model.model.layers[0].self_attn
        assert attention.k_proj.weight.placements == (Shard(0),)
        assert attention.num_key_value_groups == 4  # untouched


def test_head_divisibility_offers_replicated_kv_heads_as_the_fix():
    from lint_helpers import lint

    text = (
        "version: 1\nrules:\n"
        "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n"
        "  model.layers.*.self_attn.o_proj: rowwise\n"
    )
    problems = [p for p in lint(text, "tpplan.models.hf:llama_kv2", tp=[4]) if p.code == "TP311"]
    assert problems and "{style: colwise, heads: auto}" in problems[0].message
    fixed = text.replace("colwise\n", "{style: colwise, heads: auto}\n", 1)
    assert [p for p in lint(fixed, "tpplan.models.hf:llama_kv2", tp=[4, 8]) if p.severity == "error"] == []


# -- replicated parameters on sharded activations ---------------------------------------


@pytest.fixture(scope="module")
def apertus_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("apertus")
    hf_models.apertus().config.save_pretrained(path)
    return path


def test_partial_gradients_of_apertus_xielu_are_found_and_fixed_by_import_minimal(apertus_config):
    from lint_helpers import lint

    from tpplan.hf.importer import import_hf

    imported = import_hf(apertus_config)
    flagged = [p for p in lint(imported.text, "tpplan.models.hf:apertus", tp=[2]) if p.code == "TP325"]
    assert len(flagged) == 1 and "'model.layers.*.mlp.act_fn: local_params'" in flagged[0].message
    assert "'alpha_p', 'alpha_n'" in flagged[0].message
    # transformers' own plan: outputs match, the xIELU parameters' gradients do not.
    wrong = check_parity(hf_models.apertus, load_plan(text=imported.text), 2)
    assert not wrong.passed and all("act_fn.alpha" in p for p in wrong.problems if "grad" in p)
    from tpplan.lint.fixes import added_rules

    minimal = import_hf(apertus_config, minimal=True, lint_fixes=added_rules)
    assert "  model.layers.*.mlp.act_fn: local_params\n" in minimal.text
    assert [p for p in lint(minimal.text, "tpplan.models.hf:apertus", tp=[2]) if p.code == "TP325"] == []
    _assert_parity(check_parity(hf_models.apertus, load_plan(text=minimal.text), 2))


# -- import-hf ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_moe_families_import_with_every_expert_parameter_sharded(family):
    from tpplan.hf.importer import import_hf

    imported = import_hf(family)
    assert "  model.layers.*.mlp.experts: expert_tp\n" in imported.text
    # Nothing of the experts is skipped (Qwen's dense-MLP keys match no module of an all-sparse config).
    assert [s.key for s in imported.skipped if "experts" in s.key] == []
    assert {key for key, _ in imported.added} >= {"model.layers.*.mlp.experts"}


def test_imported_moe_plan_matches_single_device(tmp_path):
    from tpplan.hf.importer import import_hf

    hf_models.mixtral().config.save_pretrained(tmp_path)
    imported = import_hf(tmp_path)
    result = check_parity(hf_models.mixtral, load_plan(text=imported.text), 2)
    _assert_parity(result)
    # transformers' plan: q/k/v all-reduce their input gradients one by one.
    assert result.comms == {"forward": {"all_gather": 1, "all_reduce": 2 * L}, "backward": {"all_reduce": 5 * L + 1}}


def test_import_ep_takes_the_expert_parallel_plan_over_the_tp_plan():
    from tpplan.hf.importer import import_hf

    imported = import_hf("qwen3_moe", ep=True)
    assert "  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_reduce}\n" in imported.text
    assert "  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise\n" in imported.text  # TP for the rest
    assert "name: qwen3-moe-hf-ep" in imported.text
    assert [s.key for s in imported.skipped if "experts" in s.key] == []
    with pytest.raises(ValueError, match="no expert-parallel plan"):
        import_hf("llama", ep=True)


def test_expert_tp_tells_undecorated_transposed_experts_by_their_shapes():
    # Llama 4's experts ([E, H, 2I] and [E, I, H]) carry no `is_transposed`: sharding them as
    # [E, 2I, H] split the hidden dim and broke the forward (import-hf's plan for llama4)
    import copy

    import torch
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.models.hf_any import tiny_config
    from tpplan.sharding.experts import ExpertTensorParallel, expert_tp_defaults
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    torch.manual_seed(0)
    experts = Llama4TextExperts(tiny_config("llama4_text"))  # gate_up (4, 64, 256), down (4, 128, 64)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    placements = expert_tp_defaults(experts)
    assert (placements["gate_up_proj"].dim, placements["gate_up_proj"].split_factor) == (2, 2)
    assert placements["down_proj"] == Shard(1)
    tokens = torch.randn(4 * 3, 64)  # 3 tokens per expert, sorted by expert
    expected = experts(tokens)
    with simulated_world(2), LocalTensorMode(2):
        sharded = copy.deepcopy(experts)
        parallelize_module(sharded, tp_mesh(2), ExpertTensorParallel(output_layouts=Replicate()))
        out = sharded(tokens)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
