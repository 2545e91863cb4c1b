"""Fuzzing the loader: whatever the text, `load_plan(text=...)` returns a Plan or
raises PlanError whose problems are located (line and column >= 1, within the
text) and carry a known code. Never any other exception, never a warning.

Random text, token soup, structured random plans, and mutations of a valid
shipped-like plan (characters and lines deleted, duplicated, replaced; keys
swapped; tags, anchors/aliases, control characters and deep nesting inserted).
Bounded to a few seconds per test; the regression cases at the end are texts
these tests once found crashing the core.
"""

from __future__ import annotations

import re
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpplan import Plan, PlanError, load_plan

# The codes of loading a plan from text (TP001 is for files that cannot be read).
LOAD_CODES = {
    "TP010", "TP011", "TP012", "TP013", "TP014",
    "TP100", "TP101", "TP102", "TP103", "TP104", "TP105", "TP106", "TP110",
    "TP120", "TP122", "TP123", "TP124", "TP125", "TP150", "TP151", "TP152", "TP153",  # version 2's sizes (core/axes.py)
}
# PyYAML breaks lines on these (so may a plan, and positions count them).
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

VALID = """\
# yaml-language-server: $schema=../schemas/plan.schema.json
version: 1
name: llama-tp-sp
description: >-
  Megatron-style TP with sequence parallelism.
mesh:
  axis: tp
  sizes: [2, 4, 8]
src_data_rank: 0
loss_parallel: false
rules:
  tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
  layers.*.attention_norm: sequence_parallel
  layers.*.attention:
    style: prepare_module_input
    input_layouts: [shard(1), null]
    desired_input_layouts: [replicate, null]
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: {style: rowwise, output_layouts: shard(1)}
  "layers.*.feed_forward.w[13]": colwise
  layers.**.w2: {style: rowwise, output_layouts: 'Shard(-1)'}
  router:
    style: no_parallel
    output_layout: partial(avg)
    use_local_output: false
  head:
    style: prepare_module_output
    output_layouts: shard(-1)
    desired_output_layouts: replicate
  norm: sequence_parallel
  output: {style: colwise, input_layouts: shard(1), output_layouts: replicate}
"""


def check_loads_or_reports(text: str) -> None:
    """The fuzzing oracle."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning on some input is a bug too (e.g. regex FutureWarning)
        try:
            plan = load_plan(text=text)
        except PlanError as exc:
            problems = exc.problems
        else:
            assert isinstance(plan, Plan)
            assert re.fullmatch(r"[0-9a-f]{16}", plan.fingerprint())
            assert all(rule.line >= 1 and rule.column >= 1 for rule in plan.rules)
            return
    assert problems, "a PlanError without problems"
    lines = _LINE_BREAK.split(text)
    for problem in problems:
        assert problem.code in LOAD_CODES, problem
        assert problem.severity == "error" and problem.file == "<text>", problem
        assert problem.message and "\n" not in problem.message, problem
        assert 1 <= problem.line <= len(lines), problem
        assert 1 <= problem.column <= len(lines[problem.line - 1]) + 1, problem


def test_the_mutated_plan_is_valid_to_begin_with():
    assert len(load_plan(text=VALID).rules) == 11


# -- random text ------------------------------------------------------------------------------


@settings(FUZZ, max_examples=300)
@given(st.text(max_size=300))
def test_random_text(text):
    check_loads_or_reports(text)


_TOKENS = [
    "version", "rules", "mesh", "axis", "sizes", "style", "name", "src_data_rank", "loss_parallel",
    "colwise", "rowwise", "sequence_parallel", "prepare_module_input", "prepare_module_output",
    "prepare_module_input_output", "no_parallel", "input_layouts", "output_layouts", "desired_input_layouts",
    "desired_output_layouts", "input_kwarg_layouts", "use_local_output", "sequence_dim", "input_layout",
    "replicate", "shard(1)", "Shard(-1)", "partial", "partial(avg)", "shard(", "partial(x)",
    "layers", "*", "**", "?", "[!ab]", "[0-3]", "{q,k}", "{", "}", "[", "]", ",", ":", ": ", "-", "- ",
    "? ", ".", "'", '"', "#", "&a ", "*a", "<<", "!!str ", "!!int ", "!!float ", "!!bool ", "!!null ",
    "!!python/object/apply:os.system ", "!x ", "|", ">", "---", "...", "%YAML 1.1", "null", "~", "true",
    "1", "0", "-1", "1.0", "1e400", "0x10", "2024-01-01", " ", "  ", "\n", "\n  ", "\n    ", "\t", "\r",
    "\x00", "\x85", "\u2028", "\ufeff", "\x1b", "é", "\U0001f600",
]


@settings(FUZZ, max_examples=400)
@given(st.lists(st.sampled_from(_TOKENS), max_size=60).map("".join))
def test_token_soup(text):
    check_loads_or_reports(text)


# -- structured random plans ------------------------------------------------------------------------

_KEYS = st.sampled_from(_TOKENS[:30] + ["layers.*.wq", "a.{b,c}", "", "x[", "norm"])
_SCALARS = st.one_of(
    st.sampled_from(_TOKENS[9:35]), st.none(), st.booleans(), st.integers(-3, 10), st.floats(allow_nan=False), st.text(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(_KEYS, st.integers(0, 3), st.none(), st.booleans()), children, max_size=5),
    ),
    max_leaves=25,
)
_RULE = st.one_of(
    st.sampled_from(_TOKENS[9:16]),
    st.fixed_dictionaries({"style": st.sampled_from(_TOKENS[9:16])}, optional={k: _VALUES for k in _TOKENS[16:24]}),
)
_PLANS = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 1, 1, 2, "1", True, None])},
    optional={
        "rules": st.one_of(st.dictionaries(_KEYS, _RULE, max_size=5), _VALUES),
        "mesh": st.one_of(st.fixed_dictionaries({}, optional={"axis": _SCALARS, "sizes": _VALUES}), _VALUES),
        "src_data_rank": _SCALARS,
        "loss_parallel": _SCALARS,
        "name": _SCALARS,
        "extra": _VALUES,
    },
)


@settings(FUZZ, max_examples=400)
@given(_PLANS, st.sampled_from([None, True, False]))
def test_structured_random_plans(data, flow):
    check_loads_or_reports(yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True, sort_keys=False))


# -- mutations of a valid plan --------------------------------------------------------------------------

_TAGS = [
    "!!python/object/apply:os.system ['true'] ", "!!python/name:os.system ", "!!binary ", "!!set ", "!!omap ",
    "!!timestamp ", "!!float ", "!!int ", "!!bool ", "!!null ", "!!str ", "!!map ", "!!seq ", "!local ", "!<tag:x> ",
]
_INSERTS = _TAGS + ["&a ", "*a", "&b ", "*b", "<<: *a\n", "? ", "- ", "{", "[", "}", "]", ",", ": ", "'", '"', "\\", "#"]


@st.composite
def mutated(draw) -> str:
    text = VALID
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        i = draw(st.integers(0, len(text)))
        n = draw(st.integers(0, 12))
        a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "replace", "insert", "unicode", "tag", "del_line", "dup_line", "swap_lines", "swap_keys", "nest", "alias"]))
        if op == "delete":
            text = text[:i] + text[i + n :]
        elif op == "duplicate":
            text = text[:i] + text[i : i + n] * 2 + text[i + n :]
        elif op == "replace":
            text = text[:i] + draw(st.sampled_from(_INSERTS + [" ", "\n", "\t", "x", "0"])) + text[i + 1 :]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(_INSERTS)) + text[i:]
        elif op == "unicode":
            text = text[:i] + draw(st.text(min_size=1, max_size=3)) + text[i:]
        elif op == "tag":  # a tag before a value or a key
            spots = [m.end() for m in re.finditer(r": |^\s+|\[|, ", text, re.M)]
            spot = spots[draw(st.integers(0, len(spots) - 1))]
            text = text[:spot] + draw(st.sampled_from(_TAGS)) + text[spot:]
        elif op == "del_line":
            del lines[a]
            text = "\n".join(lines)
        elif op == "dup_line":
            lines.insert(a, lines[a])
            text = "\n".join(lines)
        elif op == "swap_lines":
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
        elif op == "swap_keys":
            keys = re.findall(r"\b(\w+):", text)
            k1, k2 = draw(st.sampled_from(keys)), draw(st.sampled_from(keys))
            text = re.sub(rf"\b({re.escape(k1)}|{re.escape(k2)}):", lambda m: (k2 if m.group(1) == k1 else k1) + ":", text)
        elif op == "nest":
            depth = draw(st.integers(1, 300))
            inner = draw(st.sampled_from(["[" * depth + "]" * depth, "{a: " * depth + "1" + "}" * depth, "[" * depth]))
            text = text[:i] + inner + text[i:]
        else:  # alias: reuse a value from elsewhere, or make it refer to itself
            lines[a] = re.sub(r": (\S)", r": &a \1", lines[a], count=1)
            lines[b] = re.sub(r": (\S.*)$", draw(st.sampled_from([": *a", ": [*a, *a]", ": {<<: *a}"])), lines[b], count=1)
            text = "\n".join(lines)
    return text


@settings(FUZZ, max_examples=1000)
@given(mutated())
def test_mutations_of_a_valid_plan(text):
    check_loads_or_reports(text)


@settings(FUZZ, max_examples=30)
@given(st.integers(1, 3000), st.sampled_from(["[", "{a: ", "- ", "a:\n" + " "]))
def test_deep_nesting(depth, opener):
    if opener.startswith("a:"):  # block mappings, each level indented one more
        text = "".join(f"{' ' * level}k{level}:\n" for level in range(depth)) + " " * depth + "x\n"
    else:
        text = "version: 1\nrules: " + opener * depth
    check_loads_or_reports(text)


# -- texts that once crashed the core, and what they report now --------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        # PyYAML's own constructors raised ValueError / KeyError on an explicit tag that does not fit
        ("version: 1\nrules:\n  a: {style: !!float colwise}\n", [("TP012", 3, 14)]),
        ("version: 1\nrules:\n  a: {style: !!int rowwise}\n", [("TP012", 3, 14)]),
        ("version: 1\nrules:\n  a: [shard(1), !!bool null]\n", [("TP012", 3, 17)]),
        ("version: 1\nrules:\n  a: !!int\n", [("TP012", 3, 6)]),  # IndexError on the empty value
        ("version: 1\n!!bool loss_parallel: false\nrules: {}\n", [("TP012", 2, 1)]),
        # an integer past Python's 4300-digit limit
        ("version: 1\nsrc_data_rank: " + "1" * 4400 + "\nrules: {}\n", [("TP012", 2, 16)]),
        # a null key made pydantic write the location as 'None' and the loader index past its path
        ("version: 1\nrules:\n  !!null a: {style: colwse}\n", [("TP101", 3, 3), ("TP103", 3, 21)]),
        # re.error from a reversed range in a character class
        ("version: 1\nrules:\n  w[z-a]: colwise\n", [("TP110", 3, 4)]),
        # an alias inside its own anchor recursed until RecursionError
        ("version: 1\nrules: &r\n  a: *r\n", [("TP014", 2, 8)]),
        # a tab on an otherwise blank line was a syntax error in an empty plan
        ("\t\n", [("TP013", 1, 1)]),
        # a lone '\r' breaks a line for YAML: the control character is on line 2, not 1
        ("version: 1\r\x1b\n", [("TP010", 2, 1)]),
        # JSON's escape of a character beyond U+FFFF (a surrogate pair) reached pydantic as two
        # halves, which it reports under another key: IndexError in the loader
        ('version: 1\nrules:\n  "\\ud800\\udc00": {}\n', [("TP102", 3, 19)]),
        ('version: 1\nrules:\n  "\\udc00": colwise\n', [("TP012", 3, 3)]),  # a lone half is no character
    ],
)
def test_texts_that_once_crashed_now_report_located_problems(plan_error, text, expected):
    assert [(p.code, p.line, p.column) for p in plan_error(text).problems] == expected
    check_loads_or_reports(text)


def test_a_surrogate_pair_escape_reads_as_its_character():
    plan = load_plan(text='version: 1\nname: "\\ud83d\\ude00"\nrules: {}\n')
    assert plan.name == "\U0001f600"


def test_a_style_or_key_with_a_line_break_is_quoted_on_one_line():
    """Found by test_structured_random_plans: rules {'version': '\\n'}."""
    from tpplan import PlanError, load_plan

    for text, expected in [('version: 1\nrules: {version: "\\n"}\n', "unknown style '\\n' in rule 'version'"),
                           ('version: 1\nrules: {a: {style: colwise, "x\\ty": 1}}\n', "unknown key 'x\\ty'")]:
        with pytest.raises(PlanError) as raised:
            load_plan(text=text)
        message = raised.value.problems[0].message
        assert expected in message and "\n" not in message and "\t" not in message, message
