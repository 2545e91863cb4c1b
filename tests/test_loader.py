"""Loading a plan: reading the file, safe YAML, and where each problem is reported.

Every claim checks the exact (code, line, column) a user would see.
"""

from __future__ import annotations

import os

import pytest
import yaml

from tpplan import Plan, PlanError, load_plan
from tpplan.core.yamlsource import MAX_NODES

# -- reading the file (TP001, CLI exit 2) -------------------------------------------


def test_missing_file_is_unreadable(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PlanError) as info:
        load_plan(missing)
    [problem] = info.value.problems
    assert (problem.code, problem.file, problem.line, problem.column) == ("TP001", str(missing), 1, 1)
    assert "cannot read the plan" in problem.message
    assert "No such file" in problem.message


def test_directory_is_unreadable(tmp_path):
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path)
    assert [(p.code, p.line, p.column) for p in info.value.problems] == [("TP001", 1, 1)]


def test_binary_file_is_not_a_plan(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"version: 1\n\x00\x01\x02\xff")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    [problem] = info.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP001", 1, 1)
    assert "binary file" in problem.message


def test_non_utf8_file_is_located_at_the_bad_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\nname: caf\xe9\nrules: {}\n".encode("latin-1"))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    [problem] = info.value.problems
    assert (problem.code, problem.line, problem.column) == ("TP001", 2, 10)
    assert "not UTF-8" in problem.message and "0xe9" in problem.message


def test_non_utf8_column_counts_characters_not_bytes(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_bytes("version: 1\nname: \u00e9t\u00e9 ".encode() + b"\xff\nrules: {}\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert [(p.code, p.line, p.column) for p in info.value.problems] == [("TP001", 2, 11)]


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("version: 1\nrules:\n  a: colwise\n".encode("utf-8-sig"))
    assert [rule.pattern for rule in load_plan(path).rules] == ["a"]


def test_file_problems_name_the_file_and_text_problems_name_text(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n  a: colwse\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}:3:6: TP103 ")
    with pytest.raises(PlanError) as info:
        load_plan(text="version: 1\nrules:\n  a: colwse\n")
    assert str(info.value).startswith("<text>:3:6: TP103 ")
    with pytest.raises(PlanError) as info:
        load_plan(text="version: 1\nrules:\n  a: colwse\n", file="inline.yaml")
    assert info.value.problems[0].file == "inline.yaml"


def test_loaded_plan_remembers_its_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrules:\n  a: colwise\n")
    plan = load_plan(path)
    assert plan.file == str(path)
    assert plan.rules[0].where == f"{path}:3"
    assert load_plan(text="version: 1\nrules: {}\n").file == "<text>"


def test_load_plan_takes_a_path_or_text_not_both():
    with pytest.raises(TypeError, match="a path or text="):
        load_plan("plan.yaml", text="version: 1")
    with pytest.raises(TypeError, match="a path or text="):
        load_plan()


# -- empty and non-mapping documents (TP013) ------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "   \n\t\n", "# only a comment\n\n# another\n", "---\n", "---\n...\n"])
def test_empty_plan_is_an_error(plan_error, text):
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP013", 1, 1)
    assert "the plan is empty" in problem.message


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_bytes(b"")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert [(p.code, p.line, p.column) for p in info.value.problems] == [("TP013", 1, 1)]


@pytest.mark.parametrize(
    "text, kind, line, column",
    [
        ("- version: 1\n- rules: {}\n", "list", 1, 1),
        ("# a comment first\n\n  [a, b]\n", "list", 3, 3),
        ("colwise\n", "string", 1, 1),
        ("\n42\n", "number", 2, 1),
        ("true\n", "boolean", 1, 1),
    ],
)
def test_plan_root_must_be_a_mapping(plan_error, text, kind, line, column):
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP013", line, column)
    assert problem.message.endswith(f"not a {kind}")


# -- YAML syntax (TP010) ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, column, phrase",
    [
        # a key indented deeper than its sibling: read as the text 'colwise b', its ':' is the mistake
        ("version: 1\nrules:\n  a: colwise\n   b: rowwise\n", 4, 5, "mapping values are not allowed here"),
        # a key indented less than its sibling: the key itself
        ("version: 1\nrules:\n  a: colwise\n b: rowwise\n", 4, 2, "expected <block end>"),
        # a key without its ':' is joined with the next line: the key, not the next line's ':'
        ("version: 1\nrules:\n  a colwise\n  b: rowwise\n", 3, 3, "'a colwise' has no ':' after its key"),
        # ... and the last key of a block: not the line after it
        ("version: 1\nrules:\n  a: colwise\n  b rowwise\nname: x\n", 4, 3, "could not find expected ':' (at 5:1)"),
        # an unclosed '{' or '[': its opening, not the next line or the end of the file
        ("version: 1\nrules: {a: colwise, b: rowwise\nname: x\n", 2, 8, "this '{' is never closed: expected ',' or '}', but got ':' at 3:5"),
        ("version: 1\nrules:\n  a: {style: colwise\n  b: rowwise\n", 3, 6, "this '{' is never closed"),
        ("version: 1\nrules: {a: colwise\n", 2, 8, "this '{' is never closed: expected ',' or '}', but got '<stream end>' at 3:1"),
        ("version: 1\nrules:\n  a: [colwise\n", 3, 6, "this '[' is never closed"),
        ("version: 1\nrules: [a\nname: x\n", 2, 8, "this '[' is never closed"),
        # a mapping written over lines with a ',' missing: the end of the line that lacks it
        ("version: 1\nrules: {\n  a: colwise\n  b: rowwise\n}\n", 3, 13, "a ',' missing here, or the '{' at 2:8 not closed"),
        # a ',' missing inside one line: where the parser stopped is the place
        ("version: 1\nrules: {a: colwise b: rowwise}\n", 2, 21, "expected ',' or '}'"),
        ("version: 1\nrules:\n\ta: colwise\n", 3, 1, "YAML indents with spaces"),
        ("version: 1\nrules:\n  a: colwise\n\tb: rowwise\n", 4, 1, "'\\t' that cannot start any token"),
        # an unclosed quote: the opening quote, not the end of the file
        ("version: 1\nrules:\n  a: 'colwise\n", 3, 6, "this quoted string is never closed"),
        ("version: 1\nname: \"x\x07\"\nrules: {}\n", 2, 9, "unacceptable character #x0007"),
        ("version: 1\nrules: {}\n---\nversion: 1\n", 3, 1, "expected a single document"),
    ],
)
def test_yaml_syntax_error_is_located(plan_error, text, line, column, phrase):
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP010", line, column)
    assert problem.message.startswith("YAML syntax error: ")
    assert phrase in problem.message


# -- duplicate keys (TP011) ----------------------------------------------------------


def test_duplicate_rule_is_an_error_naming_the_first_line(plan_error):
    error = plan_error("version: 1\nrules:\n  a: colwise\n  b: rowwise\n  a: rowwise\n")
    [problem] = error.problems
    assert (problem.code, problem.line, problem.column) == ("TP011", 5, 3)
    assert "duplicate key 'a' (first defined at line 3)" in problem.message


def test_duplicate_option_in_a_flow_mapping_is_an_error(plan_error):
    [problem] = plan_error("version: 1\nrules:\n  a: {style: colwise, style: rowwise}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP011", 3, 23)
    assert "duplicate key 'style' (first defined at line 3)" in problem.message


def test_duplicate_top_level_key_is_an_error(plan_error):
    [problem] = plan_error("version: 1\nrules: {}\nversion: 1\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP011", 3, 1)


# -- tags (TP012): a plan can never run code ----------------------------------------------


def test_python_object_tag_is_an_error_and_never_runs(plan_error, tmp_path):
    marker = tmp_path / "created-by-the-plan"
    text = f"version: 1\nrules:\n  a: !!python/object/apply:os.mkdir [{str(marker)!r}]\n"
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP012", 3, 6)
    assert "'tag:yaml.org,2002:python/object/apply:os.mkdir' is not allowed" in problem.message
    assert "never construct objects or run code" in problem.message
    assert not marker.exists()
    # Control: the payload is live. Unsafe YAML loading does run it.
    yaml.unsafe_load(text)
    assert marker.is_dir()


@pytest.mark.parametrize(
    "value, tag",
    [
        ("!!python/name:os.system", "tag:yaml.org,2002:python/name:os.system"),
        ("!!set {colwise}", "tag:yaml.org,2002:set"),
        ("!!binary Y29sd2lzZQ==", "tag:yaml.org,2002:binary"),
        ("!!omap [style: colwise]", "tag:yaml.org,2002:omap"),
        ("!custom colwise", "!custom"),
        ("!!timestamp '2024-01-01'", "tag:yaml.org,2002:timestamp"),
    ],
)
def test_other_tags_are_errors(plan_error, value, tag):
    [problem] = plan_error(f"version: 1\nrules:\n  a: {value}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP012", 3, 6)
    assert f"tag {tag!r} is not allowed" in problem.message


def test_standard_tags_that_fit_their_value_are_allowed():
    plan = load_plan(text="version: !!int 1\nname: !!str 2024\nrules: !!map\n  a: !!str colwise\n")
    assert plan.name == "2024"
    assert plan.rules[0].spec.style == "colwise"


@pytest.mark.parametrize(
    "text, line, column, phrase",
    [
        # regressions: PyYAML raised a bare ValueError / KeyError for these
        ("version: 1\nrules:\n  a: {style: !!float colwise}\n", 3, 14, "'colwise' cannot be read as float"),
        ("version: 1\n!!bool loss_parallel: false\nrules: {}\n", 2, 1, "'loss_parallel' cannot be read as bool"),
        ("version: !!int one\nrules: {}\n", 1, 10, "'one' cannot be read as int"),
    ],
)
def test_a_tag_that_does_not_fit_its_value_is_an_error(plan_error, text, line, column, phrase):
    [problem] = plan_error(text).problems
    assert (problem.code, problem.line, problem.column) == ("TP012", line, column)
    assert phrase in problem.message


def test_integer_too_long_for_python_is_an_error(plan_error):
    # regression: int() refuses more than 4300 digits and PyYAML let the ValueError out
    [problem] = plan_error("version: 1\nsrc_data_rank: " + "9" * 5000 + "\nrules: {}\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP012", 2, 16)
    assert "5000 characters is too long" in problem.message


def test_non_scalar_and_merge_keys_are_errors(plan_error):
    error = plan_error("version: 1\n? [a, b]\n: colwise\nrules:\n  <<: {a: colwise}\n")
    assert [(p.code, p.line, p.column) for p in error.problems] == [("TP012", 2, 3), ("TP012", 5, 3)]
    assert "mapping keys must be plain scalars" in error.problems[0].message


# -- anchors, aliases and size limits (TP014) -----------------------------------------------


def test_anchors_and_aliases_are_plain_reuse():
    plan = load_plan(text="version: 1\nrules:\n  a: &shard_out {style: rowwise, output_layouts: shard(1)}\n  b: *shard_out\n")
    assert [rule.spec for rule in plan.rules][0] == plan.rules[1].spec
    assert str(plan.rules[1].spec.output_layouts) == "shard(1)"


def test_alias_bomb_is_an_error_not_a_hang(plan_error):
    levels = ["a: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    [problem] = plan_error("\n".join(levels).replace("a: &a0", "a0: &a0") + "\n").problems
    assert problem.code == "TP014"
    assert f"more than {MAX_NODES} nodes" in problem.message
    assert problem.line >= 1 and problem.column >= 1


def test_recursive_alias_is_an_error(plan_error):
    [problem] = plan_error("version: 1\nrules:\n  a: &loop [*loop]\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP014", 3, 6)
    assert "alias to itself" in problem.message


def test_absurdly_deep_nesting_is_an_error_not_a_crash(plan_error):
    [problem] = plan_error("version: 1\nrules: " + "[" * 3000 + "]" * 3000 + "\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP014", 1, 1)
    assert "nested too deeply" in problem.message


# -- plain values ------------------------------------------------------------------------------


def test_unquoted_date_in_a_name_is_text():
    assert load_plan(text="version: 1\nname: 2024-06-01\nrules: {}\n").name == "2024-06-01"


def test_plan_with_no_rules_loads():
    plan = load_plan(text="version: 1\nrules: {}\n")
    assert isinstance(plan, Plan) and plan.rules == []


# -- glob syntax (TP110), located at the offending character --------------------------------------


@pytest.mark.parametrize(
    "key, column, phrase",
    [
        # `  layers.[ab: colwise`: the key starts at column 3, '[' is its 8th character
        ("layers.[ab", 10, "'[' without a matching ']'"),
        ("layers.{a,b", 10, "'{' without a matching '}'"),
        ("layers.a}", 11, "'}' without a matching '{'"),
        ("layers.a**", 11, "'**' must be a whole segment"),
        ("layers..wq", 10, "empty path segment"),
        ("layers.w[z-a]", 11, "bad character class '[z-a]'"),
        ("'layers.[ab'", 11, "'[' without a matching ']'"),  # the quote shifts it by one
        ('"layers.{a.b}"', 13, "no '.' inside braces"),
    ],
)
def test_glob_syntax_error_points_at_the_offending_character(plan_error, key, column, phrase):
    [problem] = plan_error(f"version: 1\nrules:\n  {key}: colwise\n").problems
    assert (problem.code, problem.line, problem.column) == ("TP110", 3, column)
    assert phrase in problem.message


# -- several mistakes at once ---------------------------------------------------------------------


MANY_MISTAKES = """\
version: 1
nmae: oops
mesh: {axis: tp, sizes: [2, 0]}
rules:
  tok_embeddings: {style: rowwise, input_layout: replicate}
  layers.*.wq: colwse
  layers.*.wk: {style: colwise, output_layouts: shard(x)}
  layers.[0: colwise
  layers.*.attention:
    style: prepare_module_input
    input_layouts: [shard(1), null]
"""


def test_plan_with_several_mistakes_reports_all_of_them_in_order(plan_error):
    error = plan_error(MANY_MISTAKES)
    assert [(p.code, p.line, p.column) for p in error.problems] == [
        ("TP100", 2, 1),  # nmae
        ("TP101", 3, 29),  # sizes[1] = 0
        ("TP100", 5, 36),  # input_layout
        ("TP103", 6, 16),  # colwse
        ("TP104", 7, 49),  # shard(x)
        ("TP110", 8, 10),  # '[' never closed
        ("TP105", 11, 5),  # input_layouts without desired_input_layouts
    ]
    assert all(p.severity == "error" and p.file == "<text>" for p in error.problems)
    assert str(error).splitlines()[0] == "<text>:2:1: TP100 unknown key 'nmae' at the top level; did you mean 'name'?"
