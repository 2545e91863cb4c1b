"""Module-path globs (SPEC section 2), matched one dot-separated segment at a
time, and strict matching of a plan's rules against a model's module names."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpplan import load_plan
from tpplan.core.globs import GlobSyntaxError, ModuleTree, compile_glob, generalize


def llama_names(layers=(0, 1, 10)) -> list[str]:
    """Module names in `named_modules()` order of a small Llama-shaped model."""
    names = ["", "tok_embeddings", "layers"]
    for i in layers:
        names += [f"layers.{i}", f"layers.{i}.attention", *(f"layers.{i}.attention.w{x}" for x in "qkvo")]
        names += [f"layers.{i}.attention_norm", f"layers.{i}.feed_forward", *(f"layers.{i}.feed_forward.w{x}" for x in "123")]
        names += [f"layers.{i}.ffn_norm"]
    return names + ["norm", "output"]


NAMES = llama_names()
TREE = ModuleTree(NAMES)


def match(pattern: str) -> list[str]:
    return TREE.match(compile_glob(pattern))


# -- operators ---------------------------------------------------------------------------


def test_literal_path_matches_exactly_that_module():
    assert match("layers.0.attention.wq") == ["layers.0.attention.wq"]
    assert match("layers.0.attention.w") == []


def test_star_matches_within_one_segment_only():
    assert match("*") == ["tok_embeddings", "layers", "norm", "output"]
    assert match("layers.*") == ["layers.0", "layers.1", "layers.10"]
    assert match("layers.*.wq") == []  # '*' never spans the '.' between attention and wq
    assert match("*norm") == ["norm"]
    assert match("layers.0.*norm") == ["layers.0.attention_norm", "layers.0.ffn_norm"]


def test_question_mark_matches_one_character():
    assert match("layers.?") == ["layers.0", "layers.1"]
    assert match("layers.??") == ["layers.10"]
    assert match("layers.0.attention.w?") == [f"layers.0.attention.w{x}" for x in "qkvo"]


def test_character_class_and_its_negation():
    assert match("layers.0.attention.w[qk]") == ["layers.0.attention.wq", "layers.0.attention.wk"]
    assert match("layers.0.attention.w[!qk]") == ["layers.0.attention.wv", "layers.0.attention.wo"]
    assert match("layers.[!0]") == ["layers.1"]


def test_character_ranges():
    assert match("layers.0.feed_forward.w[1-2]") == ["layers.0.feed_forward.w1", "layers.0.feed_forward.w2"]
    assert match("layers.[0-0]*") == ["layers.0"]
    assert match("layers.1[0-3]") == ["layers.10"]
    assert match("layers.0.feed_forward.w[!1-2]") == ["layers.0.feed_forward.w3"]


def test_braces_are_alternatives_within_a_segment():
    assert match("layers.1.attention.w{q,k,v}") == [f"layers.1.attention.w{x}" for x in "qkv"]
    assert match("{norm,output}") == ["norm", "output"]
    assert match("layers.{0,10}.feed_forward.w{1,3}") == [
        "layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.10.feed_forward.w1", "layers.10.feed_forward.w3",
    ]
    assert match("layers.0.{attention,feed_forward}_norm") == ["layers.0.attention_norm"]


def test_double_star_matches_zero_or_more_segments():
    # at the start
    assert match("**.wq") == ["layers.0.attention.wq", "layers.1.attention.wq", "layers.10.attention.wq"]
    # in the middle, including zero segments: 'layers.**.layers'-style gaps of any length
    assert match("layers.**.w2") == ["layers.0.feed_forward.w2", "layers.1.feed_forward.w2", "layers.10.feed_forward.w2"]
    assert match("layers.0.**.attention") == ["layers.0.attention"]
    # at the end: the module itself and everything below it
    assert match("layers.1.feed_forward.**") == ["layers.1.feed_forward", *(f"layers.1.feed_forward.w{x}" for x in "123")]
    # alone: every module, the root included
    assert match("**") == NAMES


def test_several_double_stars_match_each_module_once():
    assert match("**.**.wq") == match("**.wq")
    assert match("**.attention.**") == [
        name for name in NAMES if ".attention." in f".{name}." and not name.endswith("_norm")
    ]
    assert match("**.1.**.w1") == ["layers.1.feed_forward.w1"]


def test_empty_pattern_is_the_root_module():
    assert match("") == [""]
    assert ModuleTree(["a", "a.b"]).match(compile_glob("")) == []


def test_regex_characters_in_a_segment_are_literal():
    tree = ModuleTree(["", "w(1)", "w+1", "w.x", "a$"])
    assert tree.match(compile_glob("w(1)")) == ["w(1)"]
    assert tree.match(compile_glob("w+*")) == ["w+1"]
    assert tree.match(compile_glob("w?1")) == ["w+1"]
    assert tree.match(compile_glob("a$")) == ["a$"]
    assert tree.match(compile_glob("w(*)")) == ["w(1)"]


def test_dot_separates_segments_and_is_never_a_wildcard():
    tree = ModuleTree(["", "tok_embeddings", "tok", "tok.embeddings"])
    assert tree.match(compile_glob("tok.embeddings")) == ["tok.embeddings"]
    assert tree.match(compile_glob("tok?embeddings")) == ["tok_embeddings"]


def test_matches_come_in_module_order_not_tree_or_name_order():
    tree = ModuleTree(["", "z", "a", "z.b", "a.b"])
    assert tree.match(compile_glob("*")) == ["z", "a"]
    assert tree.match(compile_glob("**.b")) == ["z.b", "a.b"]


# -- syntax errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, offset, message",
    [
        ("layers.[ab", 7, "'[' without a matching ']'"),
        ("layers.[!]", 7, "'[' without a matching ']'"),
        ("a.{b,c", 2, "'{' without a matching '}'"),
        ("a.b}", 3, "'}' without a matching '{'"),
        ("{a,{b}}", 3, "nested '{' is not supported"),
        ("a.{b.c}", 4, "'{...}' alternatives stay within one segment: no '.' inside braces"),
        ("a.{}", 2, "empty alternatives '{}'"),
        ("a.b**", 3, "'**' must be a whole segment (e.g. 'a.**.b')"),
        ("a.***", 2, "'**' must be a whole segment (e.g. 'a.**.b')"),
        (".a", 0, "empty path segment (a leading, trailing or doubled '.')"),
        ("a..b", 2, "empty path segment (a leading, trailing or doubled '.')"),
        ("a.b.", 3, "empty path segment (a leading, trailing or doubled '.')"),  # the dot, not past the end
        ("a.w[z-a]", 3, "bad character class '[z-a]': bad character range z-a"),
        ("a{b,c**}", 5, "'**' must be a whole segment (e.g. 'a.**.b')"),  # in a later alternative
        ("x.a{b,cd,e[z-a]}", 10, "bad character class '[z-a]': bad character range z-a"),
    ],
)
def test_glob_syntax_errors_name_their_offset(pattern, offset, message):
    with pytest.raises(GlobSyntaxError) as info:
        compile_glob(pattern)
    assert (info.value.offset, str(info.value)) == (offset, message)
    assert 0 <= info.value.offset < len(pattern)


def test_regex_set_syntax_inside_a_class_is_literal():
    # '[[', '&&' and '--' are set operations to Python's re (and warn); in a glob they are characters
    tree = ModuleTree(["", "[", "&", "-", "a", "b"])
    assert tree.match(compile_glob("[[]")) == ["["]
    assert tree.match(compile_glob("[&&]")) == ["&"]
    assert tree.match(compile_glob("[-a]")) == ["-", "a"]
    assert tree.match(compile_glob("[!--a]")) == ["&", "b"]  # the range - to a holds "["
    assert tree.match(compile_glob("[]a]")) == ["a"]


# -- agreement with fnmatch on what both define -------------------------------------------------

_SEGMENT = st.text(alphabet="ab01_", min_size=1, max_size=4)
_GLOB_SEGMENT = (
    st.lists(st.sampled_from(["a", "b", "0", "_", "*", "?", "[ab]", "[!a]", "[0-1]"]), min_size=1, max_size=4)
    .map("".join)
    .filter(lambda segment: "**" not in segment)  # '**' is ours: any depth, not fnmatch's
)


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(st.lists(_SEGMENT, min_size=1, max_size=3).map(".".join), min_size=1, max_size=8, unique=True),
    pattern=st.lists(_GLOB_SEGMENT, min_size=1, max_size=3).map(".".join),
)
def test_segment_wildcards_agree_with_fnmatch_segment_by_segment(names, pattern):
    all_names = sorted({"", *names, *(".".join(n.split(".")[:k]) for n in names for k in range(1, n.count(".") + 1))})
    expected = [
        name
        for name in all_names
        if name
        and len(name.split(".")) == len(pattern.split("."))
        and all(fnmatch.fnmatchcase(part, glob) for part, glob in zip(name.split("."), pattern.split(".")))
    ]
    assert ModuleTree(all_names).match(compile_glob(pattern)) == expected


# -- strict matching of a plan (TP200, TP201) ------------------------------------------------------


def match_problems(text: str) -> list:
    from tpplan import PlanError

    with pytest.raises(PlanError) as info:
        load_plan(text=text).match(NAMES)
    return info.value.problems


def test_rule_matching_nothing_names_the_failing_segment_and_the_closest_paths():
    [problem] = match_problems("version: 1\nrules:\n  layers.*.atention.wq: colwise\n")
    assert (problem.code, problem.line, problem.column) == ("TP200", 3, 3)
    assert problem.message == (
        "rule 'layers.*.atention.wq' matches no module: no child of modules matching 'layers.*' matches 'atention' "
        "(children: attention, attention_norm, feed_forward, ffn_norm); "
        "did you mean 'layers.*.attention.wq' or 'layers.*.attention_norm.wq'?"
    )


def test_rule_matching_nothing_at_the_root_lists_the_top_level_modules():
    [problem] = match_problems("version: 1\nrules:\n  outptu: colwise\n")
    assert problem.message == (
        "rule 'outptu' matches no module: no child of the root module matches 'outptu' "
        "(children: layers, norm, output, tok_embeddings); did you mean 'output'?"
    )


def test_rule_below_a_leaf_says_there_is_nothing_below():
    [problem] = match_problems("version: 1\nrules:\n  layers.*.attention.wq.lora: colwise\n")
    assert problem.message.endswith("matches no module: modules matching 'layers.*.attention.wq' have no submodules")


def test_rule_matching_nothing_past_a_double_star_names_the_closest_full_paths():
    [problem] = match_problems("version: 1\nrules:\n  '**.wx': colwise\n")
    assert (problem.code, problem.line, problem.column) == ("TP200", 3, 3)
    assert problem.message == (
        "rule '**.wx' matches no module: closest module paths: layers.0.attention.wv, layers.0.attention.wq, layers.0.attention.wo"
    )


def test_every_unmatched_rule_is_reported():
    problems = match_problems("version: 1\nrules:\n  nrom: sequence_parallel\n  output: colwise\n  outptu: colwise\n")
    assert [(p.code, p.line) for p in problems] == [("TP200", 3), ("TP200", 5)]


def test_module_matched_by_two_rules_names_both_rules_and_their_lines():
    text = "version: 1\nrules:\n  layers.*.attention.wq: colwise\n  norm: sequence_parallel\n  '**.w{q,k}': colwise\n"
    [problem] = match_problems(text)
    assert (problem.code, problem.line, problem.column) == ("TP201", 5, 3)
    assert problem.message == (
        "rule '**.w{q,k}' (line 5) and rule 'layers.*.attention.wq' (line 3) both match "
        "'layers.0.attention.wq', 'layers.1.attention.wq', 'layers.10.attention.wq': "
        "a module takes one style, narrow one of the globs"
    )


def test_double_match_shows_three_modules_and_counts_the_rest():
    text = "version: 1\nrules:\n  '**': no_parallel\n  layers.*.*.w*: colwise\n"
    [problem] = match_problems(text)
    assert (problem.code, problem.line) == ("TP201", 4)
    assert "both match 'layers.0.attention.wq', 'layers.0.attention.wk', 'layers.0.attention.wv' and 18 more:" in problem.message


def test_root_is_named_in_a_double_match():
    [problem] = match_problems("version: 1\nrules:\n  '': no_parallel\n  '**': no_parallel\n")
    assert "rule '**' (line 4) and rule '' (line 3) both match '<root>':" in problem.message


def test_resolution_follows_module_order_not_rule_order():
    plan = load_plan(text="version: 1\nrules:\n  output: colwise\n  '**.wq': colwise\n  tok_embeddings: rowwise\n")
    matched = plan.match(NAMES)
    assert list(matched) == ["tok_embeddings", "layers.0.attention.wq", "layers.1.attention.wq", "layers.10.attention.wq", "output"]
    assert matched["output"].line == 3 and matched["layers.1.attention.wq"].pattern == "**.wq"


def test_generalize_turns_only_whole_index_segments_into_stars():
    assert generalize("model.layers.12.mlp.experts.3.w1") == "model.layers.*.mlp.experts.*.w1"
    assert [generalize(name) for name in ("0", "h1.2", "layer0.attn", "")] == ["*", "h1.*", "layer0.attn", ""]
