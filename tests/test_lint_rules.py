"""Each model-aware lint rule: a plan it reports, at the exact rule position, with
value, relation and fix in the message; and the fixed plan it does not report.

Plans are inline; models are the reference models (built once on the meta
device) and a few small ones defined here. `select` runs one rule, so most tests
skip the (slower) dry run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lint_helpers import found, lint, meta_model, only
from torch import nn

LLAMA = "tpplan.models.llama:tiny"
MLP = "tpplan.models.mlp:tiny"

ATTENTION_PREPARED = """\
  layers.*.attention:
    style: prepare_module_input
    input_layouts: [replicate, null]
    desired_input_layouts: [replicate, null]
    use_local_output: false
"""


# -- small models for the cases the reference models do not have -----------------------


class ScaledNorm(nn.Module):
    """Has a parameter, and a forward that needs two positional inputs."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, scale):
        return x * self.weight * scale


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = ScaledNorm()
        self.pair = Pair()

    def forward(self, x):
        h = self.norm(self.proj(x), 2.0)
        a, b = self.pair(h)
        return a + b


class Pair(nn.Module):
    """Returns two outputs."""

    def forward(self, x):
        return x, x


class Gated(nn.Module):
    """Called with a non-tensor first input."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, flag, x):
        return self.proj(x) if flag is None else x


class GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.gated = Gated()

    def forward(self, x):
        return self.gated(None, self.inp(x))


class HFStyleAttention(nn.Module):
    """Head counts only on a transformers-style `config`: 6 heads, 2 KV heads of 4."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, head_dim=4, hidden_size=24)
        self.q_proj = nn.Linear(24, 24, bias=False)
        self.k_proj = nn.Linear(24, 8, bias=False)
        self.v_proj = nn.Linear(24, 8, bias=False)
        self.o_proj = nn.Linear(24, 24, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, 4).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, 4).transpose(1, 2).repeat_interleave(3, dim=1)
        v = self.v_proj(x).view(b, s, -1, 4).transpose(1, 2).repeat_interleave(3, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class HFStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 24)
        self.self_attn = HFStyleAttention()

    def forward(self, tokens):
        h = self.embed(tokens)
        return h + self.self_attn(h)


def built(cls):
    with torch.device("meta"):
        return cls()


@pytest.fixture(scope="module")
def two_inputs():
    return built(TwoInputs)


# -- TP300 style-module ------------------------------------------------------------------


def test_colwise_on_a_module_that_is_no_linear_is_an_error_at_its_rule():
    problems = lint("""
        version: 1
        rules:
          layers.*.attention.wo: rowwise
          layers.*.attention: colwise
    """, LLAMA, select=["TP300"])
    problem = only(problems, "TP300")
    assert (problem.severity, problem.line, problem.column) == ("error", 4, 3)
    assert ("colwise shards only nn.Linear, nn.Embedding, transformers' Conv1D and stacked expert Linears, "
            "but 'layers.0.attention' is an Attention") in problem.message
    assert "put colwise on the submodules it shards (wq, wk, wv, wo)" in problem.message
    assert problem.message.endswith("(and 1 more like it)")


def test_colwise_on_linears_is_not_reported():
    assert not lint("version: 1\nrules:\n  layers.*.attention.w{q,k,v}: colwise\n", LLAMA, select=["TP300"])


# -- TP301 / TP302 sequence_parallel on the wrong module ------------------------------------


def test_sequence_parallel_on_a_block_with_nested_parameters_is_an_error():
    problems = lint("version: 1\nrules:\n  layers.*.feed_forward: sequence_parallel\n", LLAMA, select=["TP301"])
    problem = only(problems, "TP301")
    assert (problem.line, problem.column) == (3, 3)
    assert "'layers.0.feed_forward' (FeedForward) holds 3 in submodules (w1.weight, w2.weight, w3.weight)" in problem.message
    assert "put sequence_parallel on the position-wise leaves" in problem.message


def test_sequence_parallel_on_a_norm_is_not_reported():
    assert not lint("version: 1\nrules:\n  layers.*.ffn_norm: sequence_parallel\n", LLAMA, select=["TP301", "TP302"])


def test_sequence_parallel_on_a_module_that_mixes_positions_is_a_warning():
    problems = lint("""
        version: 1
        rules:
          norm: sequence_parallel
          shift: sequence_parallel
    """, "tpplan.models.rule_examples:shift_mlp", select=["TP302"])
    problem = only(problems, "TP302")
    assert (problem.severity, problem.line, problem.column) == ("warning", 4, 3)
    assert "'shift' (TokenShift)" in problem.message and "gather the sequence before it" in problem.message


# -- TP303 / TP304 arity and keyword layouts ---------------------------------------------------


def test_input_layouts_for_fewer_inputs_than_the_call_passes_is_an_error():
    problems = lint("""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
    """, LLAMA, select=["TP303"])
    problem = only(problems, "TP303")
    assert (problem.line, problem.column) == (3, 3)
    assert "gives 1 input layout but 'layers.0.attention' is called with 2 positional inputs" in problem.message
    assert "give 2 entries" in problem.message


def test_input_layouts_for_more_inputs_than_forward_takes_is_an_error():
    problems = lint("""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [replicate, null, null]
            desired_input_layouts: [replicate, null, null]
    """, LLAMA, select=["TP303"])
    messages = [p.message for p in problems if p.code == "TP303"]
    assert found(problems, "TP303") == [(3, 3), (3, 3)]
    assert any("Attention.forward(x, rope) of 'layers.0.attention' takes at most 2 positional inputs" in m for m in messages)


def test_sequence_parallel_on_a_module_called_with_two_inputs_is_an_error(two_inputs):
    problem = only(lint("version: 1\nrules:\n  norm: sequence_parallel\n", two_inputs, select=["TP303"]), "TP303")
    assert (problem.line, problem.column) == (3, 3)
    assert "hands 'norm' only its first positional input, but it is called with 2 positional inputs" in problem.message
    assert "ScaledNorm.forward(x, scale)" in problem.message


def test_output_layouts_for_fewer_outputs_than_returned_is_an_error(two_inputs):
    problem = only(lint("""
        version: 1
        rules:
          pair: {style: prepare_module_output, output_layouts: replicate, desired_output_layouts: replicate}
    """, two_inputs, select=["TP303"]), "TP303")
    assert (problem.line, problem.column) == (3, 3)
    assert "gives 1 output layout but 'pair' returns 2 outputs" in problem.message


def test_no_parallel_on_a_module_whose_first_input_is_not_a_tensor_is_an_error():
    problem = only(lint("version: 1\nrules:\n  gated: no_parallel\n", built(GatedModel), select=["TP303"]), "TP303")
    assert (problem.line, problem.column) == (3, 3)
    assert "the first is not a tensor" in problem.message


def test_layouts_that_match_the_calls_are_not_reported():
    assert not lint("version: 1\nrules:\n" + ATTENTION_PREPARED, LLAMA, select=["TP303", "TP304"])


def test_a_keyword_layout_for_no_parameter_is_a_warning():
    problems = lint("""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_kwarg_layouts: {freqs: replicate}
            desired_input_kwarg_layouts: {freqs: replicate}
    """, LLAMA, select=["TP304"])
    problem = only(problems, "TP304")
    assert (problem.severity, problem.line, problem.column) == ("warning", 3, 3)
    assert "'freqs', but Attention.forward(x, rope) of 'layers.0.attention' has no such parameter" in problem.message


def test_a_keyword_layout_for_an_input_passed_positionally_is_a_warning():
    problem = only(lint("""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_kwarg_layouts: {rope: replicate}
            desired_input_kwarg_layouts: {rope: replicate}
    """, LLAMA, select=["TP304"]), "TP304")
    assert "never passes 'rope' to 'layers.0.attention' by keyword" in problem.message


# -- TP310 / TP311 divisibility ---------------------------------------------------------------------


def test_a_degree_that_does_not_divide_a_sharded_dim_is_a_warning_listing_degrees_that_work():
    problems = lint("""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """, MLP, tp=(3, 4), select=["TP310"])
    assert found(problems, "TP310") == [(3, 3), (4, 3)]
    first = problems[0].message
    assert first.startswith("tp (3) does not divide out_features (128) of 'blocks.0.in_proj' (colwise shards weight dim 0;")
    assert "ranks hold 43, 43, 42" in first and first.endswith("degrees that work: 1, 2, 4, 8, 16, 32, 64 (and 1 more like it)")
    assert "in_features (128) of 'blocks.0.out_proj'" in problems[1].message


def test_degrees_that_divide_every_sharded_dim_are_not_reported():
    assert not lint("version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n", MLP, tp=(2, 4, 8), select=["TP310"])


def test_a_degree_that_does_not_divide_the_heads_is_an_error_at_the_rule_that_splits_them():
    problems = lint("version: 1\nrules:\n" + ATTENTION_PREPARED + """\
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: rowwise
""", LLAMA, tp=(2, 3), select=["TP311", "TP310"])
    assert found(problems, "TP311") == [(8, 3), (9, 3)]
    assert not found(problems, "TP310")  # head splits are TP311's, once
    assert problems[0].message.startswith(
        "tp (3) must divide n_heads (16) and n_kv_heads (8) of 'layers.0.attention' "
        "(rule 'layers.*.attention.w{q,k,v}' at plan.yaml:8): colwise splits 'layers.0.attention.wq', "
        "'layers.0.attention.wk', 'layers.0.attention.wv' into heads of 8"
    )
    assert "degrees that work: 1, 2, 4, 8" in problems[0].message
    assert problems[1].message.startswith("tp (3) must divide n_heads (16) of 'layers.0.attention'")


def test_head_counts_are_read_from_a_transformers_style_config():
    problems = lint("version: 1\nrules:\n  self_attn.{q,k,v}_proj: colwise\n  self_attn.o_proj: rowwise\n",
                    built(HFStyle), tp=(2, 4), select=["TP311"])
    assert found(problems, "TP311") == [(3, 3), (4, 3)]
    assert ("tp (4) must divide num_attention_heads (6) and num_key_value_heads (2) of 'self_attn'" in problems[0].message)
    assert problems[0].message.endswith("degrees that work: 1, 2")


def test_degrees_that_divide_the_heads_are_not_reported():
    plan = "version: 1\nrules:\n" + ATTENTION_PREPARED + "  layers.*.attention.w{q,k,v}: colwise\n  layers.*.attention.wo: rowwise\n"
    assert not lint(plan, LLAMA, tp=(2, 4, 8), select=["TP311"])


# -- TP320-TP324 layout flow --------------------------------------------------------------------------


def test_a_rowwise_embedding_without_replicated_input_is_a_layout_mismatch():
    problem = only(lint("version: 1\nrules:\n  tok_embeddings: rowwise\n", LLAMA, select=["TP320"]), "TP320")
    assert (problem.line, problem.column) == (3, 3)
    assert "takes its input 0 (2, 8) as shard(-1) (torch's default), but it arrives replicated" in problem.message
    assert "give it input_layouts: replicate" in problem.message
    assert "a rowwise Embedding (vocabulary-parallel) takes token ids whole" in problem.message


def test_a_rowwise_linear_fed_replicated_activations_is_not_called_an_embedding():
    problems = lint("version: 1\nrules:\n  layers.*.feed_forward.w2: rowwise\n", LLAMA, select=["TP320"])
    assert found(problems, "TP320") == [(3, 3), (3, 3)]  # layers.0 and layers.1
    assert problems[0].message.endswith("computes on wrong data; declare input_layouts: replicate")
    assert not any("Embedding" in p.message for p in problems)


def test_a_sequence_parallel_norm_fed_replicated_activations_is_a_layout_mismatch():
    problems = lint("""
        version: 1
        rules:
          tok_embeddings: {style: rowwise, input_layouts: replicate}
          layers.*.attention_norm: sequence_parallel
    """, LLAMA, select=["TP320"])
    assert found(problems, "TP320") == [(4, 3)]
    assert ("arrives replicated from rowwise 'tok_embeddings' (rule 'tok_embeddings' at plan.yaml:3)" in problems[0].message)
    assert "give 'tok_embeddings' output_layouts: shard(1)" in problems[0].message


def test_a_colwise_shard_fed_to_a_colwise_expecting_replicated_input_is_a_layout_mismatch():
    problem = only(lint("""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: colwise
    """, MLP, select=["TP320"]), "TP320")
    assert (problem.line, problem.column) == (4, 3)
    assert "as replicate (torch's default), but it arrives as a local shard(-1) from colwise 'blocks.0.in_proj'" in problem.message
    assert "declare input_layouts: shard(-1)" in problem.message


def test_a_declared_shard_dim_the_tensor_does_not_have_asks_for_a_dim_in_range():
    problem = only(lint("version: 1\nrules:\n  blocks.*.in_proj: {style: colwise, input_layouts: shard(5)}\n", MLP, select=["TP320"]), "TP320")
    assert problem.message.endswith("takes its input 0 (2, 8, 32) as shard(5), but it arrives replicated: DTensor.from_local "
                                    "believes the declaration and computes on wrong data; it has 3 dims: pick a dim in range")
    problem = only(lint("version: 1\nrules:\n  blocks.*.in_proj: {style: colwise, input_layouts: shard(-3)}\n", MLP, select=["TP320"]), "TP320")
    assert "declare input_layouts: replicate" in problem.message  # -3 is in range for 3 dims


def test_a_consistent_plan_has_no_layout_findings():
    plan = "version: 1\nrules:\n  tok_embeddings: {style: rowwise, input_layouts: replicate}\n" + ATTENTION_PREPARED + """\
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: rowwise
  layers.*.feed_forward.w{1,3}: colwise
  layers.*.feed_forward.w2: rowwise
  output: {style: colwise, output_layouts: replicate}
"""
    assert not lint(plan, LLAMA, select=["TP320", "TP321", "TP322", "TP323", "TP324"])


def test_a_colwise_shard_reaching_an_unplanned_linear_is_a_leak_at_the_colwise_rule():
    problem = only(lint("version: 1\nrules:\n  blocks.*.in_proj: colwise\n", MLP, select=["TP321"]), "TP321")
    assert (problem.line, problem.column) == (3, 3)
    assert ("the local shard(-1) (2, 8, 128) that colwise 'blocks.0.in_proj' (rule 'blocks.*.in_proj' at plan.yaml:3) "
            "returns reaches 'blocks.0.out_proj' (Linear)") in problem.message
    assert "add a rule for 'blocks.*.out_proj' (rowwise" in problem.message


def test_a_colwise_shard_meeting_a_full_tensor_in_an_op_is_a_leak():
    problem = only(lint("version: 1\nrules:\n  layers.*.feed_forward.w1: colwise\n", LLAMA, select=["TP321"]), "TP321")
    assert "meets a tensor of full size in 'mul' inside 'layers.0.feed_forward'" in problem.message


def test_a_model_returning_a_local_shard_is_a_leak_at_the_rule_that_made_it():
    problem = only(lint("version: 1\nrules:\n  output: colwise\n", LLAMA, select=["TP321"]), "TP321")
    assert (problem.line, problem.column) == (3, 3)
    assert "is what the model returns" in problem.message and "output_layouts: replicate" in problem.message


SP_WITHOUT_FINAL_NORM = """\
version: 1
rules:
  tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
  layers.*.attention_norm: sequence_parallel
  layers.*.attention:
    style: prepare_module_input
    input_layouts: [shard(1), null]
    desired_input_layouts: [replicate, null]
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: {style: rowwise, output_layouts: shard(1)}
  layers.*.ffn_norm: sequence_parallel
  layers.*.feed_forward:
    style: prepare_module_input
    input_layouts: shard(1)
    desired_input_layouts: replicate
  layers.*.feed_forward.w{1,3}: colwise
  layers.*.feed_forward.w2: {style: rowwise, output_layouts: shard(1)}
  output: {style: colwise, input_layouts: shard(1), output_layouts: replicate}
"""


def test_a_sequence_shard_reaching_an_unplanned_norm_is_an_open_region():
    problem = only(lint(SP_WITHOUT_FINAL_NORM, LLAMA, select=["TP321", "TP322"]), "TP322")
    assert (problem.line, problem.column) == (17, 3)  # the last rule that produced the shard: w2
    assert "that rowwise 'layers.1.feed_forward.w2'" in problem.message and "reaches 'norm' (RMSNorm)" in problem.message
    assert "give 'norm' sequence_parallel" in problem.message


def test_a_closed_sequence_parallel_region_is_not_reported():
    closed = SP_WITHOUT_FINAL_NORM.replace("  output:", "  norm: sequence_parallel\n  output:")
    assert not lint(closed, LLAMA, select=["TP320", "TP321", "TP322", "TP323"])


def test_a_sequence_shard_meeting_the_replicated_residual_is_an_open_region():
    problem = only(lint("""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: {style: rowwise, output_layouts: shard(1)}
    """, MLP, select=["TP322"]), "TP322")
    assert (problem.line, problem.column) == (4, 3)
    assert "meets a tensor of full size in 'add' inside 'blocks.0'" in problem.message


SINKS_SHARDED_HEADS = """\
version: 1
rules:
  blocks.*.{q_proj,k_proj,v_proj}: colwise
  blocks.*.o_proj: rowwise
"""


@pytest.mark.parametrize("model, op", [("sink_attention:build", "add"), ("sink_attention:build_concat", "cat")])
def test_heads_meeting_a_per_head_parameter_of_their_module_name_local_params_for_it(tmp_path, model, op):
    """Attention sinks (tests/sink_attention.py): a (heads,) parameter of the attention module
    added to the scores (or appended to them, as gpt-oss does) meets 2 of the 4 heads at TP 2;
    sharded the same way it fits, and the fix says so where the sequence-parallel advice was."""
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    plan = tmp_path / "plan.yaml"
    plan.write_text(SINKS_SHARDED_HEADS)
    result = CliRunner().invoke(app, ["validate", str(plan), "--model", model, "--tp", "2"])
    assert result.exit_code == 1
    (line,) = [line for line in result.output.splitlines() if " TP322 " in line]
    assert line.startswith(f"{plan}:3:3: TP322 the local shard(1) (2, 4, 8, 8) that colwise 'blocks.0.q_proj'")
    assert f"meets a tensor of full size in '{op}' inside 'blocks.0'" in line
    assert ("that tensor comes straight from the parameter 'blocks.*.sinks' of the module it runs in, whose dim 0 is as "
            "long as the sharded dim (4): shard it the same way, give 'blocks.*' {style: local_params, params: "
            "{sinks: shard(0)}}") in line
    assert "sequence-parallel" not in line
    fixed = SINKS_SHARDED_HEADS + "  blocks.*: {style: local_params, params: {sinks: shard(0)}}\n"
    assert not [p for p in lint(fixed, model, select=["TP320", "TP321", "TP322", "TP323", "TP325", "TP328"])]


class _ScaledMLP(nn.Module):
    """A learned per-feature scale between the halves of a pair."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.scale)


class _ScaledLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mlp = nn.Embedding(32, 16), _ScaledMLP()

    def forward(self, ids):
        return self.mlp(self.embed(ids))


def test_features_meeting_a_per_feature_parameter_of_their_module_name_local_params_for_it():
    with torch.device("meta"):
        model = _ScaledLM()
    problem = only(lint("""
        version: 1
        rules:
          mlp.up: colwise
          mlp.down: rowwise
    """, model, select=["TP321"]), "TP321")
    assert (problem.line, problem.column) == (3, 3)
    assert "the local shard(-1) (2, 8, 64) that colwise 'mlp.up' (rule 'mlp.up' at plan.yaml:3) returns meets a tensor of " \
           "full size in 'mul' inside 'mlp'" in problem.message
    assert "give 'mlp' {style: local_params, params: {scale: shard(0)}}" in problem.message


def test_the_per_head_parameter_edit_turns_the_modules_rule_into_local_params_or_adds_to_it():
    from tpplan import load_plan
    from tpplan.lint.context import LintContext
    from tpplan.lint.edits import lint_edits

    def edits(extra: str, found=lint_edits):
        ctx = LintContext(load_plan(text=SINKS_SHARDED_HEADS + extra), meta_model("sink_attention:build"), [2])
        return [(e.code, e.key, e.options, e.add) for e in found(ctx) if e.code in ("TP322", "TP340")]

    sinks = {"style": "local_params", "params": {"sinks": "shard(0)"}}
    assert edits("", lambda ctx: lint_edits(ctx, ["TP322"])) == [("TP322", "blocks.0", sinks, True), ("TP322", "blocks.1", sinks, True)]
    # one new rule per module a round: TP340's prepare_module_input first, turned into local_params the next round
    assert [(code, key) for code, key, _, _ in edits("")] == [("TP340", "blocks.0"), ("TP340", "blocks.1")]
    prepared = "  blocks.*: {style: prepare_module_input, input_layouts: replicate, desired_input_layouts: replicate}\n"
    assert edits(prepared) == [("TP322", "blocks.*", sinks, False)]  # its input options stay (with_options)
    assert edits("  blocks.*: local_params\n") == [("TP322", "blocks.*", sinks, False)]
    assert edits("  blocks.*: {style: local_params, params: {sinks: shard(0)}}\n") == []


def test_a_dtensor_meeting_a_plain_tensor_is_an_error_at_the_rule_that_kept_it():
    problem = only(lint("""
        version: 1
        rules:
          layers.*.feed_forward.w1: {style: colwise, use_local_output: false}
          layers.*.feed_forward.w3: colwise
          layers.*.feed_forward.w2: rowwise
    """, LLAMA, select=["TP323"]), "TP323")
    assert (problem.line, problem.column) == (3, 3)
    assert ("hands on a DTensor (shard(-1) DTensor) that meets a plain tensor of shape (2, 8, 256) in 'mul' "
            "inside 'layers.0.feed_forward'") in problem.message
    assert "set use_local_output: true on that rule" in problem.message


def test_an_uneven_local_handoff_is_an_error_and_a_dtensor_handoff_is_not():
    uneven = "version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n"
    problem = only(lint(uneven, MLP, tp=(3, 4), select=["TP324"]), "TP324")
    assert (problem.line, problem.column) == (3, 3)
    assert problem.message.startswith(
        "at tp (3), colwise 'blocks.0.in_proj' (rule 'blocks.*.in_proj' at plan.yaml:3) hands its 128 features to "
        "'blocks.0.out_proj' as local shards of 43, 43, 42"
    )
    kept = uneven.replace("in_proj: colwise", "in_proj: {style: colwise, use_local_output: false}")
    assert not lint(kept, MLP, tp=(3,), select=["TP324"])


# -- TP329 / TP330 the model must run ------------------------------------------------------------------


def test_a_model_without_default_inputs_is_a_warning_that_flow_checks_were_skipped():
    problem = only(lint("version: 1\nrules:\n  proj: colwise\n", "tpplan.models.rule_examples:conv_first", select=["TP329"]), "TP329")
    assert (problem.severity, problem.line, problem.column) == ("warning", 2, 1)
    assert "'conv' is a Conv1d" in problem.message and "were skipped: layout flow (TP320-TP324)" in problem.message


def test_forward_code_that_assumes_global_heads_fails_the_dry_run_at_the_sharding_rule():
    problems = lint("""
        version: 1
        rules:
          attention.w{q,k,v}: colwise
          attention.wo: rowwise
    """, "tpplan.models.rule_examples:global_heads_lm", tp=(2,))
    assert not [p for p in problems if p.severity == "error" and p.code != "TP330"]
    problem = only(problems, "TP330")
    assert (problem.line, problem.column) == (3, 3)
    assert problem.message.startswith("at tp (2) the shape-level dry run fails: the forward of 'attention'")
    assert "shape '[2, 8, 4, 8]' is invalid" in problem.message


def test_the_dry_run_is_skipped_after_other_errors():
    problems = lint("version: 1\nrules:\n  tok_embeddings: rowwise\n", LLAMA, select=["TP320", "TP330"])
    assert [p.code for p in problems] == ["TP320"]


# -- TP340 communication -----------------------------------------------------------------------------------


def test_colwise_siblings_each_reducing_one_input_get_a_hint_with_the_fix_and_the_savings():
    problem = only(lint("""
        version: 1
        rules:
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
    """, LLAMA, select=["TP340"]), "TP340")
    assert (problem.severity, problem.line, problem.column) == ("warning", 3, 3)
    assert "each one all-reduces its gradient in backward: 3 times where one would do" in problem.message
    assert ("add 'layers.*.attention: {style: prepare_module_input, input_layouts: [replicate, null], "
            "desired_input_layouts: [replicate, null], use_local_output: false}'") in problem.message
    assert "save 2 all-reduces per call (4 all-reduces per forward-backward, over 2 calls)" in problem.message


def test_siblings_whose_common_parent_cannot_take_a_dtensor_get_the_fix_where_some_of_them_can():
    """Experts run before the shared expert (tests/shared_expert_moe.py): the experts and the shared
    expert's gate_proj and up_proj sum the block's input gradient each, but the block's router must
    get that input plain, so the fix goes on the shared expert, for its two projections only."""
    from tpplan import load_plan
    from tpplan.lint.context import LintContext
    from tpplan.lint.edits import lint_edits

    plan = ("version: 1\nrules:\n  blocks.*.experts: {style: expert_tp, params: {w1: shard(2), w2: shard(1)}}\n"
            "  blocks.*.shared_expert.{gate_proj,up_proj}: colwise\n  blocks.*.shared_expert.down_proj: rowwise\n")
    problem = only(lint(plan, "shared_expert_moe:build", select=["TP340"]), "TP340")
    assert "'blocks.0.experts', 'blocks.0.shared_expert.gate_proj', 'blocks.0.shared_expert.up_proj'" in problem.message
    edits = lint_edits(LintContext(load_plan(text=plan), meta_model("shared_expert_moe:build"), [2]), ["TP340"])
    prepare = {"style": "prepare_module_input", "input_layouts": "replicate", "desired_input_layouts": "replicate",
               "use_local_output": False}
    assert [(e.key, e.options, e.add, e.why) for e in edits] == [
        (f"blocks.{i}.shared_expert", prepare, True, "gate_proj, up_proj share one replicate DTensor input: one backward "
         "all-reduce, not 2") for i in (0, 1)]
    fixed = plan + "  blocks.*.shared_expert: {style: prepare_module_input, input_layouts: replicate, " \
                   "desired_input_layouts: replicate, use_local_output: false}\n"
    assert not lint(fixed, "shared_expert_moe:build", select=["TP340"])  # the experts alone are left to sum theirs


def test_siblings_sharing_one_dtensor_input_get_no_hint():
    plan = "version: 1\nrules:\n" + ATTENTION_PREPARED + "  layers.*.attention.w{q,k,v}: colwise\n  layers.*.attention.wo: rowwise\n"
    assert not lint(plan, LLAMA, select=["TP340"])


def test_a_prepare_rule_that_keeps_local_inputs_is_pointed_at():
    problem = only(lint("""
        version: 1
        rules:
          layers.*.feed_forward:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
            use_local_output: true
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: rowwise
    """, LLAMA, select=["TP340"]), "TP340")
    assert (problem.line, problem.column) == (8, 3)
    assert "set use_local_output: false on rule 'layers.*.feed_forward' at plan.yaml:3" in problem.message


# -- TP350 tied parameters, TP360 coverage --------------------------------------------------------------------


def test_tied_parameters_with_different_placements_are_an_error():
    problem = only(lint("""
        version: 1
        rules:
          embed: {style: colwise, output_layouts: replicate}
          head: {style: colwise, output_layouts: replicate}
    """, "tpplan.models.rule_examples:tied_lm", select=["TP350"]), "TP350")
    assert (problem.line, problem.column) == (4, 3)
    assert ("'embed.weight' becomes shard(1) (colwise, rule 'embed' at plan.yaml:3); 'head.weight' becomes shard(0) "
            "(colwise, rule 'head' at plan.yaml:4)") in problem.message


def test_tied_parameters_sharded_alike_or_left_alone_are_not_reported():
    model = "tpplan.models.rule_examples:tied_lm"
    alike = "version: 1\nrules:\n  embed: {style: rowwise, input_layouts: replicate}\n  head: {style: colwise, output_layouts: replicate}\n"
    assert not lint(alike, model, select=["TP350"])
    assert not lint("version: 1\nrules:\n  up: colwise\n  down: rowwise\n", model, select=["TP350"])


def test_one_tied_owner_left_plain_is_an_error_too():
    problem = only(lint("version: 1\nrules:\n  head: {style: colwise, output_layouts: replicate}\n",
                        "tpplan.models.rule_examples:tied_lm", select=["TP350"]), "TP350")
    assert "'embed.weight' stays a plain tensor (no rule)" in problem.message


def test_a_plan_that_leaves_most_parameters_whole_gets_a_coverage_warning_at_its_rules_key():
    problem = only(lint("""
        version: 1
        rules:
          blocks.0.in_proj: colwise
          blocks.0.out_proj: rowwise
    """, MLP, select=["TP360"]), "TP360")
    assert (problem.severity, problem.line, problem.column) == ("warning", 2, 1)
    assert problem.message.startswith("the plan shards 50% of the parameters (8.32 k of 16.7 k)")
    assert "Largest unsharded: blocks.*.in_proj.weight (4.1 k, 25%)" in problem.message


def test_a_plan_that_shards_the_big_parameters_has_no_coverage_warning():
    assert not lint("version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n", MLP, select=["TP360"])


# -- across rules ------------------------------------------------------------------------------------------------


def test_model_checks_still_run_when_a_rule_matches_nothing():
    problems = lint("version: 1\nrules:\n  blocks.*.in_prj: colwise\n  blocks.*.in_proj: colwise\n", MLP)
    assert found(problems, "TP200") == [(3, 3)]
    assert found(problems, "TP321") == [(4, 3)]  # the rest of the plan is still checked


def test_a_block_repeated_n_times_is_reported_once_with_a_count():
    deep = meta_model("tpplan.models.mlp:tiny")
    problem = only(lint("version: 1\nrules:\n  blocks.*.in_proj: colwise\n", deep, select=["TP321"]), "TP321")
    assert problem.message.endswith("(and 1 more like it)")
