"""The cross-field rules of a style's options, declared once as data (each spec class's
`cross_field` tuple, style_table.py and style_model.py) and read twice: by the loader
(`problems`: the rules a spec breaks, reported as TP105 at the offending key) and by
the JSON Schema (`Rule.schema`: conditions json_schema.py adds to the style's
definition). No torch here.

The vocabulary ("given" is present and not null: a null optional is its default;
a required layout list written as null is a list of one null, so given):

- `Requires(a, b)`: `a` given needs `b` given.
- `Excludes(a, b)`: not both given.
- `Allowed(field, values, when)`: while `when` holds (`Given(x)`, `Equals(x, v)`),
  a given single-layout `field` is one of `values`.
- `SameLength(a, b)`: two given layout lists have as many entries.
- `Fills(a, b)`: where layout list `a` has a layout, list `b` has one too (no null).
- `SameKeys(a, b)`: a given keyword-layout mapping `a` and `b` (absent: {}) name the
  same keywords.

Rules on the same two options are checked in order and only the first broken one is
reported for them: a missing `desired_input_layouts` is missing, not also of another
length. Each message is a template filled with the rule's fields (`{a}`, `{b}`,
`{field}`, `{value}`) and what the check found (`{len_a}`, `{len_b}`, `{i}`,
`{layout}`, `{name}`).

What plain JSON Schema (draft 2020-12) cannot say, so the schema accepts it and only
`load_plan` rejects it (`Rule.beyond_schema` names the class, tests/test_json_schema.py
and tests/test_cross_field.py check the rest agrees):
- "lengths": two lists of different lengths that both have more than LIST_BOUND
  entries (the schema enumerates the equal lengths 0..LIST_BOUND and lets any two
  longer lists pass: JSON Schema cannot compare two values);
- "entries": a null desired entry facing a layout at an index >= LIST_BOUND (the
  schema names each index below it);
- "kwarg names": two non-empty keyword mappings with different names (an empty one
  against a non-empty one is decided).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Union

from .placements import placement_pattern

# The lists of layouts the schema compares entry by entry or by length: one per
# positional argument (or output) of a forward, which rarely has more than a few.
LIST_BOUND = 8

_NULL = {"type": "null"}
_NOT_NULL = {"not": _NULL}

Problem = tuple[tuple, str]  # (path within the rule, message)


def _field(cls: type, name: str) -> Any:
    return cls.model_fields[name]


def _null_is_given(cls: type, name: str) -> bool:
    """A required option written as null is a value (a layout list: [null]), not its absence."""
    return _field(cls, name).is_required()


def _given_schema(cls: type, name: str) -> dict:
    if _null_is_given(cls, name):
        return {"required": [name]}
    return {"required": [name], "properties": {name: _NOT_NULL}}


def _given(spec: Any, name: str) -> bool:
    return getattr(spec, name) is not None


@dataclass(frozen=True)
class Given:
    """The condition "option `name` is given"."""

    name: str

    def holds(self, spec: Any) -> bool:
        return _given(spec, self.name)

    def schema(self, cls: type) -> dict:
        return _given_schema(cls, self.name)

    def __str__(self) -> str:
        return f"'{self.name}'"


@dataclass(frozen=True)
class Equals:
    """The condition "option `name` is `value`" (its default counts when it is omitted)."""

    name: str
    value: Any

    def holds(self, spec: Any) -> bool:
        return getattr(spec, self.name) == self.value

    def schema(self, cls: type) -> dict:
        written = {"required": [self.name], "properties": {self.name: {"const": self.value}}}
        field = _field(cls, self.name)
        if not field.is_required() and field.default == self.value:
            return {"anyOf": [{"not": {"required": [self.name]}}, written]}
        return written

    def __str__(self) -> str:
        return f"{self.name} {self.value}"


@dataclass(frozen=True)
class Requires:
    a: str
    b: str
    message: str = "'{a}' needs '{b}'"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.a, self.b)

    def problems(self, spec: Any) -> list[Problem]:
        if _given(spec, self.a) and not _given(spec, self.b):
            return [((self.a,), self.message.format(a=self.a, b=self.b))]
        return []

    def schema(self, cls: type) -> list[dict]:
        return [{"if": _given_schema(cls, self.a), "then": _given_schema(cls, self.b)}]

    def beyond_schema(self, spec: Any) -> str | None:
        return None


@dataclass(frozen=True)
class Excludes:
    a: str
    b: str
    message: str = "'{a}' and '{b}' exclude each other: drop one"
    at: str = ""  # the key the problem is reported at; default `a`

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.a, self.b)

    def problems(self, spec: Any) -> list[Problem]:
        if _given(spec, self.a) and _given(spec, self.b):
            return [((self.at or self.a,), self.message.format(a=self.a, b=self.b))]
        return []

    def schema(self, cls: type) -> list[dict]:
        both = _merge(_given_schema(cls, self.a), _given_schema(cls, self.b))
        return [{"not": both}]

    def beyond_schema(self, spec: Any) -> str | None:
        return None


@dataclass(frozen=True)
class Allowed:
    field: str
    values: tuple  # PlacementSpecs
    when: Union[Given, Equals]
    message: str = "with {when}, '{field}' must be {allowed}, not {value}"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.when.name, self.field)

    def problems(self, spec: Any) -> list[Problem]:
        value = getattr(spec, self.field)
        if self.when.holds(spec) and value is not None and value not in self.values:
            allowed = " or ".join(map(str, self.values))
            return [((self.field,), self.message.format(field=self.field, value=value, when=self.when, allowed=allowed))]
        return []

    def schema(self, cls: type) -> list[dict]:
        if _container(_field(cls, self.field).annotation) is not None:
            raise TypeError(f"Allowed compares a single layout; {cls.__name__}.{self.field} is a container")
        spelled = "|".join(f"({placement_pattern(value)})" for value in self.values)
        # null, a value of another type (its own error elsewhere), or an allowed placement in any spelling
        value = {"anyOf": [_NULL, {"not": {"type": "string"}}, {"type": "string", "pattern": spelled}]}
        return [{"if": self.when.schema(cls), "then": {"properties": {self.field: value}}}]

    def beyond_schema(self, spec: Any) -> str | None:
        return None


@dataclass(frozen=True)
class SameLength:
    a: str
    b: str
    message: str = "'{b}' has {len_b} entries but '{a}' has {len_a}"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.a, self.b)

    def problems(self, spec: Any) -> list[Problem]:
        mine, theirs = getattr(spec, self.a), getattr(spec, self.b)
        if mine is None or theirs is None or len(mine) == len(theirs):
            return []
        return [((self.b,), self.message.format(a=self.a, b=self.b, len_a=len(mine), len_b=len(theirs)))]

    def schema(self, cls: type) -> list[dict]:
        def length(name: str, k: int) -> dict:
            if k != 1:
                return {"type": "array", "minItems": k, "maxItems": k}
            single = [{"type": "string"}, *([_NULL] if _null_is_given(cls, name) else [])]  # a single layout: a list of one
            return {"anyOf": [*single, {"type": "array", "minItems": 1, "maxItems": 1}]}

        equal = [{"properties": {self.a: length(self.a, k), self.b: length(self.b, k)}} for k in range(LIST_BOUND + 1)]
        longer = {"type": "array", "minItems": LIST_BOUND + 1}  # beyond the bound: not compared (module docstring)
        equal.append({"properties": {self.a: longer, self.b: longer}})
        return [{"if": _merge(_given_schema(cls, self.a), _given_schema(cls, self.b)), "then": {"anyOf": equal}}]

    def beyond_schema(self, spec: Any) -> str | None:
        mine, theirs = getattr(spec, self.a), getattr(spec, self.b)
        if self.problems(spec) and min(len(mine), len(theirs)) > LIST_BOUND:
            return "lengths"
        return None


@dataclass(frozen=True)
class Fills:
    a: str
    b: str
    message: str = "'{b}' entry {i} is null but '{a}' entry {i} is {layout}"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.a, self.b)

    def _broken(self, spec: Any) -> list[int]:
        mine, theirs = getattr(spec, self.a), getattr(spec, self.b)
        if mine is None or theirs is None:
            return []
        return [i for i, (layout, target) in enumerate(zip(mine, theirs)) if layout is not None and target is None]

    def problems(self, spec: Any) -> list[Problem]:
        mine = getattr(spec, self.a)
        return [((self.b, i), self.message.format(a=self.a, b=self.b, i=i, layout=mine[i])) for i in self._broken(spec)]

    def schema(self, cls: type) -> list[dict]:
        def entry(name: str, i: int, layout: bool) -> dict:
            at_i = {"type": "array", "minItems": i + 1, "prefixItems": [{}] * i + [_NOT_NULL if layout else _NULL]}
            if i > 0:
                return at_i
            # entry 0 of a single value: a layout (a string), or null where null is a list of one null
            single = [{"type": "string"}] if layout else ([_NULL] if _null_is_given(cls, name) else [])
            return {"anyOf": [*single, at_i]} if single else at_i

        return [
            {"not": {"required": [self.a, self.b], "properties": {self.a: entry(self.a, i, True), self.b: entry(self.b, i, False)}}}
            for i in range(LIST_BOUND)
        ]

    def beyond_schema(self, spec: Any) -> str | None:
        broken = self._broken(spec)
        return "entries" if broken and min(broken) >= LIST_BOUND else None


@dataclass(frozen=True)
class SameKeys:
    a: str
    b: str
    message_a: str = "keyword argument {name!r} has a layout but no desired layout in '{b}'"
    message_b: str = "keyword argument {name!r} has a desired layout but no layout in '{a}'"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.a, self.b)

    def problems(self, spec: Any) -> list[Problem]:
        given, wanted = getattr(spec, self.a), getattr(spec, self.b)
        if given is None:
            return []
        wanted = wanted or {}
        return [
            ((self.a, name), self.message_a.format(a=self.a, b=self.b, name=name)) for name in given if name not in wanted
        ] + [((self.b, name), self.message_b.format(a=self.a, b=self.b, name=name)) for name in wanted if name not in given]

    def schema(self, cls: type) -> list[dict]:
        def size(name: str, nonempty: bool) -> dict:
            return {"type": "object", "minProperties" if nonempty else "maxProperties": 1 if nonempty else 0}

        return [
            # a keyword with a layout needs a desired one: `b` given and not empty
            {"if": {"required": [self.a], "properties": {self.a: size(self.a, True)}}, "then": _merge(
                _given_schema(cls, self.b), {"properties": {self.b: {"minProperties": 1}}})},
            # no layouts given (an empty `a`), yet desired ones
            {"not": {"required": [self.a, self.b], "properties": {self.a: size(self.a, False), self.b: size(self.b, True)}}},
        ]

    def beyond_schema(self, spec: Any) -> str | None:
        given, wanted = getattr(spec, self.a), getattr(spec, self.b)
        return "kwarg names" if self.problems(spec) and given and wanted else None


Rule = Union[Requires, Excludes, Allowed, SameLength, Fills, SameKeys]


def problems(spec: Any, rules: tuple[Rule, ...]) -> list[Problem]:
    """(path within the rule, message) for each rule `spec` breaks; on each pair of
    options only the first broken rule."""
    found: list[Problem] = []
    reported: set[frozenset] = set()
    for rule in rules:
        pair = frozenset(rule.fields)
        if pair in reported:
            continue
        broken = rule.problems(spec)
        if broken:
            reported.add(pair)
            found += broken
    return found


def beyond_schema(spec: Any, rules: tuple[Rule, ...]) -> str | None:
    """The class of what the schema cannot decide (module docstring) when that is all
    `spec` breaks; None when it breaks nothing or something the schema rejects."""
    broken = [rule for rule in rules if rule.problems(spec)]
    classes = [rule.beyond_schema(spec) for rule in broken]
    return classes[0] if broken and all(classes) else None


def _merge(*schemas: dict) -> dict:
    """One schema holding all of `schemas`' `required` and `properties` (no other keys)."""
    merged: dict[str, Any] = {"required": [], "properties": {}}
    for schema in schemas:
        merged["required"] += [key for key in schema.get("required", []) if key not in merged["required"]]
        for key, value in schema.get("properties", {}).items():
            merged["properties"][key] = {"allOf": [merged["properties"][key], value]} if key in merged["properties"] else value
    if not merged["properties"]:
        del merged["properties"]
    return merged


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
