"""The plan schema (SPEC section 2): keys, styles, options, placements, strict
types and the constructors' cross-field rules, each reported at the exact
line and column; and every style compiled to the torch object it names.
"""

from __future__ import annotations

import pytest

from tpplan import load_plan
from tpplan.core.placements import PlacementSpec, parse_placement
from tpplan.core.schema import STYLE_NAMES


def rule(options: str) -> str:
    """A one-rule plan; the rule value sits on line 3 from column 6."""
    return f"version: 1\nrules:\n  a: {options}\n"


def only_spec(text: str):
    [loaded] = load_plan(text=text).rules
    return loaded.spec


# -- unknown keys (TP100) -------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_closest(plan_error):
    error = plan_error("version: 1\nrule:\n  a: colwise\n")
    assert [(p.code, p.line, p.column) for p in error.problems] == [("TP102", 1, 1), ("TP100", 2, 1)]
    assert error.problems[0].message == "missing required key 'rules' at the top level"
    assert error.problems[1].message == "unknown key 'rule' at the top level; did you mean 'rules'?"


def test_unknown_key_without_a_close_match_has_no_suggestion(plan_error):
    [problem] = plan_error("version: 1\ncolour: red\nrules: {}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP100", 2, 1)
    assert problem.message == "unknown key 'colour' at the top level"


def test_unknown_mesh_key_suggests_the_closest(plan_error):
    [problem] = plan_error("version: 1\nmesh:\n  axes: tp\nrules: {}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP100", 3, 3)
    assert problem.message == "unknown key 'axes' in 'mesh'; did you mean 'axis'?"


def test_unknown_option_suggests_the_closest_and_lists_the_style_options(plan_error):
    [problem] = plan_error(rule("{style: colwise, output_layout: shard(0)}")).problems
    assert (problem.code, problem.line, problem.column) == ("TP100", 3, 23)
    assert problem.message == (
        "unknown key 'output_layout' in rule 'a'; did you mean 'output_layouts'? "
        "(options of colwise: input_layouts, output_layouts, use_local_output, heads, packed)"
    )


def test_option_of_another_style_is_unknown(plan_error):
    text = "version: 1\nrules:\n  a:\n    style: sequence_parallel\n    input_layouts: shard(1)\n"
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP100", 5, 5)
    assert "(options of sequence_parallel: sequence_dim, use_local_output)" in problem.message


# -- styles (TP103, TP102) -------------------------------------------------------------


def test_unknown_style_name_suggests_the_closest(plan_error):
    [problem] = plan_error(rule("colwize")).problems
    assert (problem.code, problem.line, problem.column) == ("TP103", 3, 6)
    assert problem.message.startswith("unknown style 'colwize' in rule 'a'; did you mean 'colwise'? (styles: colwise, rowwise, ")


def test_unknown_style_in_a_mapping_is_located_at_its_value(plan_error):
    [problem] = plan_error("version: 1\nrules:\n  a:\n    style: sequence_paralel\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP103", 4, 12)
    assert "did you mean 'sequence_parallel'?" in problem.message


def test_unknown_style_far_from_any_has_no_suggestion(plan_error):
    [problem] = plan_error(rule("fsdp")).problems
    assert (problem.code, problem.line, problem.column) == ("TP103", 3, 6)
    assert "did you mean" not in problem.message
    assert "(styles: " + ", ".join(STYLE_NAMES) + ")" in problem.message


def test_rule_without_style_is_an_error(plan_error):
    [problem] = plan_error(rule("{input_layouts: shard(1)}")).problems
    assert (problem.code, problem.line, problem.column) == ("TP102", 3, 6)
    assert problem.message.startswith("rule 'a' needs a 'style:' key (one of colwise, ")


@pytest.mark.parametrize("value, kind", [("[colwise, rowwise]", "list"), ("3", "number"), ("", "null")])
def test_rule_value_must_be_a_style_or_a_mapping(plan_error, value, kind):
    [problem] = plan_error(rule(value)).problems
    assert (problem.code, problem.line) == ("TP101", 3)
    assert problem.message == f"rule 'a' must be a style name or a mapping with 'style:', not {kind}"


# -- required keys and version (TP102, TP106) -------------------------------------------


def test_missing_version_is_an_error(plan_error):
    [problem] = plan_error("rules:\n  a: colwise\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP102", 1, 1)
    assert problem.message == "missing required key 'version' at the top level"


def test_missing_rules_is_an_error(plan_error):
    [problem] = plan_error("version: 1\nname: x\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP102", 1, 1)
    assert problem.message == "missing required key 'rules' at the top level"


@pytest.mark.parametrize("value, shown", [("3", "3"), ("0", "0"), ("'1'", "'1'"), ("true", "True"), ("1.0", "1.0"), ("null", "None"), ("2.0", "2.0")])
def test_only_versions_1_and_2_are_read(plan_error, value, shown):
    # true and 1.0 are equal to 1 in Python; a plan version is still the integer 1 or 2 (regression)
    [problem] = plan_error(f"version: {value}\nrules: {{}}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP106", 1, 10)
    assert problem.message == f"unsupported plan version {shown}: this tpplan reads 'version: 1' and 'version: 2'"


@pytest.mark.parametrize("value, kind", [("[]", "[]"), ("colwise", "'colwise'"), ("", "None")])
def test_rules_must_be_a_mapping(plan_error, value, kind):
    [problem] = plan_error(f"version: 1\nrules: {value}\n").problems
    assert (problem.code, problem.line) == ("TP101", 2)
    assert problem.message == f"'rules' at the top level: input should be a valid dictionary, got {kind}"


@pytest.mark.parametrize("key, kind", [("1", "number 1"), ("null", "null None"), ("true", "boolean True"), ("1.5", "number 1.5")])
def test_rule_keys_must_be_strings(plan_error, key, kind):
    # regression: a null or float key was reported at 'rules:' (or crashed) instead of at the key
    [problem] = plan_error(f"version: 1\nrules:\n  {key}: colwise\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP101", 3, 3)
    assert problem.message == f"rule keys are module-path globs (strings), not {kind}"


def test_keyword_argument_names_must_be_strings(plan_error):
    # regression: the message used to call them rule keys
    text = "version: 1\nrules:\n  a:\n    style: prepare_module_input\n    input_kwarg_layouts: {1: shard(1)}\n"
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP101", 5, 27)
    assert problem.message == "keys of 'input_kwarg_layouts' are argument names (strings), not number 1"


# -- placements (TP104) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("replicate", PlacementSpec("replicate")),
        ("Replicate", PlacementSpec("replicate")),
        ("shard(1)", PlacementSpec("shard", 1)),
        ("Shard(-1)", PlacementSpec("shard", -1)),
        ("SHARD( 2 )", PlacementSpec("shard", 2)),
        ("partial", PlacementSpec("partial", reduce_op="sum")),
        ("partial(sum)", PlacementSpec("partial", reduce_op="sum")),
        ("partial(avg)", PlacementSpec("partial", reduce_op="avg")),
        ("PARTIAL(max)", PlacementSpec("partial", reduce_op="max")),
        ("Partial(MIN)", PlacementSpec("partial", reduce_op="min")),
    ],
)
def test_placement_grammar_accepts(text, expected):
    assert only_spec(rule(f"{{style: colwise, output_layouts: '{text}'}}")).output_layouts == expected


@pytest.mark.parametrize(
    "value, phrase",
    [
        ("shard", "'shard' is not a placement: use replicate, shard(DIM), partial or partial(sum|avg|max|min)"),
        ("shard()", "'shard()' is not a placement"),
        ("shard(x)", "'shard(x)' is not a placement"),
        ("shard(1.5)", "'shard(1.5)' is not a placement"),
        ("sharded(1)", "'sharded(1)' is not a placement"),
        ("replicate(0)", "'replicate(0)' is not a placement"),
        ("partial()", "'partial()' is not a placement"),
        ("partial(prod)", "unknown reduce op 'prod' in 'partial(prod)': use one of sum, avg, max, min"),
        ("''", "'' is not a placement"),
        ("1", "a placement is a string (replicate, shard(DIM), partial or partial(sum|avg|max|min)), not int 1"),
        ("true", "not bool True"),
        ("[replicate]", "not list ['replicate']"),  # one placement here, not a list
    ],
)
def test_bad_placement_is_located_at_its_value(plan_error, value, phrase):
    [problem] = plan_error(rule(f"{{style: colwise, output_layouts: {value}}}")).problems
    assert (problem.code, problem.line, problem.column) == ("TP104", 3, 39)
    assert phrase in problem.message


def test_bad_placement_in_a_list_is_located_at_its_entry(plan_error):
    text = rule("{style: prepare_module_input, input_layouts: [shard(1), shard(one)], desired_input_layouts: [replicate, replicate]}")
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP104", 3, 62)
    assert "'shard(one)' is not a placement" in problem.message


def test_single_placement_is_accepted_where_a_list_is_expected():
    spec = only_spec(rule("{style: prepare_module_input, input_layouts: shard(1), desired_input_layouts: replicate}"))
    assert spec.input_layouts == [PlacementSpec("shard", 1)]
    assert spec.desired_input_layouts == [PlacementSpec("replicate")]


def test_null_in_a_layout_list_leaves_that_argument_alone():
    spec = only_spec(rule("{style: prepare_module_input, input_layouts: [shard(1), null], desired_input_layouts: [replicate, null]}"))
    assert spec.input_layouts == [PlacementSpec("shard", 1), None]
    assert spec.desired_input_layouts == [PlacementSpec("replicate"), None]


def test_null_single_layout_means_the_torch_default():
    assert only_spec(rule("{style: colwise, input_layouts: null}")).input_layouts is None


# -- strict types (TP101) ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, column, message",
    [
        (
            rule("{style: sequence_parallel, use_local_output: 'yes'}"),
            3, 51, "'use_local_output' in rule 'a': input should be a valid boolean, got 'yes'",
        ),
        (rule("{style: colwise, use_local_output: 1}"), 3, 41, "'use_local_output' in rule 'a': input should be a valid boolean, got 1"),
        (
            rule("{style: sequence_parallel, sequence_dim: '1'}"),
            3, 47, "'sequence_dim' in rule 'a': input should be a valid integer, got '1'",
        ),
        (rule("{style: sequence_parallel, sequence_dim: true}"), 3, 47, "'sequence_dim' in rule 'a': input should be a valid integer, got True"),
        ("version: 1\nloss_parallel: 'false'\nrules: {}\n", 2, 16, "'loss_parallel' at the top level: input should be a valid boolean, got 'false'"),
        ("version: 1\nname: 3\nrules: {}\n", 2, 7, "'name' at the top level: input should be a valid string, got 3"),
        ("version: 1\nmesh: {axis: 2}\nrules: {}\n", 2, 14, "'axis' in 'mesh': input should be a valid string, got 2"),
        ("version: 1\nmesh: tp\nrules: {}\n", 2, 7, "'mesh' at the top level: input should be a valid dictionary or instance of MeshSpec, got 'tp'"),
    ],
)
def test_types_are_strict(plan_error, text, line, column, message):
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column, problem.message) == ("TP101", line, column, message)


@pytest.mark.parametrize(
    "sizes, column, message",
    [
        ("[2, 0, 8]", 14, "'sizes[1]' in 'mesh': input should be greater than or equal to 1, got 0"),
        ("[-2]", 11, "'sizes[0]' in 'mesh': input should be greater than or equal to 1, got -2"),
        ("[2, '4']", 14, "'sizes[1]' in 'mesh': input should be a valid integer, got '4'"),
        ("8", 10, "'sizes' in 'mesh': input should be a valid list, got 8"),
    ],
)
def test_mesh_sizes_must_be_positive_integers(plan_error, sizes, column, message):
    [problem] = plan_error(f"version: 1\nmesh:\n  sizes: {sizes}\nrules: {{}}\n").problems
    assert (problem.code, problem.line, problem.column, problem.message) == ("TP101", 3, column, message)


def test_mesh_defaults_to_axis_tp_and_no_promised_sizes():
    plan = load_plan(text="version: 1\nrules: {}\n")
    assert (plan.mesh_axis, plan.mesh_sizes, plan.src_data_rank, plan.loss_parallel) == ("tp", None, 0, False)


@pytest.mark.parametrize("value, expected", [("null", None), ("~", None), ("0", 0), ("3", 3)])
def test_src_data_rank_may_be_null_or_a_rank(value, expected):
    assert load_plan(text=f"version: 1\nsrc_data_rank: {value}\nrules: {{}}\n").src_data_rank == expected


@pytest.mark.parametrize("value, got", [("-1", "-1"), ("'0'", "'0'")])
def test_src_data_rank_rejects_negatives_and_strings(plan_error, value, got):
    [problem] = plan_error(f"version: 1\nsrc_data_rank: {value}\nrules: {{}}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP101", 2, 16)
    assert problem.message.startswith("'src_data_rank' at the top level: input should be ")
    assert problem.message.endswith(f", got {got}")


# -- cross-field rules of the constructors (TP105) ------------------------------------------


@pytest.mark.parametrize(
    "options, line, column, message, torch_kwargs",
    [
        (
            "    input_layouts: [shard(1)]\n",
            5, 5, "'input_layouts' needs 'desired_input_layouts' (one entry per entry of 'input_layouts')",
            {"input_layouts": ("shard(1)",)},
        ),
        (
            "    input_layouts: [shard(1)]\n    desired_input_layouts: [replicate, null]\n",
            6, 5, "'desired_input_layouts' has 2 entries but 'input_layouts' has 1: give one per argument",
            {"input_layouts": ("shard(1)",), "desired_input_layouts": ("replicate", None)},
        ),
        (
            "    input_kwarg_layouts: {mask: shard(1)}\n",
            5, 33, "keyword argument 'mask' has a layout but no desired layout in 'desired_input_kwarg_layouts'",
            {"input_kwarg_layouts": {"mask": "shard(1)"}},
        ),
    ],
)
def test_constructor_asserts_are_schema_errors(plan_error, options, line, column, message, torch_kwargs):
    from torch.distributed.tensor.parallel import PrepareModuleInput

    [problem] = plan_error(f"version: 1\nrules:\n  a:\n    style: prepare_module_input\n{options}").problems
    assert (problem.code, problem.line, problem.column) == ("TP105", line, column)
    assert problem.message == f"rule 'a': {message}"

    # ... where torch itself would only assert when the style is built
    def to_torch(value):
        if isinstance(value, dict):
            return {k: to_torch(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(to_torch(v) for v in value)
        return None if value is None else parse_placement(value).to_torch()

    with pytest.raises(AssertionError):
        PrepareModuleInput(**{k: to_torch(v) for k, v in torch_kwargs.items()})


@pytest.mark.parametrize(
    "options, line, column, message",
    [
        (
            "    desired_input_layouts: [replicate]\n",
            5, 5, "'desired_input_layouts' has no effect without 'input_layouts': add 'input_layouts' (the layouts the arguments arrive in)",
        ),
        (
            "    input_kwarg_layouts: {mask: shard(1)}\n    desired_input_kwarg_layouts: {musk: replicate}\n",
            5, 33, "keyword argument 'mask' has a layout but no desired layout in 'desired_input_kwarg_layouts'",
        ),
        (
            "    desired_input_kwarg_layouts: {mask: replicate}\n",
            5, 5, "'desired_input_kwarg_layouts' has no effect without 'input_kwarg_layouts'",
        ),
    ],
)
def test_input_options_that_would_be_silently_ignored_are_errors(plan_error, options, line, column, message):
    error = plan_error(f"version: 1\nrules:\n  a:\n    style: prepare_module_input\n{options}")
    problem = error.problems[0]
    assert (problem.code, problem.line, problem.column) == ("TP105", line, column)
    assert problem.message == f"rule 'a': {message}"


def test_kwarg_layout_key_mismatch_is_reported_on_both_sides(plan_error):
    text = (
        "version: 1\nrules:\n  a:\n    style: prepare_module_input\n"
        "    input_kwarg_layouts: {mask: shard(1)}\n    desired_input_kwarg_layouts: {musk: replicate}\n"
    )
    assert [(p.code, p.line, p.column) for p in plan_error(text).problems] == [("TP105", 5, 33), ("TP105", 6, 41)]
    assert "keyword argument 'musk' has a desired layout but no layout in 'input_kwarg_layouts'" in plan_error(text).problems[1].message


def test_desired_input_entry_may_be_null_as_in_torch():
    spec = only_spec(rule("{style: prepare_module_input, input_layouts: [shard(1)], desired_input_layouts: [null]}"))
    assert spec.desired_input_layouts == [None]


def test_prepare_module_output_needs_a_desired_layout_for_each_given_one(plan_error):
    text = "version: 1\nrules:\n  a:\n    style: prepare_module_output\n    output_layouts: [shard(1), null]\n    desired_output_layouts: [null, null]\n"
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP105", 6, 30)
    assert problem.message == (
        "rule 'a': 'desired_output_layouts' entry 0 is null but 'output_layouts' entry 0 is shard(1): give the layout to redistribute to"
    )


def test_prepare_module_output_lengths_must_match(plan_error):
    text = rule("{style: prepare_module_output, output_layouts: [shard(1)], desired_output_layouts: [replicate, replicate]}")
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP105", 3, 65)
    assert "'desired_output_layouts' has 2 entries but 'output_layouts' has 1" in problem.message


def test_prepare_module_output_requires_both_layouts(plan_error):
    error = plan_error(rule("{style: prepare_module_output, output_layouts: shard(1)}"))
    assert [(p.code, p.line, p.column, p.message) for p in error.problems] == [
        ("TP102", 3, 3, "missing required key 'desired_output_layouts' in rule 'a'"),
    ]


def test_prepare_module_input_output_checks_both_sides(plan_error):
    text = (
        "version: 1\nrules:\n  a:\n    style: prepare_module_input_output\n    input_layouts: [shard(1)]\n"
        "    output_layouts: [replicate]\n    desired_output_layouts: [null]\n"
    )
    error = plan_error(text)
    assert [(p.code, p.line, p.column) for p in error.problems] == [("TP105", 5, 5), ("TP105", 7, 30)]


# -- compiled styles: spec -> torch ParallelStyle -----------------------------------------------


def _state(style) -> tuple:
    """A style's type and options, nested styles included, without src_data_rank."""
    from torch.distributed.tensor.parallel import ParallelStyle

    options = {
        key: _state(value) if isinstance(value, ParallelStyle) else value
        for key, value in vars(style).items()
        if key != "src_data_rank"
    }
    return type(style).__name__, options


def _torch():
    """Torch's styles and placements as one namespace (imported only by the tests that compile)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor import parallel

    from torch.distributed.tensor.placement_types import _StridedShard

    from tpplan.sharding.expert_parallel import AllReduceExpertParallel, AllToAllExpertParallel
    from tpplan.sharding.experts import ExpertTensorParallel
    from tpplan.sharding.kv_heads import HeadsColwiseParallel
    from tpplan.sharding.grad_sum import SumOutputGrad
    from tpplan.sharding.params import LocalParams
    from tpplan.sharding.styles import NoParallel

    return SimpleNamespace(
        **vars(parallel), Partial=Partial, Replicate=Replicate, Shard=Shard, StridedShard=_StridedShard, NoParallel=NoParallel,
        ExpertTensorParallel=ExpertTensorParallel, AllReduceExpertParallel=AllReduceExpertParallel,
        AllToAllExpertParallel=AllToAllExpertParallel, HeadsColwiseParallel=HeadsColwiseParallel,
        LocalParams=LocalParams, SumOutputGrad=SumOutputGrad,
    )


# (rule value in a plan, the torch style it must compile to)
COMPILE_CASES = [
    # every style with all its defaults
    ("colwise", lambda t: t.ColwiseParallel()),
    ("rowwise", lambda t: t.RowwiseParallel()),
    ("sequence_parallel", lambda t: t.SequenceParallel()),
    ("prepare_module_input", lambda t: t.PrepareModuleInput()),
    (
        "{style: prepare_module_output, output_layouts: shard(0), desired_output_layouts: replicate}",
        lambda t: t.PrepareModuleOutput(output_layouts=t.Shard(0), desired_output_layouts=t.Replicate()),
    ),
    (
        "{style: prepare_module_input_output, output_layouts: shard(0), desired_output_layouts: replicate}",
        lambda t: t.PrepareModuleInputOutput(output_layouts=t.Shard(0), desired_output_layouts=t.Replicate()),
    ),
    ("no_parallel", lambda t: t.NoParallel()),
    # and with every option set
    (
        "{style: colwise, input_layouts: shard(0), output_layouts: replicate, use_local_output: false}",
        lambda t: t.ColwiseParallel(input_layouts=t.Shard(0), output_layouts=t.Replicate(), use_local_output=False),
    ),
    (
        "{style: rowwise, input_layouts: replicate, output_layouts: 'partial(avg)', use_local_output: false}",
        lambda t: t.RowwiseParallel(input_layouts=t.Replicate(), output_layouts=t.Partial("avg"), use_local_output=False),
    ),
    (
        "{style: sequence_parallel, sequence_dim: 0, use_local_output: true}",
        lambda t: t.SequenceParallel(sequence_dim=0, use_local_output=True),
    ),
    (
        "{style: prepare_module_input, input_layouts: [shard(1), null], desired_input_layouts: [replicate, null],"
        " input_kwarg_layouts: {mask: shard(0)}, desired_input_kwarg_layouts: {mask: replicate}, use_local_output: true}",
        lambda t: t.PrepareModuleInput(
            input_layouts=(t.Shard(1), None),
            desired_input_layouts=(t.Replicate(), None),
            input_kwarg_layouts={"mask": t.Shard(0)},
            desired_input_kwarg_layouts={"mask": t.Replicate()},
            use_local_output=True,
        ),
    ),
    (
        "{style: prepare_module_output, output_layouts: [shard(0), replicate],"
        " desired_output_layouts: [replicate, replicate], use_local_output: false}",
        lambda t: t.PrepareModuleOutput(
            output_layouts=(t.Shard(0), t.Replicate()), desired_output_layouts=(t.Replicate(), t.Replicate()), use_local_output=False
        ),
    ),
    (
        "{style: prepare_module_input_output, input_layouts: shard(1), desired_input_layouts: replicate, use_local_input: true,"
        " output_layouts: replicate, desired_output_layouts: shard(1), use_local_output: false}",
        lambda t: t.PrepareModuleInputOutput(
            input_layouts=t.Shard(1),
            desired_input_layouts=t.Replicate(),
            use_local_input=True,
            output_layouts=t.Replicate(),
            desired_output_layouts=t.Shard(1),
            use_local_output=False,
        ),
    ),
    (
        "{style: no_parallel, input_layout: shard(0), output_layout: 'partial(max)', desired_input_layout: shard(1), use_local_output: false}",
        lambda t: t.NoParallel(input_layout=t.Shard(0), output_layout=t.Partial("max"), desired_input_layout=t.Shard(1), use_local_output=False),
    ),
    (
        "{style: expert_tp, params: {gate_up_proj: 'packed_shard(1, 2)', down_proj_bias: replicate}, output_layouts: shard(0),"
        " use_local_output: false}",
        lambda t: t.ExpertTensorParallel(
            params={"gate_up_proj": t.StridedShard(1, split_factor=2), "down_proj_bias": t.Replicate()},
            output_layouts=t.Shard(0),
            use_local_output=False,
        ),
    ),
    ("{style: expert_parallel, dispatch: all_reduce, input_layouts: replicate}", lambda t: t.AllReduceExpertParallel(input_layouts=t.Replicate())),
    ("{style: expert_parallel, dispatch: all_to_all}", lambda t: t.AllToAllExpertParallel()),
    ("{style: colwise, heads: 2, input_layouts: shard(1)}", lambda t: t.HeadsColwiseParallel(heads=2, input_layouts=t.Shard(1))),
    ("{style: colwise, heads: auto}", lambda t: t.HeadsColwiseParallel()),
    (
        "{style: local_params, params: {sinks: shard(0)}, input_kwarg_layouts: {hidden_states: replicate},"
        " desired_input_kwarg_layouts: {hidden_states: replicate}}",
        lambda t: t.LocalParams(
            params={"sinks": t.Shard(0)},
            input_kwarg_layouts={"hidden_states": t.Replicate()},
            desired_input_kwarg_layouts={"hidden_states": t.Replicate()},
        ),
    ),
    ("{style: sum_output_grad, last: 64}", lambda t: t.SumOutputGrad(last=64)),
]


def test_every_style_name_has_a_compile_case():
    styles = {options.split(",")[0].removeprefix("{style: ") for options, _ in COMPILE_CASES}
    assert styles == set(STYLE_NAMES)


@pytest.mark.parametrize("options, build_expected", COMPILE_CASES, ids=[options[:60] for options, _ in COMPILE_CASES])
def test_style_compiles_to_the_torch_object_with_the_same_options(options, build_expected):
    from tpplan.sharding.compile import compile_style

    expected = build_expected(_torch())
    compiled = compile_style(only_spec(rule(options)), src_data_rank=None)
    assert _state(compiled) == _state(expected)
    assert compiled.src_data_rank is None


def test_compiled_styles_default_to_scattering_from_rank_0():
    from tpplan.sharding.compile import compile_style

    assert compile_style(only_spec(rule("colwise"))).src_data_rank == 0


def test_resolve_gives_each_module_a_fresh_style_object():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    plan = load_plan(text="version: 1\nsrc_data_rank: null\nrules:\n  '*': {style: colwise, use_local_output: false}\n")
    styles = plan.resolve(model)
    assert list(styles) == ["0", "1", "2"]
    assert len({id(style) for style in styles.values()}) == 3
    assert all(_state(style) == _state(styles["0"]) and style.src_data_rank is None for style in styles.values())
    # resolving again builds new objects too
    assert not {id(style) for style in plan.resolve(model).values()} & {id(style) for style in styles.values()}
