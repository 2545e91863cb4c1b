"""The JSON Schema of plan files (schemas/plan.schema.json), built from the spec
classes of schema.py so that it accepts every plan `load_plan` accepts and
rejects what `load_plan` rejects wherever JSON Schema can say it. `version: 2`
selects version 2's definition (axes_spec.py's sections), anything else version 1's.

pydantic writes each spec class (types, defaults, `additionalProperties: false`
for the unknown keys, required options); this module adds what pydantic cannot
see: the style-name shorthand of a rule, the `style:` discriminator spelled in
plain JSON Schema (`if`/`then`, no OpenAPI `discriminator`), each style's
cross-field rules (its `cross_field` declaration, the one the loader checks:
cross_field.py states each kind of rule in JSON Schema), a null rule only in a
plan with `extends`, and a non-blank `extends`.

What JSON Schema cannot decide (tests/test_json_schema.py names each class):
glob syntax of rule keys, duplicate YAML keys and tags (the YAML layer), lists
of different lengths both longer than cross_field.LIST_BOUND, a null desired
entry at an index past it, two non-empty keyword mappings with different names
(cross_field.py), an integer written as a float (`1.0`: JSON Schema's "integer"
is a mathematical value), mapping keys that are not strings, and whatever
needs the file system (`extends` reaching a parent and what the parent holds),
and what a version 2 plan's sizes must satisfy together (axes.py: one `-1` at most,
products and divisibility across keys).
"""

from __future__ import annotations

from typing import Any

from .external_styles import EXTERNAL_PATTERN, LAYOUT_KEYS, external_specs, like_names
from .axes_spec import EXPERT_STYLES
from .style_table import STYLE_SPECS

LIKE_NAMES = like_names(STYLE_SPECS)

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_NULL = {"type": "null"}
_NOT_NULL = {"not": _NULL}


def plan_json_schema(plan_spec: Any, mesh_spec: Any, plan_v2_spec: Any, named_mesh_spec: Any) -> dict:
    """The schema of both plan versions (schema.PlanSpec with its mesh `mesh_spec`, and
    schema.PlanV2Spec with `named_mesh_spec`; passed in, so that schema.py may import
    this module without a cycle): `version: 2` selects version 2's, anything else
    version 1's (whose `version` then says what is wrong)."""
    v1, v1_defs = _version_schema(plan_spec, mesh_spec)
    v2, v2_defs = _version_schema(plan_v2_spec, named_mesh_spec)
    experts = v2["properties"]["experts"]
    experts["anyOf"] = [{"type": "object", "additionalProperties": {"anyOf": _rule_schema([], EXPERT_STYLES)}}, _NULL]
    defs = {**v1_defs, **v2_defs, "PlanVersion1": v1, "PlanVersion2": v2}
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "tpplan plan (version 1 or 2)",
        "$defs": defs,
        "if": {"properties": {"version": {"const": 2}}, "required": ["version"]},
        "then": {"$ref": "#/$defs/PlanVersion2"},
        "else": {"$ref": "#/$defs/PlanVersion1"},
    }


def _version_schema(plan_spec: Any, mesh_spec: Any) -> tuple[dict, dict]:
    """One version's schema without its $defs, and the $defs."""
    mesh_spec.model_rebuild()  # its default is encoded with its own serializer, built lazily
    schema = plan_spec.model_json_schema()
    defs = schema.pop("$defs")
    # the rule schema below says what an external style takes; without `like:`, the layout
    # keys it takes its contract from are typed as the spec types them (external_styles.py)
    opaque = defs.get(external_specs(STYLE_SPECS)["external"].__name__, {}).get("properties", {})
    derived = {key: opaque[key] for key in LAYOUT_KEYS if key in opaque}
    for cls in external_specs(STYLE_SPECS).values():
        defs.pop(cls.__name__, None)
    for cls in STYLE_SPECS.values():
        # the same rules the loader checks (cross_field.py), as far as JSON Schema can state them
        conditions = [condition for rule in cls.cross_field_rules() for condition in rule.schema(cls)]
        if conditions:  # one definition, referred to by the style's and by a `like:` rule's
            defs[f"{cls.__name__}CrossField"] = {
                "description": f"The cross-field rules of {cls.__name__} (TP105).", "allOf": conditions,
            }
            defs[cls.__name__]["allOf"] = [{"$ref": f"#/$defs/{cls.__name__}CrossField"}]
    rules = schema["properties"]["rules"]
    rules["additionalProperties"] = {"anyOf": [*_rule_schema([*_like_conditions(defs), _without_like(derived)]), _NULL]}
    rules["description"] = (
        "Module-path glob -> style name or {style: ..., options}; null deletes an inherited rule "
        "(only in a plan with 'extends')."
    )
    extends = schema["properties"]["extends"]
    extends["anyOf"] = [{"type": "string", "pattern": r"\S"}, _NULL]
    # A null rule deletes the parent's rule of that key: only a plan that extends one may hold it.
    schema["if"] = {"required": ["extends"], "properties": {"extends": {"type": "string"}}}
    schema["else"] = {"properties": {"rules": {"additionalProperties": _NOT_NULL}}}
    return schema, defs


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


def _without_like(layouts: dict) -> dict:
    """Without `like:`, the keys a class's contract is derived from are layouts."""
    return {"if": {"required": ["like"], "properties": {"like": {"type": "string"}}}, "else": {"properties": layouts}}


def _rule_schema(like_conditions: list[dict], names: tuple[str, ...] | None = None) -> list[dict]:
    """A style name (its default options) or a mapping with 'style:' and that style's options;
    with `names`, only those built-in styles (version 2's experts rules)."""
    styles = {name: cls for name, cls in STYLE_SPECS.items() if names is None or name in names}
    # A style name alone gives its default options: not for a style with required ones.
    shorthand = [
        name for name, cls in styles.items()
        if not any(field.is_required() for key, field in cls.model_fields.items() if key != "style")
    ]
    by_style = [
        {"if": {"properties": {"style": {"const": name}}, "required": ["style"]}, "then": {"$ref": f"#/$defs/{cls.__name__}"}}
        for name, cls in styles.items()
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
    builtin = [
        {"type": "string", "enum": shorthand, "description": "A style with its default options (styles without required options)."},
        {"type": "object", "required": ["style"], "properties": {"style": {"type": "string", "enum": list(styles)}}, "allOf": by_style},
    ]
    if names is not None:
        return builtin
    return [
        *builtin,
        {"type": "string", "pattern": EXTERNAL_PATTERN, "description": "A ParallelStyle subclass as PKG.MOD:Class, no arguments."},
        external,
    ]
