"""The cross-field rules (tpplan/core/cross_field.py): `load_plan` and the JSON Schema
(schemas/plan.schema.json, judged by `jsonschema`) reject exactly the same rule values,
on cases generated from each style's declaration (`cross_field_rules()`), not from a
second statement of the rules:

- every rule of every style that declares it broken, in each form its kind can be
  broken (and kept, near the boundary), also under `like:` for the styles it may name;
- random combinations of every option of every style, each drawn alone (Hypothesis).

A case the declaration itself says JSON Schema cannot see (`cross_field.beyond_schema`:
lists longer than LIST_BOUND, keyword names) is counted apart and must be accepted by
the schema and rejected by `load_plan`. TPPLAN_SCHEMA_FILE=PATH judges another schema
file (an older one, to count what it missed); TPPLAN_CROSS_FIELD_FUZZ=N draws N random
combinations per style instead of 60.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_json_schema import PLACEMENTS, _kind

from tpplan import PlanError, load_plan
from tpplan.core import cross_field
from tpplan.core.cross_field import LIST_BOUND, Allowed, Equals, Excludes, Fills, Given, Requires, SameKeys, SameLength
from tpplan.core.placements import PlacementSpec, parse_placement
from tpplan.core.schema import EXTERNAL_SPECS, LIKE_NAMES, STYLE_SPECS

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = Path(os.environ.get("TPPLAN_SCHEMA_FILE", ROOT / "schemas" / "plan.schema.json"))
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
EXTERNAL = "my_styles.layers:Custom"  # a class named by the plan; `like:` picks the rules it is checked by


@functools.lru_cache(maxsize=None)
def validator():
    from jsonschema import Draft202012Validator

    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def spec_class(value: dict) -> type:
    return EXTERNAL_SPECS[f"external:{value['like']}"] if "like" in value else STYLE_SPECS[value["style"]]


def verdict(value: dict) -> tuple[bool, bool, str | None, list]:
    """(load_plan accepts, the schema accepts, the class the declaration says the schema
    cannot see or None, load_plan's problems) for the plan holding the one rule `value`."""
    plan = {"version": 1, "rules": {"a": value}}
    try:
        load_plan(text=json.dumps(plan))
        problems = []
    except PlanError as exc:
        problems = exc.problems
    cls = spec_class(value)
    try:
        spec = cls.model_validate(value)
    except ValidationError:  # an option's own type: the schema sees it
        blind = None
    else:
        blind = cross_field.beyond_schema(spec, cls.cross_field_rules())
    return not problems, validator().is_valid(plan), blind, problems


def agree(value: dict, tally: Counter) -> bool:
    accepted, schema_ok, blind, _ = verdict(value)
    if blind is not None:
        tally["beyond the schema: " + blind] += 1
        return not accepted and schema_ok  # what the declaration says of its limit holds
    tally["accepted by both" if accepted and schema_ok else "rejected by both" if accepted == schema_ok else "disagree"] += 1
    return accepted == schema_ok


# -- option values, by the kind of the option (test_json_schema's `_kind`) ----------------------------


def samples(cls: type, name: str) -> list:
    """A few valid values of option `name` of `cls`, each given (not null)."""
    kind = _kind(cls.model_fields[name])
    if kind.startswith("literal:"):
        return kind.split(":", 1)[1].split(",")
    return {
        "layout": ["shard(1)", "replicate", "Shard(-1)", "partial"],
        "layout_list": ["replicate", ["shard(1)", None], [], [None]],
        "kwargs": [{"mask": "shard(1)"}, {}],
        "int_or_literal": [2, "auto"],
        "blocks": [3, [8, 4]],
        "bool": [True], "int": [1], "positive_int": [1], "str": ["x"],
    }[kind]


def base(cls: type, like: str | None = None) -> dict:
    """The smallest valid rule of `cls`: its style and its required options."""
    style = cls.model_fields["style"].annotation.__args__[0]
    value = {"style": EXTERNAL, "like": style} if like else {"style": style}
    for name, field in cls.model_fields.items():
        if name != "style" and field.is_required():
            value[name] = samples(cls, name)[0]
    return value


def spellings(placement: PlacementSpec) -> list[str]:
    """Ways a plan may write `placement` (written here, not derived from the grammar's regexes)."""
    assert placement.kind == "shard" and placement.blocks == 1, placement  # what the declarations allow today
    d = placement.dim
    zeros = f"-00{-d}" if d < 0 else f"00{d}"
    spelled = [f"shard({d})", f" Shard( {d} ) ", f"SHARD({zeros})", f"packed_shard({d}, 1)", f"Packed_Shard( {zeros} ,01 )"]
    return spelled + (["shard(-0)", "shard(-000)"] if d == 0 else [])


OTHER_PLACEMENTS = PLACEMENTS + ["shard(10)", "shard(-10)", "shard(-11)", "packed_shard(-1, 2)", "packed_shard(0, 3)", "partial(avg)"]


def lists(n: int, entry="replicate", single: bool = False):
    """A layout list of n entries; a list of one also in its single form."""
    return entry if single and n == 1 else [entry] * n


# -- breaking and keeping each kind of rule ------------------------------------------------------------


def cases(cls: type, rule) -> list[tuple[bool, dict]]:
    """(breaks the rule, options) for `rule` of `cls`: each way the rule is broken, and
    values near it that keep it."""
    if isinstance(rule, Requires):
        given, needed = samples(cls, rule.a), samples(cls, rule.b)
        return (
            [(True, {rule.a: v}) for v in given] + [(True, {rule.a: v, rule.b: None}) for v in given]
            + [(False, {rule.a: v, rule.b: w}) for v in given for w in needed[:2]] + [(False, {rule.b: w}) for w in needed]
        )
    if isinstance(rule, Excludes):
        return [(True, {rule.a: v, rule.b: w}) for v in samples(cls, rule.a) for w in samples(cls, rule.b)] + [
            (False, {rule.a: v, rule.b: None}) for v in samples(cls, rule.a)
        ] + [(False, {rule.a: None, rule.b: w}) for w in samples(cls, rule.b)]
    if isinstance(rule, Allowed):
        on = [{rule.when.name: v} for v in samples(cls, rule.when.name)] if isinstance(rule.when, Given) else [{rule.when.name: rule.when.value}]
        off = [{}] if isinstance(rule.when, Given) else [{rule.when.name: v} for v in samples(cls, rule.when.name) if v != rule.when.value]
        allowed = [s for value in rule.values for s in spellings(value)]
        others = [p for p in OTHER_PLACEMENTS if parse_placement(p) not in rule.values]
        return (
            [(True, {**when, rule.field: p}) for when in on for p in others]
            + [(False, {**when, rule.field: p}) for when in on for p in [*allowed, None]]
            + [(False, {**when, rule.field: p}) for when in off for p in others]
        )
    if isinstance(rule, SameLength):
        found = []
        for n in range(LIST_BOUND + 3):  # each length against its neighbours, none and one; past the bound, the far side
            for m in sorted({n, n + 1, max(n - 1, 0), 0, 1} | ({LIST_BOUND + 2, LIST_BOUND + 1} if n > LIST_BOUND else set())):
                for single in (False, True) if 1 in (n, m) else (False,):
                    found.append((n != m, {rule.a: lists(n, single=single), rule.b: lists(m, single=single)}))
        if cls.model_fields[rule.a].is_required():  # null is a list of one null
            found += [(False, {rule.a: None, rule.b: "replicate"}), (True, {rule.a: None, rule.b: ["replicate", None]})]
        return found
    if isinstance(rule, Fills):
        found = []
        for n in range(1, LIST_BOUND + 3):
            for i in sorted({0, n // 2, n - 1}):  # the first, a middle and the last entry
                mine, theirs = lists(n, "shard(1)"), lists(n)
                theirs[i] = None
                found.append((True, {rule.a: list(mine), rule.b: theirs}))
                mine[i] = None
                found.append((False, {rule.a: mine, rule.b: theirs}))
        if cls.model_fields[rule.b].is_required():  # the single null: a list of one null
            found += [(True, {rule.a: "shard(1)", rule.b: None}), (False, {rule.a: None, rule.b: None})]
        return found
    if isinstance(rule, SameKeys):
        m, n, both = {"mask": "shard(1)"}, {"x": "replicate"}, {"mask": "shard(1)", "x": "replicate"}
        return [(True, {rule.a: m}), (True, {rule.a: m, rule.b: {}}), (True, {rule.a: {}, rule.b: m}), (True, {rule.a: m, rule.b: n}),
                (True, {rule.a: both, rule.b: m}), (True, {rule.a: m, rule.b: None}),
                (False, {rule.a: m, rule.b: {"mask": "replicate"}}), (False, {rule.a: {}}), (False, {rule.a: {}, rule.b: {}}),
                (False, {rule.a: both, rule.b: {"x": "shard(0)", "mask": "replicate"}})]
    raise AssertionError(f"no cases for {type(rule).__name__}: teach tests/test_cross_field.py the new kind of rule")


def declared_cases():
    """(style, rule, breaks, rule value) for every declared rule, and each way of breaking it
    also under `like:` (a class named by the plan, checked as that style)."""
    for name, cls in STYLE_SPECS.items():
        for rule in cls.cross_field_rules():
            for breaks, options in cases(cls, rule):
                yield name, rule, breaks, {**base(cls), **options}
                if breaks and name in LIKE_NAMES:
                    yield f"like: {name}", rule, breaks, {**base(cls, like=name), **options}


def test_every_kind_of_rule_is_declared_somewhere():
    kinds = {type(rule) for cls in STYLE_SPECS.values() for rule in cls.cross_field_rules()}
    assert kinds == {Requires, Excludes, Allowed, SameLength, Fills, SameKeys}
    assert any(isinstance(rule.when, Equals) for cls in STYLE_SPECS.values() for rule in cls.cross_field_rules() if isinstance(rule, Allowed))


def test_load_plan_and_the_schema_reject_the_same_broken_rules():
    tally, disagree = Counter(), []
    for style, rule, breaks, value in declared_cases():
        accepted, _, _, problems = verdict(value)
        if breaks:  # the case breaks the rule it was made for, and the loader says so at that rule's option
            assert not accepted and any(p.code == "TP105" for p in problems), (style, rule, value)
        if not agree(value, tally):
            disagree.append((style, type(rule).__name__, value))
    print(f"\ndeclared cases: {sum(tally.values())}: {dict(tally)}; disagreements: {len(disagree)}")
    assert disagree == []
    # both verdicts held, and the limits of the schema were reached but are the few
    beyond = {key: n for key, n in tally.items() if key.startswith("beyond")}
    assert tally["rejected by both"] > 400 and tally["accepted by both"] > 150
    assert len(beyond) == 3 and sum(beyond.values()) < 0.05 * sum(tally.values())


# -- random combinations of options, each drawn alone ----------------------------------------------------

_SHARD0, _LAST = PlacementSpec("shard", 0), PlacementSpec("shard", -1)
LAYOUTS = st.sampled_from(PLACEMENTS + spellings(_SHARD0) + spellings(_LAST))
LAYOUT_LISTS = st.one_of(LAYOUTS, st.lists(st.one_of(st.none(), LAYOUTS), max_size=LIST_BOUND + 2))
KWARGS = st.dictionaries(st.sampled_from(["mask", "x"]), LAYOUTS, max_size=2)


def option_values(cls: type, name: str):
    kind = _kind(cls.model_fields[name])
    if kind.startswith("literal:"):
        return st.sampled_from(kind.split(":", 1)[1].split(","))
    return {
        "layout": LAYOUTS, "layout_list": LAYOUT_LISTS, "kwargs": KWARGS,
        "int_or_literal": st.one_of(st.integers(1, 8), st.just("auto")),
        "blocks": st.one_of(st.integers(2, 4), st.lists(st.integers(1, 64), min_size=2, max_size=3)),
        "bool": st.booleans(), "int": st.integers(-2, 4), "positive_int": st.integers(1, 8), "str": st.text(max_size=3),
    }[kind]


@st.composite
def combinations(draw, name: str):
    """A rule of style `name` (or `like:` it), every option absent, null or a value of its own, drawn alone."""
    cls = STYLE_SPECS[name]
    like = name if name in LIKE_NAMES and draw(st.booleans()) else None
    value = base(cls, like)
    for option, field in cls.model_fields.items():
        if option == "style":
            continue
        how = draw(st.sampled_from(["value", "null", "absent", "absent"]))
        if how == "absent":
            value.pop(option, None)
        else:
            value[option] = draw(option_values(cls, option)) if how == "value" else None
    return value


RANDOM = Counter()
_EXAMPLES = int(os.environ.get("TPPLAN_CROSS_FIELD_FUZZ", "60"))
RULED = [name for name, cls in STYLE_SPECS.items() if cls.cross_field_rules()]


@pytest.mark.parametrize("name", RULED)
@settings(FUZZ, max_examples=_EXAMPLES)
@given(data=st.data())
def test_load_plan_and_the_schema_agree_on_random_combinations(name, data):
    value = data.draw(combinations(name))
    assert agree(value, RANDOM), value


def test_random_combinations_held_both_verdicts():
    """Runs after the fuzz test above (file order): its corpus was not degenerate."""
    if not RANDOM:
        pytest.skip("run with the fuzz test")
    print(f"\nrandom combinations: {sum(RANDOM.values())}: {dict(RANDOM)}")
    assert RANDOM["disagree"] == 0
    assert RANDOM["accepted by both"] > len(RULED) * _EXAMPLES // 5 and RANDOM["rejected by both"] > len(RULED) * _EXAMPLES // 5


# -- the messages, from the declaration, at the option ------------------------------------------------------


COLWISE = {
    "packed heads": "colwise takes 'packed' or 'heads', not both: a packed projection's blocks are split per rank already",
    "packed output": "colwise with 'packed' hands on each rank's slice of every block: drop output_layouts",
    "heads output": "colwise with 'heads' hands on local head slices: drop output_layouts (or use shard(-1))",
}


@pytest.mark.parametrize("options, problems", [
    ("packed: 3, heads: 2", [("packed", "packed heads")]),
    ("packed: 3, output_layouts: replicate", [("output_layouts", "packed output")]),
    ("heads: 2, output_layouts: shard(0)", [("output_layouts", "heads output")]),
    # three rules on three pairs of options: each reported (in the order of the text)
    ("packed: 3, heads: 2, output_layouts: replicate", [
        ("packed", "packed heads"), ("output_layouts", "heads output"), ("output_layouts", "packed output"),
    ]),
])
def test_colwise_rules_are_located_at_the_option(plan_error, options, problems):
    text = f"version: 1\nrules:\n  a: {{style: colwise, {options}}}\n"
    line = text.splitlines()[2]
    found = [(p.code, p.line, p.column, p.message) for p in plan_error(text).problems]
    assert found == [("TP105", 3, line.index(key) + 1, f"rule 'a': {COLWISE[which]}") for key, which in problems]


def test_only_the_first_broken_rule_of_a_pair_of_options_is_reported(plan_error):
    # desired without given: "no effect", not also "needs" or a length
    text = "version: 1\nrules:\n  a: {style: prepare_module_input, desired_input_layouts: [replicate, replicate]}\n"
    [problem] = plan_error(text).problems
    assert problem.message.startswith("rule 'a': 'desired_input_layouts' has no effect without 'input_layouts'")
