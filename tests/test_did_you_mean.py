"""An unknown style that another tool spells so (torch's class names, transformers'
tp_plan strings) is answered with what a tpplan plan writes, at the style's value."""

from __future__ import annotations

import pytest

from tpplan import load_plan
from tpplan.core.aliases import TORCH_CLASSES, TRANSFORMERS_EQUIVALENTS, TRANSFORMERS_NO_RULE, TRANSFORMERS_WITHOUT_EQUIVALENT, flow
from tpplan.core.schema import STYLE_NAMES

STYLES = f" (styles: {', '.join(STYLE_NAMES)})"


def problem_of(plan_error, value: str):
    [problem] = plan_error(f"version: 1\nrules:\n  a: {value}\n").problems
    return problem


@pytest.mark.parametrize("torch_name, ours", list(TORCH_CLASSES.items()))
def test_torch_class_names_suggest_the_tpplan_style(plan_error, torch_name, ours):
    problem = problem_of(plan_error, torch_name)
    assert (problem.code, problem.line, problem.column) == ("TP103", 3, 6)
    assert problem.message == (
        f"unknown style '{torch_name}' in rule 'a'; did you mean '{ours}'? ('{torch_name}' is torch's class name for it)" + STYLES
    )


def test_colwise_parallel_no_longer_suggests_no_parallel(plan_error):
    # regression: difflib found 'no_parallel' closest to 'ColwiseParallel'
    assert "'no_parallel'" not in problem_of(plan_error, "ColwiseParallel").message.split(" (styles:")[0]


def test_torch_class_name_in_a_mapping_is_located_at_the_style_value(plan_error):
    text = "version: 1\nrules:\n  a:\n    style: RowwiseParallel\n    output_layouts: shard(1)\n"
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP103", 4, 12)
    assert problem.message.startswith("unknown style 'RowwiseParallel' in rule 'a'; did you mean 'rowwise'? ")


@pytest.mark.parametrize("spelling, ours", [("colwiseparallel", "colwise"), ("Sequence_Parallel", "sequence_parallel"), ("PREPAREMODULEINPUT", "prepare_module_input")])
def test_torch_names_in_another_case_or_with_underscores(plan_error, spelling, ours):
    assert f"; did you mean '{ours}'? " in problem_of(plan_error, spelling).message


@pytest.mark.parametrize(
    "hf_style, says",
    [
        ("colwise_rep", "'colwise_rep' is transformers' name for colwise with output_layouts: replicate: write {style: colwise, output_layouts: replicate}"),
        ("rowwise_rep", "'rowwise_rep' is transformers' name for rowwise with input_layouts: replicate: write {style: rowwise, input_layouts: replicate}"),
        ("colwise_gather_output", "'colwise_gather_output' is transformers' name for colwise with output_layouts: replicate: write {style: colwise, output_layouts: replicate}"),
        (
            "all_reduce",
            "'all_reduce' is transformers' name for prepare_module_output with output_layouts: partial, desired_output_layouts: replicate: "
            "write {style: prepare_module_output, output_layouts: partial, desired_output_layouts: replicate}",
        ),
        ("replicate", "'replicate' is transformers' style for full parameters on every rank, which every module no rule names keeps: "
                      "delete this rule (or write no_parallel for replicated DTensor parameters)"),
        ("local_colwise", "'local_colwise' is a transformers style with no tpplan equivalent: it runs the module on local shards outside "
                          "DTensor, which no torch style does (the closest is colwise: DTensor parameters, a local output)"),
        ("packed_colwise", "'packed_colwise' is a transformers style with no tpplan equivalent: it shards a fused [gate; up] weight "
                           "with a strided shard, which no torch style expresses (colwise would shard it contiguously, pairing one "
                           "rank's gate with another's up; in an experts module, expert_tp does it)"),
        # main's import-hf leaves the router unplanned (issue 10): no rule needed
        ("ep_router", "'ep_router' is transformers' style for a router left whole on every rank (expert_parallel's all_reduce "
                      "dispatch routes the replicated tokens on every rank), as every module no rule names keeps: delete this rule"),
        ("isolated", "'isolated' is a transformers style with no tpplan equivalent: it is expert parallelism, not tensor parallelism"),
        ("gather", "'gather' is a transformers style with no tpplan equivalent: it gathers a local output outside DTensor "
                   "(the closest is a colwise rule with output_layouts: replicate)"),
    ],
)
def test_transformers_strings_say_what_to_write(plan_error, hf_style, says):
    problem = problem_of(plan_error, hf_style)
    assert (problem.code, problem.line, problem.column) == ("TP103", 3, 6)
    assert problem.message == f"unknown style '{hf_style}' in rule 'a'; {says}" + STYLES


@pytest.mark.parametrize("hf_style, value", list(TRANSFORMERS_EQUIVALENTS.items()))
def test_what_the_message_says_to_write_loads(hf_style, value):
    [rule] = load_plan(text=f"version: 1\nrules:\n  a: {flow(value)}\n").rules
    assert rule.spec.style == (value["style"] if isinstance(value, dict) else value)


def test_the_tables_agree_with_what_import_hf_does():
    pytest.importorskip("transformers")
    from tpplan.hf.importer import SOUND_STYLES

    # a string tpplan also spells the same way (colwise, rowwise, sequence_parallel) is no unknown style
    assert {k: v for k, v in SOUND_STYLES.items() if k not in STYLE_NAMES} == TRANSFORMERS_EQUIVALENTS


def test_import_hf_leaves_an_entry_out_with_the_reason_did_you_mean_gives(tmp_path):
    """One table of transformers' strings: the reason import-hf writes for an entry it
    leaves out is the one a plan naming the string is told."""
    pytest.importorskip("transformers")
    import json

    from tpplan.core.aliases import suggestion
    from tpplan.hf.importer import import_hf

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
                                  "base_model_tp_plan": {"layers.*.self_attn.q_proj": "gather", "layers.*.mlp.gate_proj": "replicate"}}))
    imported = import_hf(config)
    reasons = {s.hf_style: s.reason for s in imported.skipped}
    assert suggestion("gather").endswith(reasons["gather"])
    what, _ = TRANSFORMERS_NO_RULE["replicate"]
    assert reasons["replicate"] == f"{what}: no rule needed" and what in suggestion("replicate")


@pytest.mark.parametrize(
    "word, ours",
    [
        ("column_parallel", "colwise"),  # difflib found 'no_parallel' closest
        ("column", "colwise"),  # difflib found nothing
        ("col_parallel", "colwise"),
        ("ColumnParallelLinear", "colwise"),  # Megatron's class
        ("row", "rowwise"),
        ("row_parallel", "rowwise"),  # difflib found 'no_parallel' closest
        ("RowParallelLinear", "rowwise"),
        ("replicated", "no_parallel"),  # difflib found nothing
        ("Replicate", "no_parallel"),  # torch's placement class
    ],
)
def test_other_words_for_a_style_suggest_it(plan_error, word, ours):
    problem = problem_of(plan_error, word)
    assert (problem.code, problem.line, problem.column) == ("TP103", 3, 6)
    assert problem.message == f"unknown style '{word}' in rule 'a'; did you mean '{ours}'?" + STYLES


def test_the_exact_names_of_other_tools_come_before_the_synonyms(plan_error):
    # 'col*' and 'replicate' would match these; their own answers are more exact
    assert "write {style: colwise, output_layouts: replicate}" in problem_of(plan_error, "colwise_rep").message
    assert "'replicate' is transformers' style for full parameters" in problem_of(plan_error, "replicate").message


def test_a_typo_still_gets_the_closest_style(plan_error):
    assert "; did you mean 'rowwise'? (styles:" in problem_of(plan_error, "rowwize").message
