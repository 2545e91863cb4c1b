"""`tpplan init` (SPEC §4a): plans inferred from the traced data flow, proven, written.

Each inferred plan is proven the way a user checks a plan: `tpplan apply --dry-run
--check` on the file written, at its degrees. The default suite runs a transformers
family (compared with transformers' own plan), a fused ViT, the models with nothing
to shard and those that do not build, and `--from`; the other models with no plan
anywhere, tpplan's shipped plans and sequence parallelism run under `-m slow`
(tests/test_init_sweep.py sweeps the transformers families).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("no_process_group_leaks")


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})


def init_json(tmp_path: Path, model: str, *args: str) -> tuple[dict, Path]:
    out = tmp_path / "plan.yaml"
    result = run("init", "--model", model, "--format", "json", "-o", str(out), *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def check_written(plan: Path, model: str, degree: int, *extra: str) -> dict:
    """`tpplan apply --dry-run --check` on the written file, as a user runs it."""
    result = run("apply", "--dry-run", "--check", "--tp", str(degree), "--plan", str(plan), "--model", model,
                 "--format", "json", *extra)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["check"]["passed"], report
    return report


def rules_of(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)["rules"] or {}


def backward_collectives(comms: dict) -> int:
    return sum(comms.get("backward", {}).values())


def test_hf_llama_plan_is_proven_and_costs_no_more_than_transformers_plan(tmp_path):
    pytest.importorskip("transformers")
    model = "tpplan.models.hf_any:llama"
    report, plan = init_json(tmp_path, model, "--tp", "4")
    assert set(report) >= {"plan", "degrees", "compare", "dropped"}
    rules = rules_of(report["plan"])
    # inferred from the data flow: q/k/v -> o_proj and gate/up -> down_proj pairs, the
    # vocabulary-parallel embedding and the gathered head, one shared input per parent
    assert rules["model.layers.*.self_attn.{q_proj,k_proj,v_proj}"] == "colwise"
    assert rules["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert rules["model.layers.*.mlp.{gate_proj,up_proj}"] == "colwise"
    assert rules["model.layers.*.mlp.down_proj"] == "rowwise"
    assert rules["model.embed_tokens"]["style"] == "rowwise"
    assert rules["lm_head"] == {"style": "colwise", "output_layouts": "replicate"}
    assert rules["model.layers.*.self_attn"]["style"] == "prepare_module_input"
    assert "# q_proj, k_proj, v_proj -> o_proj: 8 heads of 8, 4 KV heads" in report["plan"]
    assert report["plan"].startswith("# yaml-language-server: $schema=")
    assert report["dropped"] == []
    ours, theirs = report["degrees"]["4"], report["compare"]["transformers"]["4"]
    assert ours["check"]["passed"] and theirs["check"] is None  # the compared plan: bytes and collectives only
    assert ours["rank_bytes"] <= theirs["rank_bytes"]
    assert backward_collectives(ours["comms"]) < backward_collectives(theirs["comms"])
    assert ours["rank_bytes"] / ours["total_bytes"] <= 0.30
    # 2 layers: forward one all-reduce per attention and MLP, plus the embedding; backward one
    # per parent's shared input, plus the head's input
    assert report["degrees"]["4"]["comms"] == {"forward": {"all_reduce": 5, "all_gather": 1}, "backward": {"all_reduce": 5}}
    assert plan.read_text() == report["plan"]
    assert run("validate", str(plan)).exit_code == 0
    check_written(plan, model, 4)


def test_fused_projections_are_sharded_packed_never_plain_colwise():
    from tpplan import infer_plan
    import zoo

    plan = infer_plan(zoo.vit, tp=[2])
    rules = rules_of(plan.text)
    assert rules["cells.*.mix.together"] == {"style": "colwise", "packed": 3}  # (b, n, 3, heads, head_dim)
    assert rules["cells.*.mix.back"] == "rowwise"
    assert rules["cells.*.ff.rise"] == "colwise" and rules["cells.*.ff.fall"] == "rowwise"
    assert plan.mesh_sizes == [2]


def test_a_fused_projection_viewed_heads_first_splits_by_its_heads_not_its_blocks():
    from tpplan.init.dataflow import _head_split

    # bloom's and persimmon's query_key_value: (..., heads 8, 3, head_dim 8), then indexed [..., 0, :] (cutting the 3)
    assert _head_split((2, 5, 192), [(2, 5, 8, 3, 8)], lambda: 3) == (8, 8)
    # a ViT's (..., 3, heads 8, head_dim 8), unbound on the 3: blocks first, as when nothing cuts it
    assert _head_split((2, 5, 192), [(2, 5, 3, 8, 8)], lambda: 3) == (8, 8)
    assert _head_split((2, 5, 192), [(2, 5, 3, 8, 8)], lambda: None) == (8, 8)
    assert _head_split((2, 5, 96), [(2, 5, 4, 3, 8)], lambda: 3) == (4, 8)
    assert _head_split((2, 5, 96), [(2, 5, 3, 4, 8)], lambda: 3) == (4, 8)


def test_a_model_with_nothing_to_shard_gets_an_empty_plan_with_the_reasons(tmp_path):
    out = tmp_path / "plan.yaml"
    result = run("init", "--model", "zoo:convnet", "--inputs", "zoo:convnet_inputs",  # tests/zoo.py
                 "--tp", "2", "-o", str(out))
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "rules: {}" in text
    assert "#   stem: Conv1d: no column or row split of it is proven" in text
    assert "nothing could be sharded" in result.output


def test_a_model_that_does_not_build_is_tp500(tmp_path, monkeypatch):
    module = tmp_path / "broken_model.py"
    module.write_text("def build():\n    raise RuntimeError('no such layer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("init", "--model", "broken_model:build")
    assert result.exit_code == 1
    assert "TP500" in result.output and "no such layer" in result.output
    assert "Traceback" not in result.output


def test_from_applies_the_fixes_the_lint_is_sure_of(tmp_path):
    hand = tmp_path / "hand.yaml"
    hand.write_text(
        "version: 1\nmesh: {axis: tp, sizes: [2]}\nrules:\n"
        "  blocks.*.attn.qkv: colwise\n  blocks.*.attn.proj: rowwise\n"
        "  blocks.*.mlp.gate_up: colwise\n  blocks.*.mlp.down: rowwise\n"
    )
    model = "tpplan.models.fused:tiny"
    assert run("apply", "--dry-run", "--check", "--plan", str(hand), "--model", model).exit_code == 1  # wrong values
    out = tmp_path / "fixed.yaml"
    result = run("init", "--model", model, "--from", str(hand), "-o", str(out))
    assert result.exit_code == 0, result.output
    rules = rules_of(out.read_text())
    assert rules["blocks.*.attn.qkv"] == {"style": "colwise", "packed": 3}
    assert rules["blocks.*.mlp.gate_up"] == {"style": "colwise", "packed": 2}
    assert rules["blocks.*.attn.proj"] == "rowwise"  # the user's rules stay as written
    assert "TP326 blocks.*.attn.qkv" in out.read_text()
    assert "nothing could be sharded" not in result.output  # the report's word on the fixed plan, not on inferred groups
    check_written(out, model, 2)


def test_from_gives_a_shared_expert_its_input_once_where_its_block_must_keep_it_plain(tmp_path):
    """The experts run before the shared expert (tests/shared_expert_moe.py, as Qwen3-Next): the block's
    router takes its input plain, so TP340's fix goes on the shared expert, whose gate_proj and up_proj
    then all-reduce that input's gradient once a block, not twice; the values still match one device."""
    hand = tmp_path / "hand.yaml"
    hand.write_text(
        "version: 1\nmesh: {axis: tp, sizes: [2]}\nrules:\n"
        "  blocks.*.experts: {style: expert_tp, params: {w1: shard(2), w2: shard(1)}}\n"
        "  blocks.*.shared_expert.{gate_proj,up_proj}: colwise\n  blocks.*.shared_expert.down_proj: rowwise\n"
    )
    model = "shared_expert_moe:build"
    out = tmp_path / "fixed.yaml"
    result = run("init", "--model", model, "--from", str(hand), "-o", str(out))
    assert result.exit_code == 0, result.output
    rules = rules_of(out.read_text())
    assert rules["blocks.*.shared_expert"] == {"style": "prepare_module_input", "input_layouts": "replicate",
                                              "desired_input_layouts": "replicate", "use_local_output": False}
    assert "blocks.*" not in rules  # the block itself keeps its input plain (its router takes it)
    before = check_written(hand, model, 2)["comms"]["backward"]["all_reduce"]
    assert check_written(out, model, 2)["comms"]["backward"]["all_reduce"] == before - 2  # one saved in each of the 2 blocks


def test_a_residual_mlp_stack_gets_column_row_pairs_not_an_output_head(tmp_path):
    """The last out_proj's output is the model's output summed into the residual stream (the
    model's input): a pair's row half, not a head. Without --tp, the degrees that divide the
    128 hidden features; at each, the bytes per rank of the shipped 2-rule plan."""
    shipped = str(ROOT / "plans" / "mlp_tp.yaml")
    report, plan = init_json(tmp_path, "tpplan.models.mlp:tiny", "--compare", shipped)
    assert rules_of(report["plan"]) == {"blocks.*.in_proj": "colwise", "blocks.*.out_proj": "rowwise"}
    assert list(report["degrees"]) == ["2", "4", "8"] and report["warnings"] == []
    for degree, share in (("2", 0.50), ("4", 0.25)):
        ours, theirs = report["degrees"][degree], report["compare"][shipped][degree]
        assert ours["rank_bytes"] == theirs["rank_bytes"] and ours["comms"] == theirs["comms"]
        assert round(ours["rank_bytes"] / ours["total_bytes"], 2) == share


def test_a_degree_that_shards_almost_nothing_is_warned_and_a_failing_compared_plan_is_one_short_row(tmp_path, capfd):
    """--tp 3 on 128 hidden features: the plan is written (exit 0) with a warning naming the
    share, the sizes 3 does not divide and the degrees that divide them. The shipped plan,
    compared at TP 3, fails its dry run: one row saying what and where (its own file and
    line), and none of torch's log of the failing fake kernel."""
    shipped = str(ROOT / "plans" / "mlp_tp.yaml")
    warned = ("TP 3 shards 0% of the parameters, where TP 2, 4, 8 shard 98%: 3 does not divide the sizes of "
              "blocks.*: in_proj -> out_proj (128)")
    report, _ = init_json(tmp_path, "tpplan.models.mlp:tiny", "--tp", "3")
    assert report["warnings"] == [warned] and list(report["degrees"]) == ["3"]
    capfd.readouterr()
    result = run("init", "--model", "tpplan.models.mlp:tiny", "--tp", "3", "--compare", shipped, "-o", str(tmp_path / "p.yaml"))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"warning: {warned}" in lines
    assert (f"  {shipped} per-rank params 22.09 KiB of 65.25 KiB (0.34); dry run FAILED: TP502 at {shipped}:15 "
            "(rule 'blocks.*.out_proj'): the forward of 'blocks.0.out_proj' (Linear, input (2, 8, 43)) fails at TP 3") in lines
    captured = capfd.readouterr()
    assert "fake_tensor" not in captured.out + captured.err and "Traceback" not in captured.out + captured.err + result.output


def test_from_a_plan_without_degrees_checks_it_at_the_degrees_init_would_pick(tmp_path):
    hand = tmp_path / "hand.yaml"
    hand.write_text("version: 1\nrules: {}\n")
    result = run("init", "--model", "sink_attention:build", "--from", str(hand), "--format", "json")
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)["degrees"]) == ["2", "4"]  # those that divide its 4 heads, not 8


def test_tp_takes_whole_numbers():
    result = run("init", "--model", "tpplan.models.mlp:tiny", "--tp", "two")
    assert result.exit_code == 2
    assert "--tp takes degrees" in result.output


# -- slow: models with no plan anywhere, the shipped plans, sequence parallelism ------------


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("mlp_stack", {"rows.*.fan_out": "colwise", "rows.*.fan_in": "rowwise"}),
    ("custom_attention", {"turns.*.look.{ask,key,val}": "colwise", "turns.*.look.tell": "rowwise",
                          "turns.*.think.{gate,fan_out}": "colwise", "turns.*.think.squeeze": "rowwise"}),
    # heads laid out head_dim-major: a contiguous shard is no whole heads; --check fails the
    # attention pair, which is tried again gathered (weights sharded, attention on whole
    # activations) and passes; the MLP stays sharded
    ("custom_attention_strided", {"turns.*.look.{ask,key,val}": {"style": "colwise", "output_layouts": "replicate"},
                                  "turns.*.look.tell": {"style": "rowwise", "input_layouts": "replicate"},
                                  "turns.*.think.{gate,fan_out}": "colwise", "turns.*.think.squeeze": "rowwise"}),
    # the selective scan mixes the step size with the whole inner state: only the head shards
    ("mamba", {"unembed": {"style": "colwise", "output_layouts": "replicate"}}),
])
def test_models_with_no_plan_anywhere(tmp_path, name, expected):
    model = f"zoo:{name}"  # tests/zoo.py
    report, plan = init_json(tmp_path, model, "--tp", "2", "--tp", "4")
    rules = rules_of(report["plan"])
    for key, value in expected.items():
        assert rules[key] == value, report["plan"]
    if name == "custom_attention_strided":
        assert report["dropped"] == [] and "ask, key, val -> tell: 8 heads of 8; gathered between them" in report["plan"]
    for degree in (2, 4):
        check_written(plan, model, degree)


@pytest.mark.slow
@pytest.mark.parametrize("model, shipped", [
    ("tpplan.models.llama:tiny", "llama_tp.yaml"),
    ("tpplan.models.mlp:tiny", "mlp_tp.yaml"),
    ("tpplan.models.fused:tiny", None),
])
def test_init_reproduces_or_beats_the_shipped_plans_collectives(tmp_path, model, shipped):
    args = ["--tp", "2", "--tp", "4"] + (["--compare", str(ROOT / "plans" / shipped)] if shipped else [])
    report, plan = init_json(tmp_path, model, *args)
    for degree in ("2", "4"):
        ours = report["degrees"][degree]
        assert ours["check"]["passed"]
        if shipped:
            theirs = report["compare"][str(ROOT / "plans" / shipped)][degree]
            assert backward_collectives(ours["comms"]) <= backward_collectives(theirs["comms"])
            assert sum(ours["comms"]["forward"].values()) <= sum(theirs["comms"]["forward"].values())
            assert ours["rank_bytes"] <= theirs["rank_bytes"]


@pytest.mark.slow  # 15-40 s a family on the shared machine: init's proof at TP 2 and 4 with --check
@pytest.mark.parametrize("family, pairs", [
    # transformers' Conv1D (weight [in, out]); c_attn's global split_size (.split(embed_dim)) needs whole activations
    ("gpt2", {"transformer.h.*.attn.c_attn": {"style": "colwise", "output_layouts": "replicate"},
              "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}),
    ("openai-gpt", {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}),
    # query_key_value viewed (heads, 3, head_dim) with the global head count and, in bloom, an alibi [batch * heads]:
    # whole heads per rank, activations whole between the pair
    ("bloom", {"transformer.h.*.self_attention.query_key_value": {"style": "colwise", "output_layouts": "replicate"}}),
    ("persimmon", {"model.layers.*.self_attn.query_key_value": {"style": "colwise", "output_layouts": "replicate"}}),
    # JetMoE's stacked expert Linears [E, out, in], in its MoE and its mixture of attention (with kv_proj); the MoE's
    # gate/up chunk and the attention's global hidden size need whole activations between the halves
    ("jetmoe", {"model.layers.*.mlp.input_linear": {"style": "colwise", "output_layouts": "replicate"},
                "model.layers.*.mlp.output_linear": {"style": "rowwise", "input_layouts": "replicate"},
                "model.layers.*.self_attention.experts.input_linear": {"style": "colwise", "output_layouts": "replicate"},
                "model.layers.*.self_attention.kv_proj": {"style": "colwise", "output_layouts": "replicate"}}),
])
def test_conv1d_stacked_and_heads_first_fused_families_hold_under_a_third_per_rank_at_tp_4(family, pairs):
    from tpplan.models.hf_any import build
    from tpplan.init import run_init

    inferred = run_init(lambda: build(family), ref=f"tpplan.models.hf_any:{family.replace('-', '_')}", tp=[2, 4])
    rules = rules_of(inferred.text)
    for key, value in pairs.items():
        assert rules[key] == value, inferred.text
    results = inferred.proven.results
    assert inferred.proven.dropped == []
    assert all(results[d].check["passed"] for d in (2, 4))
    assert results[4].rank_bytes / results[4].total_bytes < 0.3


@pytest.mark.slow
def test_sequence_parallel_gathers_once_per_parent(tmp_path):
    model = "tpplan.models.llama:tiny"
    report, plan = init_json(tmp_path, model, "--tp", "2", "--sp", "--compare", str(ROOT / "plans" / "llama_tp_sp.yaml"))
    rules = rules_of(report["plan"])
    assert rules["layers.*.{attention_norm,ffn_norm}"] == "sequence_parallel"
    ours = report["degrees"]["2"]["comms"]
    theirs = report["compare"][str(ROOT / "plans" / "llama_tp_sp.yaml")]["2"]["comms"]
    assert ours == theirs, (ours, theirs)
    check_written(plan, model, 2)


@pytest.mark.slow
def test_moe_experts_found_by_shape(tmp_path):
    pytest.importorskip("transformers")
    model = "tpplan.models.hf_any:qwen3_moe"
    report, plan = init_json(tmp_path, model, "--tp", "2")
    rules = rules_of(report["plan"])
    assert rules["model.layers.*.mlp.experts"] == "expert_tp"
    report_ep, _ = init_json(tmp_path, model, "--tp", "2", "--ep")
    assert rules_of(report_ep["plan"])["model.layers.*.mlp.experts"] == {"style": "expert_parallel", "dispatch": "all_reduce"}
    check_written(plan, model, 2)


class _LatentAttention(__import__("torch").nn.Module):
    """MLA as DeepSeek V3 writes it, small: a latent kv projection whose last `rope`
    features (the rotary key) bypass kv_b and meet every head whole, written into the key
    with in-place copies into slices of a new tensor (transformers' `expand_kv`)."""

    def __init__(self, vocab=64, dim=32, heads=4, nope=8, rope=4, latent=16):
        from torch import nn

        super().__init__()
        self.heads, self.nope, self.rope, self.latent = heads, nope, rope, latent
        self.embed = nn.Embedding(vocab, dim)
        self.q_proj = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.kv_a = nn.Linear(dim, latent + rope, bias=False)
        self.kv_norm = nn.RMSNorm(latent)
        self.kv_b = nn.Linear(latent, heads * (nope + nope), bias=False)
        self.o_proj = nn.Linear(heads * nope, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        import torch

        x = self.embed(ids)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        latent, k_rot = torch.split(self.kv_a(x), [self.latent, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.nope).transpose(1, 2)
        k_pass, v = torch.split(kv, [self.nope, self.nope], dim=-1)
        k_rot = k_rot.view(b, 1, s, self.rope).expand(-1, k_pass.shape[1], -1, -1)
        k = k_pass.new_empty(b, k_pass.shape[1], s, self.nope + self.rope)
        k[..., : self.nope].copy_(k_pass)  # as transformers' DeepseekV3Attention.expand_kv writes it
        k[..., self.nope:].copy_(k_rot)
        weights = torch.softmax(q @ k.transpose(-2, -1) / (self.nope + self.rope) ** 0.5, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, s, -1)
        return self.head(x + self.o_proj(out))


@pytest.mark.slow  # 20 s on the shared CI machine: dry runs with --check
def test_mla_rotary_key_gets_its_gradient_summed_on_its_last_features_only():
    # kv_a's output reaches kv_b (colwise: its input gradient summed by torch) and, through
    # the in-place writes into the key, the heads of o_proj as it is: only that tail is summed
    from tpplan import infer_plan

    plan = infer_plan(_LatentAttention, tp=[2])
    rules = rules_of(plan.text)
    assert rules["{q_proj,kv_b}"] == "colwise" and rules["o_proj"] == "rowwise"
    assert rules["kv_a"] == {"style": "sum_output_grad", "last": 4}
    assert "# Dropped" not in plan.text
    assert "kv_a whole, its last 4 of 20 output features meeting the heads whole: that gradient summed" in plan.text


def test_a_per_head_parameter_is_sharded_with_the_heads_not_gathered():
    """Attention sinks (tests/sink_attention.py: a (heads,) parameter added to the scores):
    the sharded q/k/v -> o pair needs them laid out with the heads; the lint's edit does it
    (merged into TP340's prepare_module_input on the same module) and the proof's --check
    compares every gradient, the sinks' shards included, with one device's."""
    from sink_attention import build

    from tpplan import infer_plan

    plan = infer_plan(build, tp=[2])
    rules = rules_of(plan.text)
    assert rules["blocks.*"] == {"style": "local_params", "input_layouts": "replicate", "desired_input_layouts": "replicate",
                                 "use_local_output": False, "params": {"sinks": "shard(0)"}}
    assert rules["blocks.*.{q_proj,k_proj,v_proj}"] == "colwise" and rules["blocks.*.o_proj"] == "rowwise"
    assert "sinks sharded on dim 0, as the local shard of 'blocks.*.q_proj' it meets: each rank holds its own part (TP322)" in plan.text
    assert "# Dropped" not in plan.text and "gathered between them" not in plan.text and "# Not checked" not in plan.text


def test_a_head_whose_vocabulary_a_degree_does_not_divide_is_split_evenly_where_it_can_be(tmp_path):
    """A vocabulary the degree does not divide (transformers' Inkling 2: 200058 at TP 4): where
    the degrees divide the head's inputs, it is split on them (rowwise, as transformers' Inkling 2
    plan does: even bytes per rank); where they do not, its columns split unevenly (DTensor's
    uneven shards, gathered). The proof's --check at that degree keeps either."""
    from tpplan import infer_plan
    from tpplan.models.llama import LlamaConfig, Transformer

    plan = infer_plan(lambda: Transformer(LlamaConfig(vocab_size=258)), tp=[4])
    assert rules_of(plan.text)["output"] == {"style": "rowwise", "input_layouts": "replicate"}
    assert "# output: the output head, split on its 128 inputs (a degree does not divide its 258 columns)" in plan.text
    assert "# Not checked" not in plan.text  # (the embedding's 258 rows do not split at TP 4: dropped, whole)
    plan = infer_plan(lambda: Transformer(LlamaConfig(vocab_size=259)), tp=[3])  # 3 divides neither 259 nor 128
    assert rules_of(plan.text)["output"] == {"style": "colwise", "output_layouts": "replicate"}
    assert "# Not checked" not in plan.text  # proven with values, at 87+86+86 columns (torch.chunk's cut)


def test_a_model_with_its_own_plan_keeps_to_it_where_it_leaves_modules_whole_unless_shard_more(tmp_path):
    """transformers' Youtu-LLM plan shards the MLPs and leaves the MLA attention whole (DeepSeek-V3's did
    up to transformers 5.24; from 5.25 it shards the attention too, Youtu's still does not): init
    finds the attention pair (and the rotary key's summed gradient), but sharding it runs more
    backward collectives than the shipped plan, so by default init keeps to that trade: no more
    bytes per rank and no more backward collectives than the shipped plan; --shard-more shards
    it too: fewer bytes, more backward all-reduces. (Llama, whose plan init beats on both, gets
    all it proves: test_hf_llama_plan_is_proven_and_costs_no_more_than_transformers_plan.)"""
    pytest.importorskip("transformers")
    model = "tpplan.models.hf_any:youtu"
    kept, _ = init_json(tmp_path, model, "--tp", "2")
    more, more_plan = init_json(tmp_path, model, "--tp", "2", "--shard-more")
    ours, theirs, wider = kept["degrees"]["2"], kept["compare"]["transformers"]["2"], more["degrees"]["2"]
    assert not any("self_attn" in key for key in rules_of(kept["plan"]))
    assert "#   model.layers.*.self_attn.o_proj: transformers' plan leaves it whole: sharding all init proves runs 9 backward " \
           "collectives at TP 2 where that plan runs 5 (--shard-more shards it)" in kept["plan"]
    assert rules_of(more["plan"])["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert ours["rank_bytes"] <= theirs["rank_bytes"] and backward_collectives(ours["comms"]) <= backward_collectives(theirs["comms"])
    assert wider["rank_bytes"] < ours["rank_bytes"]
    assert backward_collectives(wider["comms"]) > backward_collectives(ours["comms"])
    check_written(more_plan, model, 2)
