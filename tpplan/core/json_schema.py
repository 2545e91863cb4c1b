"""The JSON Schema of plan files (schemas/plan.schema.json), built from the spec
classes of schema.py so that it accepts every plan `load_plan` accepts and
rejects what `load_plan` rejects wherever JSON Schema can say it.

pydantic writes each spec class (types, defaults, `additionalProperties: false`
for the unknown keys, required options); this module adds what pydantic cannot
see: the style-name shorthand of a rule, the `style:` discriminator spelled in
plain JSON Schema (`if`/`then`, no OpenAPI `discriminator`), the constructors'
cross-field requirements that do not compare values (`desired_*` needs its
`*_layouts` and back), a null rule only in a plan with `extends`, and a
non-blank `extends`.

What JSON Schema cannot decide (tests/test_json_schema.py names each class):
glob syntax of rule keys, duplicate YAML keys and tags (the YAML layer), equal
lengths of two layout lists and entry-by-entry or key-by-key comparisons of
two options, an integer written as a float (`1.0`: JSON Schema's "integer"
is a mathematical value), mapping keys that are not strings, and whatever
needs the file system (`extends` reaching a parent and what the parent holds).
"""

from __future__ import annotations

import typing
from typing import Any

from .external_styles import EXTERNAL_PATTERN, external_specs, like_names
from .style_table import STYLE_NAMES, STYLE_SPECS, StyleSpec

LIKE_NAMES = like_names(STYLE_SPECS)

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_NULL = {"type": "null"}
_NOT_NULL = {"not": _NULL}


def plan_json_schema(plan_spec: Any, mesh_spec: Any) -> dict:
    """The schema of `plan_spec` (schema.PlanSpec; passed in, so that schema.py may
    import this module without a cycle), whose mesh is `mesh_spec`."""
    mesh_spec.model_rebuild()  # its default is encoded with its own serializer, built lazily
    schema = plan_spec.model_json_schema()
    defs = schema["$defs"]
    for cls in external_specs(STYLE_SPECS).values():  # the rule schema below says what an external style takes
        defs.pop(cls.__name__, None)
    for cls in STYLE_SPECS.values():
        conditions = cross_field_conditions(cls) + value_conditions(cls)
        if conditions:
            defs[cls.__name__]["allOf"] = conditions
    rules = schema["properties"]["rules"]
    rules["additionalProperties"] = {"anyOf": [*_rule_schema(_like_conditions(defs)), _NULL]}
    rules["description"] = (
        "Module-path glob -> style name or {style: ..., options}; null deletes an inherited rule "
        "(only in a plan with 'extends')."
    )
    extends = schema["properties"]["extends"]
    extends["anyOf"] = [{"type": "string", "pattern": r"\S"}, _NULL]
    # A null rule deletes the parent's rule of that key: only a plan that extends one may hold it.
    schema["if"] = {"required": ["extends"], "properties": {"extends": {"type": "string"}}}
    schema["else"] = {"properties": {"rules": {"additionalProperties": _NOT_NULL}}}
    schema["$schema"] = SCHEMA_DIALECT
    schema["title"] = "tpplan plan (version 1)"
    return schema


def _like_conditions(defs: dict) -> list[dict]:
    """`like: X` checks the keys X knows as X's options (external_styles.py: the rule's
    spec is X's with extra keys allowed); the other keys are the class's own."""
    conditions = []
    for name in LIKE_NAMES:
        own = defs[STYLE_SPECS[name].__name__]
        options = {key: value for key, value in own["properties"].items() if key != "style"}
        then = {"properties": options, "required": [key for key in own.get("required", []) if key != "style"]}
        if own.get("allOf"):
            then["allOf"] = own["allOf"]
        conditions.append({"if": {"properties": {"like": {"const": name}}, "required": ["like"]}, "then": then})
    return conditions


def _rule_schema(like_conditions: list[dict]) -> list[dict]:
    """A style name (its default options) or a mapping with 'style:' and that style's options."""
    # A style name alone gives its default options: not for a style with required ones.
    shorthand = [
        name for name, cls in STYLE_SPECS.items()
        if not any(field.is_required() for key, field in cls.model_fields.items() if key != "style")
    ]
    by_style = [
        {"if": {"properties": {"style": {"const": name}}, "required": ["style"]}, "then": {"$ref": f"#/$defs/{cls.__name__}"}}
        for name, cls in STYLE_SPECS.items()
    ]
    # `style: PKG.MOD:Class`: its keys are the class's constructor arguments (any), `like:` a built-in style
    external = {
        "type": "object",
        "required": ["style"],
        "properties": {
            "style": {"type": "string", "pattern": EXTERNAL_PATTERN, "description": "A ParallelStyle subclass as PKG.MOD:Class."},
            "like": {"enum": [*LIKE_NAMES, None], "description": "The built-in style whose semantics the lint may assume."},
        },
        "description": "A third-party or user ParallelStyle; the other keys are its constructor's keyword arguments.",
        "allOf": like_conditions,
    }
    return [
        {"type": "string", "enum": shorthand, "description": "A style with its default options (styles without required options)."},
        {"type": "object", "required": ["style"], "properties": {"style": {"type": "string", "enum": list(STYLE_NAMES)}}, "allOf": by_style},
        {"type": "string", "pattern": EXTERNAL_PATTERN, "description": "A ParallelStyle subclass as PKG.MOD:Class, no arguments."},
        external,
    ]


def cross_field_conditions(cls: type[StyleSpec]) -> list[dict]:
    """`if`/`then` for each pair of options `X` / `desired_X` of a style whose `X` is
    optional (a list or a mapping of layouts): given one, the other is needed.
    (A required pair is required by pydantic's schema already.)"""
    conditions = []
    for given, field in cls.model_fields.items():
        desired = f"desired_{given}"
        kind = _container(field.annotation)
        if desired not in cls.model_fields or field.is_required() or kind is None:
            continue
        conditions += [
            # X given -> desired_X needed ...
            {"if": _present(given, kind, nonempty=kind == "object"), "then": _present(desired, kind, nonempty=kind == "object")},
            # ... and desired_X has no effect without X
            {"if": _present(desired, kind), "then": _present(given, kind)},
        ]
        if kind == "object":  # a desired keyword layout needs a layout for some keyword
            conditions.append({"if": _present(desired, kind, nonempty=True), "then": _present(given, kind, nonempty=True)})
    return conditions


# shard(-1) in any spelling parse_placement accepts (any case, blanks, -01)
_LAST_DIM_PATTERN = r"^[ \t\n\r\f\v]*[Ss][Hh][Aa][Rr][Dd]\([ \t\n\r\f\v]*-0*1[ \t\n\r\f\v]*\)[ \t\n\r\f\v]*$"


_FIRST_DIM_PATTERN = r"^[ \t\n\r\f\v]*[Ss][Hh][Aa][Rr][Dd]\([ \t\n\r\f\v]*-?0+[ \t\n\r\f\v]*\)[ \t\n\r\f\v]*$"


def _layout_is(pattern: str) -> dict:
    """null, a value of another type (its own error elsewhere), or this placement."""
    return {"anyOf": [_NULL, {"not": {"type": "string"}}, {"type": "string", "pattern": pattern}]}


def value_conditions(cls: type[StyleSpec]) -> list[dict]:
    """The cross-field checks that compare an option with a constant (decidable):
    colwise with `heads` hands on local head slices, so its output_layouts is
    null or shard(-1) (ColwiseSpec.cross_field_problems); expert_parallel with
    `dispatch: all_to_all` takes and gives token-sharded layouts, shard(0)."""
    fields = cls.model_fields
    conditions = []
    if "heads" in fields and "output_layouts" in fields:
        conditions.append({
            "if": {"required": ["heads"], "properties": {"heads": _NOT_NULL}},
            "then": {"properties": {"output_layouts": _layout_is(_LAST_DIM_PATTERN)}},
        })
    if "dispatch" in fields:
        conditions.append({
            "if": {"required": ["dispatch"], "properties": {"dispatch": {"const": "all_to_all"}}},
            "then": {"properties": {name: _layout_is(_FIRST_DIM_PATTERN) for name in ("input_layouts", "output_layouts")}},
        })
    return conditions


def _present(key: str, kind: str, *, nonempty: bool = False) -> dict:
    value: dict[str, Any] = dict(_NOT_NULL)
    if nonempty:  # only constrains a value of the right kind; another kind is a type error anyway
        value = {"allOf": [_NOT_NULL, {"minProperties": 1} if kind == "object" else {"minItems": 1}]}
    return {"required": [key], "properties": {key: value}}


def _container(annotation: Any) -> str | None:
    """'array' or 'object' for a (possibly optional, possibly Annotated) list or dict type."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is typing.Union or type(annotation).__name__ == "UnionType":
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return None
            annotation = members[0]
        elif origin is list:
            return "array"
        elif origin is dict:
            return "object"
        else:
            return None
