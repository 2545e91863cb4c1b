"""schemas/plan.schema.json against `load_plan`, judged by a standard validator
(the `jsonschema` library, Draft 2020-12, format checking on), on the shipped
plans, on every plan text written in this test suite, and on Hypothesis-generated
valid and invalid plans.

Two properties, on every case:
- the schema never rejects a plan tpplan loads (an editor never draws a red line
  under a correct plan);
- on every case JSON Schema can decide, the schema rejects what tpplan rejects.
A case is undecidable when it holds one of UNDECIDABLE's classes (see `undecidable`).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import typing
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pydantic import ValidationError

from tpplan import PlanError, load_plan
from tpplan.core import cross_field
from tpplan.core.cross_field import LIST_BOUND
from tpplan.core.globs import GlobSyntaxError, compile_glob
from tpplan.core.problems import PlanError as _PlanError
from tpplan.core.axes import load_problems
from tpplan.core.schema import STYLE_SPECS, PlanV2Spec
from tpplan.core.schema_file import POINTER_PREFIX, SCHEMA_FILE, schema_pointer
from tpplan.core.yamlsource import SourceMap, parse_yaml
from tpplan.docs import schema_text

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], derandomize=True)

# What JSON Schema cannot say, each with the reason; `undecidable(data)` names the first one a case holds.
UNDECIDABLE = {
    "yaml": "the YAML layer (syntax, duplicate keys, tags, anchors to themselves): the schema sees parsed data",
    "non-string key": "a mapping key that is not a string: JSON has only string keys",
    "integral float": "an integer written as a float (1.0): JSON Schema's integer is a mathematical value, 1.0 is one",
    "extends": "a non-blank 'extends': reaching the parent plan and what it holds needs the file system",
    "glob": "glob syntax of a rule key (ranges in order, '**' whole, braces flat, ...): not a regular language worth a pattern",
    # the cross-field rules' limits (tpplan/core/cross_field.py, which names them: `beyond_schema`)
    "lengths": f"two layout lists of different lengths, both longer than {LIST_BOUND}: the schema enumerates the lengths up to it",
    "entries": f"a null desired entry facing a given one at an index >= {LIST_BOUND}: the schema names each index below it",
    "kwarg names": "two non-empty keyword-layout mappings with different names: a key-by-key comparison of two mappings",
    # tpplan/core/axes.py's located checks
    "axes": "what a version 2 plan's sizes must satisfy together (one -1 at most, ep dividing dp_shard·cp·tp, "
    "the batch and the sequence divisible, the reshard group dividing dp_shard): arithmetic across keys",
}


@functools.lru_cache(maxsize=None)
def _validator():
    from jsonschema import Draft202012Validator

    schema = json.loads((ROOT / "schemas" / "plan.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


@pytest.fixture
def validator():
    return _validator()


def tpplan_accepts(text: str) -> bool:
    try:
        load_plan(text=text)
    except PlanError:
        return False
    return True


YAML_REJECTS = object()  # what `parsed` returns for a text tpplan's YAML layer rejects


def parsed(text: str):
    """The data tpplan's YAML layer reads from `text` (None for an empty document), or YAML_REJECTS."""
    try:
        data, _ = parse_yaml(text, "<text>") if text.strip() else (None, None)
    except _PlanError:
        return YAML_REJECTS
    return data


def _walk(value):
    yield value
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


def _as_list(value):
    return value if isinstance(value, list) else [value]


def _pairs(cls):
    """(given, desired, required) for each `X` / `desired_X` pair of container options."""
    for given, field in cls.model_fields.items():
        desired = f"desired_{given}"
        if desired in cls.model_fields and _kind(field) in ("layout_list", "kwargs"):
            yield given, desired, field.is_required()


def undecidable(data) -> str | None:
    """The UNDECIDABLE class `data` holds, or None: the schema must then agree with tpplan."""
    if any(isinstance(node, dict) and any(not isinstance(key, str) for key in node) for node in _walk(data)):
        return "non-string key"
    if any(isinstance(node, float) and math.isfinite(node) and node.is_integer() for node in _walk(data)):
        return "integral float"
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("extends"), str) and data["extends"].strip():
        return "extends"
    experts = data.get("experts") if data.get("version") == 2 else None
    for key in (experts if isinstance(experts, dict) else ()):
        try:
            compile_glob(key)
        except GlobSyntaxError:
            return "glob"
    if _breaks_axes_arithmetic(data):
        return "axes"
    rules = data.get("rules")
    for key, value in (rules.items() if isinstance(rules, dict) else ()):
        try:
            compile_glob(key)
        except GlobSyntaxError:
            return "glob"
        style = value.get("style") if isinstance(value, dict) else None
        cls = STYLE_SPECS.get(style) if isinstance(style, str) else None
        try:
            spec = cls.model_validate(value) if cls is not None else None
        except ValidationError:
            continue  # an option's own type or value: the schema decides it
        blind = cross_field.beyond_schema(spec, cls.cross_field_rules()) if spec is not None else None
        if blind is not None:
            return blind
    return None


def _breaks_axes_arithmetic(data: dict) -> bool:
    """A version 2 plan whose values are each right but whose sizes do not fit together."""
    if type(data.get("version")) is not int or data["version"] != 2:
        return False
    try:
        spec = PlanV2Spec.model_validate(data)
    except ValidationError:
        return False  # a value's own type or range: the schema decides it
    return bool(load_problems(spec, SourceMap("<data>")))


def verdicts(validator, text: str) -> tuple[bool, bool, str | None] | None:
    """(tpplan accepts, the schema accepts, undecidable class), or None when the YAML layer rejects the text."""
    data = parsed(text)
    accepted = tpplan_accepts(text)
    if data is YAML_REJECTS:
        assert not accepted
        return None
    return accepted, validator.is_valid(data), undecidable(data)


def check_agreement(validator, text: str, tally: Counter | None = None) -> None:
    found = verdicts(validator, text)
    if found is None:
        if tally is not None:
            tally[("yaml", False, None)] += 1
        return
    accepted, schema_ok, reason = found
    if tally is not None:
        tally[("decidable" if reason is None else reason, accepted, schema_ok)] += 1
    if accepted:
        errors = [e.message for e in validator.iter_errors(parsed(text))]
        assert schema_ok, f"the schema rejects a plan tpplan loads: {errors[:3]}\n{text}"
    elif reason is None:
        assert not schema_ok, f"tpplan rejects, the schema accepts (decidable):\n{text}"


# -- the shipped plans and the plans of this test suite ---------------------------------------------


SHIPPED = sorted(ROOT.glob("plans/**/*.yaml"))


def test_plans_are_shipped():
    assert len(SHIPPED) >= 11


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_plan_is_valid_for_the_schema(validator, path):
    assert load_plan(path)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(parsed(path.read_text()))]
    assert errors == []


def suite_texts() -> list[str]:
    """Every string literal in tests/*.py that reads as a plan, and every one that reads as a
    rule value (the suite's `rule(options)` helpers put it under `rules: {a: ...}`)."""
    texts = set()
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if "rules" in value and "version" in value:
                    texts.add(value)
                elif value.startswith(("{style:", "{ style:")) or value in STYLE_SPECS:
                    texts.add(f"version: 1\nrules:\n  a: {value}\n")
    return sorted(texts)


def test_schema_agrees_with_load_plan_on_every_plan_text_of_the_suite(validator):
    tally = Counter()
    texts = suite_texts()
    for text in texts:
        check_agreement(validator, text, tally)
    loaded = sum(n for (_, accepted, _), n in tally.items() if accepted)
    # the suite holds plans of both kinds, and many
    assert len(texts) > 150 and loaded > 80 and len(texts) - loaded > 40


# -- fuzzing: plans generated from the spec classes, then mutated ------------------------------------

PLACEMENTS = ["replicate", "Replicate", "REPLICATE", "shard(0)", "Shard(-1)", "shard( 2 )", " shard(1) ",
              "partial", "partial(avg)", "Partial(MAX)", "partial( min )", "partial(sum)",
              "packed_shard(1, 2)", "Packed_Shard( -1 ,3 )", "packed_shard(0,01)"]
BAD_PLACEMENTS = ["shard", "shard()", "shard(x)", "shard(1.5)", "shard(١)", "sharded(1)", "replicate(0)",
                  "partial()", "partial(prod)", "", "KELVIN", "replicate\u00a0", "ſhard(1)", "shard(1))",
                  "packed_shard(1)", "packed_shard(1, 0)", "packed_shard(1, x)", "packed_shard(1, -2)", "packedshard(1, 2)"]
NAMES = st.sampled_from(["mask", "hidden_states", "x", "position_ids"])
GLOBS = st.sampled_from(["", "a", "layers.*.wq", "layers.*.attention.w{q,k,v}", "layers.**.w2", "h.[0-3].mlp",
                         "h.[!0].x", "x?", "norm", "model.layers.*.self_attn"])
BAD_GLOBS = ["x[", "a.**b", "{a,b", "a}", "{a.b}", "[z-a]", "{}", "a.{b,{c}}"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10), st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=8), st.sampled_from(PLACEMENTS + BAD_PLACEMENTS),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(st.characters(exclude_categories=["Cs"]), max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


def _kind(field) -> str:
    """The kind of an option's type, from its annotation: what values to draw for it."""
    annotation = field.annotation
    text = repr(annotation) + repr(field.metadata)  # pydantic moves an outer Annotated's metadata there
    if "_single_as_list" in text:
        return "layout_list"
    if "dict[str" in text and "parse_placement" in text:
        return "kwargs"
    if "parse_placement" in text:
        return "layout"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and "MinLen(min_length=2)" in text:
        return "blocks"  # colwise packed: a count of equal blocks or their sizes
    if typing.get_origin(annotation) is typing.Union and len(args) == 2 and any(typing.get_origin(a) is typing.Literal for a in args):
        return "int_or_literal"  # colwise heads: a count or 'auto'
    base = args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation
    if typing.get_origin(base) is typing.Literal:
        return "literal:" + ",".join(typing.get_args(base))
    if base is int and "Ge(ge=1)" in text:
        return "positive_int"  # sum_output_grad's last
    return {bool: "bool", int: "int", str: "str"}.get(base, f"unknown {text}")


def _placement(draw, nullable: bool):
    return draw(st.one_of(st.none(), st.sampled_from(PLACEMENTS))) if nullable else draw(st.sampled_from(PLACEMENTS))


def _layout_list(draw, n: int, nulls_ok: list[bool] | None = None):
    entries = [_placement(draw, nullable=True if nulls_ok is None else nulls_ok[i]) for i in range(n)]
    # the single form of a list of one (a single null would mean "not given" for an optional list)
    return entries[0] if n == 1 and entries[0] is not None and draw(st.booleans()) else entries


@st.composite
def style_values(draw, name: str):
    """A valid rule value of style `name`, drawn from its spec class's fields."""
    cls = STYLE_SPECS[name]
    value = {"style": name}
    paired = {}
    for given, desired, required in _pairs(cls):
        paired[given] = paired[desired] = None
        if not required and not draw(st.booleans()):
            continue
        if _kind(cls.model_fields[given]) == "kwargs":
            names = draw(st.lists(NAMES, unique=True, max_size=2))
            value[given] = {n: _placement(draw, False) for n in names}
            value[desired] = {n: _placement(draw, False) for n in names}
            continue
        n = draw(st.integers(0 if not required else 1, 3))
        value[given] = _layout_list(draw, n)
        mine = _as_list(value[given])
        # a desired entry may be null where the given one is (and anywhere when not required)
        value[desired] = _layout_list(draw, len(mine), [not required or m is None for m in mine])
        if len(mine) != len(_as_list(value[desired])):  # the single form of a list of one
            value[desired] = [value[desired]]
    for key, field in cls.model_fields.items():
        if key == "style" or key in paired or (not field.is_required() and draw(st.booleans())):
            continue
        kind = _kind(field)
        nullable = not field.is_required() and field.default is None
        strategy = {
            "bool": st.booleans(), "int": st.integers(-4, 4), "str": st.text(max_size=5),
            "layout": st.sampled_from(PLACEMENTS),
            "int_or_literal": st.one_of(st.integers(1, 8), st.just("auto")),
            "positive_int": st.integers(1, 8),
            "blocks": st.one_of(st.integers(2, 4), st.lists(st.integers(1, 64), min_size=2, max_size=3)),
            # an unpaired mapping of layouts: per-parameter placements (expert_tp / local_params 'params')
            "kwargs": st.dictionaries(st.sampled_from(["weight", "bias", "gate_up_proj", "*"]), st.sampled_from(PLACEMENTS), max_size=3),
        }.get(kind)
        if kind.startswith("literal:"):
            strategy = st.sampled_from(kind.split(":", 1)[1].split(","))
        assert strategy is not None, f"no strategy for {cls.__name__}.{key}: {kind} (teach _kind the new type)"
        value[key] = draw(st.one_of(strategy, st.none()) if nullable else strategy)
    # Options drawn alone may break a rule between them: drop the option each broken rule
    # names (its declaration, cross_field.py; the paired lists above break none).
    for _ in cls.cross_field_rules():
        broken = cls.model_validate(value).cross_field_problems()
        for path, message in broken:
            assert not cls.model_fields[path[0]].is_required(), message
            value.pop(path[0], None)
    assert not cls.model_validate(value).cross_field_problems(), value
    return value if len(value) > 1 or not draw(st.booleans()) else name


@st.composite
def plans(draw):
    rules = {}
    for key in draw(st.lists(GLOBS, unique=True, max_size=4)):
        rules[key] = draw(style_values(draw(st.sampled_from(list(STYLE_SPECS)))))
    plan = {"version": 1}
    optional = {
        "name": st.one_of(st.text(max_size=6), st.none()),
        "description": st.one_of(st.text(max_size=6), st.none()),
        "mesh": st.fixed_dictionaries({}, optional={"axis": st.text(max_size=3), "sizes": st.one_of(st.none(), st.lists(st.integers(1, 8), max_size=3))}),
        "src_data_rank": st.one_of(st.none(), st.integers(0, 3)),
        "loss_parallel": st.booleans(),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            plan[key] = draw(strategy)
    plan["rules"] = rules
    return plan


def _paths(data, path=()):
    yield path
    if isinstance(data, dict):
        for key, item in data.items():
            yield from _paths(item, path + (key,))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from _paths(item, path + (i,))


def _set(data, path, value):
    if not path:
        return value
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


@st.composite
def mutated(draw, plan):
    """`plan` with 1-3 random edits, most of which make it invalid."""
    data = json.loads(json.dumps(plan))
    all_keys = sorted({k for cls in STYLE_SPECS.values() for k in cls.model_fields} | {"mesh", "rules", "version", "extends", "axis"})
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(data))
        path = draw(st.sampled_from(paths))
        node = data
        for part in path:
            node = node[part]
        edit = draw(st.sampled_from(["replace", "replace", "add key", "delete", "placement", "style", "null rule", "glob", "extends"]))
        if edit == "replace":
            data = _set(data, path, draw(VALUES))
        elif edit == "add key" and isinstance(node, dict):
            node[draw(st.one_of(st.sampled_from(all_keys), st.text(max_size=5)))] = draw(VALUES)
        elif edit == "delete" and path:
            parent = data
            for part in path[:-1]:
                parent = parent[part]
            del parent[path[-1]]
        elif edit == "placement" and path:
            data = _set(data, path, draw(st.sampled_from(BAD_PLACEMENTS + PLACEMENTS + [None, [], [None], ["replicate"]])))
        elif edit == "style" and isinstance(node, dict) and "style" in node:
            node["style"] = draw(st.sampled_from([*STYLE_SPECS, "colwize", "Colwise", "ColwiseParallel", "", "fsdp"]))
        elif edit == "null rule" and isinstance(data, dict) and isinstance(data.get("rules"), dict):
            data["rules"][draw(GLOBS)] = None
        elif edit == "glob" and isinstance(data, dict) and isinstance(data.get("rules"), dict):
            data["rules"][draw(st.sampled_from(BAD_GLOBS))] = "colwise"
        elif edit == "extends" and isinstance(data, dict):
            data["extends"] = draw(st.sampled_from(["", "  ", None, 3, "parent.yaml"]))
        if not isinstance(data, (dict, list)):
            break
    return data


FUZZED = Counter()  # (class, tpplan accepts, schema accepts) -> count, over the fuzz tests of this run


# TPPLAN_SCHEMA_FUZZ=N: N invalid (N // 5 valid) examples instead of CI's count, for a larger corpus.
_EXAMPLES = int(os.environ.get("TPPLAN_SCHEMA_FUZZ", "500"))


@settings(FUZZ, max_examples=max(_EXAMPLES // 5, 1))
@given(plans())
def test_generated_valid_plans_are_valid_for_both(plan):
    validator = _validator()
    text = json.dumps(plan)  # JSON is YAML
    assert tpplan_accepts(text), text
    check_agreement(validator, text, FUZZED)


@settings(FUZZ, max_examples=_EXAMPLES)
@given(st.data())
def test_generated_invalid_plans_agree_where_the_schema_can_decide(data):
    validator = _validator()
    plan = data.draw(mutated(data.draw(plans())))
    check_agreement(validator, json.dumps(plan), FUZZED)


def test_fuzzed_corpus_was_mostly_decidable_and_held_both_verdicts():
    """Runs after the two fuzz tests (file order): the corpus they built was not degenerate."""
    if not FUZZED:
        pytest.skip("run with the fuzz tests")
    decidable = {(a, s): n for (c, a, s), n in FUZZED.items() if c == "decidable"}
    total = sum(FUZZED.values())
    assert sum(decidable.values()) > 0.6 * total
    assert decidable.get((True, True), 0) > _EXAMPLES // 5 and decidable.get((False, False), 0) > _EXAMPLES // 3
    assert decidable.get((False, True), 0) == 0 and sum(n for (c, a, s), n in FUZZED.items() if a and not s) == 0
    print(f"\nfuzzed corpus: {total} cases, {sum(decidable.values())} decidable, agreement 100%; by class: {dict(FUZZED)}")


# -- cases the schema decides, spelled out ------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_layouts: replicate, desired_input_layouts: replicate}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_output, output_layouts: null, desired_output_layouts: null}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_layouts: null, desired_input_layouts: null}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_kwarg_layouts: {}}\n",
        "version: 1\nrules:\n  a: {style: colwise, output_layouts: ' Shard( -1 ) '}\n",
        # shard(-1) in any spelling, packed_shard(-1, 1) too, where a rule allows only it
        "version: 1\nrules:\n  a: {style: colwise, heads: 2, output_layouts: 'packed_shard(-01, 1)'}\n",
        "version: 1\nrules:\n  a: {style: expert_parallel, dispatch: all_to_all, output_layouts: ' SHARD(-00) '}\n",
        "version: 1\nextends: null\nrules: {}\n",
        "version: 1\nrules:\n  '': no_parallel\n",
        # a class without like: its layouts (the contract it gets) as one placement or a list, its params placements
        "version: 1\nrules:\n  a: {style: m.n:C, input_layouts: [replicate, null], output_layouts: 'shard(-1)', params: {weight: shard(0)}}\n",
        "version: 1\nrules:\n  a: {style: m.n:C, desired_input_layouts: replicate, tag: anything}\n",
        # version 2: the whole example of SPEC §7 (less pipeline), and each section at its defaults
        "version: 2\nname: x\nmesh: {pp: 1, dp_replicate: 2, dp_shard: -1, cp: 2, tp: [4, 8], ep: 8}\n"
        "rules: {layers.*.attention.wq: colwise}\n"
        "experts: {layers.*.moe.experts: {style: expert_parallel, dispatch: all_to_all}, b: expert_tp}\n"
        "context_parallel: {modules: layers.*.attention, rotate: alltoall, load_balance: none, buffers: {freqs_cis: 0}}\n"
        "fsdp: {units: [layers.*, ''], reshard_after_forward: 2, mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}, offload: false}\n"
        "checkpointing: {modules: [layers.*], mode: selective}\n"
        "training: {global_batch: 2048, seq: 8192, dtype: bf16, optimizer: adamw}\n",
        "version: 2\nrules: {}\nfsdp: {}\ntraining: {}\nexperts: {}\n",
        "version: 2\nmesh: {tp: -1}\nrules: {}\ncontext_parallel: {modules: attn}\ncheckpointing: {modules: layers.*}\n",
    ],
)
def test_the_schema_accepts_what_tpplan_loads(validator, text):
    assert verdicts(validator, text) == (True, True, None)


@pytest.mark.parametrize(
    "text",
    [
        "version: 1\nrules:\n  a: ColwiseParallel\n",
        "version: 1\nrules:\n  a: null\n",  # a null rule only deletes an inherited one
        "version: 1\nrules:\n  a: {style: prepare_module_input, desired_input_layouts: replicate}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_layouts: [shard(1)]}\n",
        # lists up to cross_field.LIST_BOUND entries: lengths and entries compared
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_layouts: [replicate], desired_input_layouts: [replicate, replicate]}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_output, output_layouts: [shard(1)], desired_output_layouts: [null]}\n",
        "version: 1\nrules:\n  a: {style: colwise, packed: 3, heads: 2}\n",
        "version: 1\nrules:\n  a: {style: colwise, packed: 3, output_layouts: replicate}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_input, input_kwarg_layouts: {m: shard(1)}, desired_input_kwarg_layouts: {}}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_input, desired_input_kwarg_layouts: {}}\n",
        "version: 1\nrules:\n  a: {style: prepare_module_output, output_layouts: shard(0)}\n",
        "version: 1\nrules:\n  a: {style: colwise, output_layouts: 'shard(\u0661)'}\n",  # an Arabic-Indic digit
        "version: 1\nrules:\n  a: {style: colwise, output_layouts: [replicate]}\n",  # one placement here, not a list
        "version: 1\nrules:\n  a: {style: no_parallel, input_layout: null}\n",
        "version: 1\nrules:\n  a: {style: m.n:C, output_layouts: sideways}\n",  # without like:, a layout key is a layout
        "version: 1\nrules:\n  a: {style: m.n:C, params: {weight: 0}}\n",
        "version: 1\nrules:\n  a: {style: m.n:C, like: colwise, input_layouts: [replicate]}\n",  # colwise's: one placement
        "version: 1\nrules:\n  a: {style: colwise, sequence_dim: 1}\n",
        "version: 1\nextends: '  '\nrules: {}\n",
        "version: 1\nmesh: {sizes: [0]}\nrules: {}\n",
        "version: 1\nsrc_data_rank: -1\nrules: {}\n",
        "version: true\nrules: {}\n",
        "version: 1\nrules: {}\nextra: 1\n",
        "[version, rules]\n",
        # version 2: each section's values, and what a version 1 plan cannot hold
        "version: 2\nmesh: {dp_shard: 0}\nrules: {}\n",
        "version: 2\nmesh: {ep: -1}\nrules: {}\n",
        "version: 2\nmesh: {tp: []}\nrules: {}\n",
        "version: 2\nmesh: {tp: [2, -1]}\nrules: {}\n",
        "version: 2\nmesh: {dp: 2}\nrules: {}\n",
        "version: 2\nrules: {}\nexperts: {a: colwise}\n",
        "version: 2\nrules: {}\nexperts: {a: {style: expert_parallel, dispatch: all_to_one}}\n",
        "version: 2\nrules: {}\ncontext_parallel: {rotate: allgather}\n",
        "version: 2\nrules: {}\ncontext_parallel: {modules: []}\n",
        "version: 2\nrules: {}\nfsdp: {units: [layers.*, 3]}\n",
        "version: 2\nrules: {}\ncontext_parallel: {modules: attn, load_balance: zigzag}\n",
        "version: 2\nrules: {}\nfsdp: {reshard_after_forward: 1}\n",
        "version: 2\nrules: {}\nfsdp: {mixed_precision: {param_dtype: bfloat16}}\n",
        "version: 2\nrules: {}\ncheckpointing: {modules: layers.*, mode: some}\n",
        "version: 2\nrules: {}\ntraining: {global_batch: 0}\n",
        "version: 2\nrules: {}\ntraining: {optimizer: adam}\n",
        "version: 2\nrules: {}\npipeline: {schedule: 1F1B}\n",
        "version: 1\nrules: {}\nfsdp: {}\n",
        "version: 1\nmesh: {tp: 2}\nrules: {}\n",
    ],
)
def test_the_schema_rejects_what_tpplan_rejects(validator, text):
    assert verdicts(validator, text) == (False, False, None)


def _rule(value: str) -> str:
    return f"version: 1\nrules:\n  a: {value}\n".replace("'", "").replace("None", "null")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("version: 1.0\nrules: {}\n", "integral float"),
        ("version: 1\nrules:\n  1: colwise\n", "non-string key"),
        ("version: 1\nrules:\n  'x[': colwise\n", "glob"),
        ("version: 1\nextends: nowhere.yaml\nrules: {}\n", "extends"),
        (_rule(f"{{style: prepare_module_input, input_layouts: {['replicate'] * (LIST_BOUND + 1)}, "
               f"desired_input_layouts: {['replicate'] * (LIST_BOUND + 2)}}}"), "lengths"),
        (_rule(f"{{style: prepare_module_output, output_layouts: {['shard(1)'] * (LIST_BOUND + 1)}, "
               f"desired_output_layouts: {['replicate'] * LIST_BOUND + [None]}}}"), "entries"),
        ("version: 1\nrules:\n  a: {style: prepare_module_input, input_kwarg_layouts: {m: shard(1)}, desired_input_kwarg_layouts: {n: replicate}}\n", "kwarg names"),
        ("version: 2\nmesh: {dp_shard: 2, tp: 1, ep: 4}\nrules: {}\n", "axes"),
        ("version: 2\nmesh: {dp_shard: -1, cp: -1}\nrules: {}\n", "axes"),
        ("version: 2\nrules: {}\nexperts:\n  'x[': expert_parallel\n", "glob"),
    ],
)
def test_undecidable_classes_are_rejected_by_tpplan_and_accepted_by_the_schema(validator, text, reason):
    assert verdicts(validator, text) == (False, True, reason)
    assert reason in UNDECIDABLE


# -- the $schema pointer of a plan tpplan writes -----------------------------------------------------


def _resolves(plan_path: Path) -> Path:
    first = plan_path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(POINTER_PREFIX), first
    return (plan_path.parent / first.removeprefix(POINTER_PREFIX)).resolve()


@pytest.mark.parametrize("where", ["flat", "a/b/c", "plans/new"])
def test_schema_pointer_resolves_from_where_the_plan_is_written(tmp_path, monkeypatch, where):
    base = ROOT if where.startswith("plans") else tmp_path
    out = base / where / "plan.yaml"
    if where.startswith("plans"):
        out = tmp_path / "plan.yaml"  # do not write into the checkout; point from a directory inside it instead
        assert Path(os.path.normpath(ROOT / "plans" / "hf" / schema_pointer(ROOT / "plans" / "hf" / "x.yaml"))) == SCHEMA_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(POINTER_PREFIX + schema_pointer(out) + "\n")
    assert _resolves(out) == SCHEMA_FILE and SCHEMA_FILE.is_file()
    monkeypatch.chdir(out.parent)
    assert schema_pointer(None) == schema_pointer(out)  # standard output: relative to the current directory


def test_shipped_plans_point_at_the_schema():
    assert all(_resolves(path) == SCHEMA_FILE for path in SHIPPED)


def test_import_hf_output_points_at_the_schema_from_its_directory(tmp_path):
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from tpplan.cli.app import app

    from tpplan.models import hf as hf_models

    config = tmp_path / "config"
    hf_models.FACTORIES["llama"]().config.save_pretrained(config)
    for where in ("one", "one/two/three"):
        out = tmp_path / where / "plan.yaml"
        out.parent.mkdir(parents=True)
        result = CliRunner().invoke(app, ["import-hf", str(config), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert _resolves(out) == SCHEMA_FILE
        assert load_plan(out)


def test_the_generated_schema_file_is_current():
    assert (ROOT / "schemas" / "plan.schema.json").read_text(encoding="utf-8") == schema_text()
