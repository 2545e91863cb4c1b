"""Plan text -> Plan, with every problem located at its file:line:col."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ValidationError

from .globs import GlobSyntaxError, compile_glob
from .plan import Plan, Rule
from .problems import PlanError, Problem, error
from .schema import STYLE_NAMES, STYLE_SPECS, MeshSpec, PlanSpec, StyleSpec
from .yamlsource import SourceMap, parse_yaml, text_position

def load_plan(path: str | os.PathLike | None = None, *, text: str | None = None, file: str | None = None) -> Plan:
    """Load and validate a plan from a file, or from `text` (named `file` in problems)."""
    if (path is None) == (text is None):
        raise TypeError("load_plan() takes a path or text=, not both")
    if text is None:
        file = str(path)
        text = read_plan_text(path)
    plan = parse_plan(text, file or "<text>")
    plan.text = text
    return plan


def read_plan_text(path: str | os.PathLike) -> str:
    file = str(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise PlanError([error("TP001", f"cannot read the plan: {exc.strerror or exc}", file)]) from None
    if b"\0" in raw:
        raise PlanError([error("TP001", "this is a binary file, not a YAML plan", file)])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8-sig")  # valid up to the bad byte; columns count characters
        line, column = text_position(before, len(before))
        raise PlanError([error("TP001", f"the plan is not UTF-8 text (byte 0x{raw[exc.start]:02x})", file, line, column)]) from None


def parse_plan(text: str, file: str, _extending: tuple[str, ...] = ()) -> Plan:
    """`_extending`: the real paths of the plans whose `extends:` led here (cycle check)."""
    # PyYAML rejects a tab even on a blank line: whitespace alone is an empty plan, not bad YAML
    data, source = parse_yaml(text, file) if text.strip() else (None, None)
    if data is None:
        raise PlanError([error("TP013", "the plan is empty: it needs at least 'version: 1' and 'rules:'", file)])
    if not isinstance(data, dict):
        raise PlanError([error("TP013", f"a plan is a mapping with 'version' and 'rules', not a {_kind(data)}", file, *source.locate(()))])

    problems: list[Problem] = []
    spec = None
    try:
        spec = PlanSpec.model_validate(data)
    except ValidationError as exc:
        problems += [_schema_problem(err, data, source) for err in exc.errors()]
    raw_rules = data.get("rules") if isinstance(data.get("rules"), dict) else {}
    extends = data.get("extends")
    rules, deleted = [], []
    for pattern, value in raw_rules.items():
        if not isinstance(pattern, str):
            continue  # reported by the schema
        line, column = source.locate(("rules", pattern), key=True)
        if value is None:
            if extends is None:  # null deletes an inherited rule: there is none here
                problems.append(error(
                    "TP101", f"rule '{pattern}' must be a style name or a mapping with 'style:', not null",
                    file, *source.locate(("rules", pattern)),
                ))
            deleted.append((pattern, line, column))
            continue
        try:
            glob = compile_glob(pattern)
        except GlobSyntaxError as exc:
            shift = exc.offset + (1 if ("rules", pattern) in source.quoted_keys else 0)
            problems.append(error("TP110", f"bad glob '{pattern}': {exc}", file, line, column + shift))
            continue
        rule_spec = spec.rules[pattern] if spec else _validate_rule(pattern, value)
        if rule_spec is None:
            continue  # reported by the schema
        for subpath, message in rule_spec.cross_field_problems():
            path = ("rules", pattern, *subpath)
            problems.append(error("TP105", f"rule '{pattern}': {message}", file, *source.locate(path, key=len(subpath) == 1)))
        rules.append(Rule(pattern, rule_spec, glob, file, line, column))
    parent = None
    if isinstance(extends, str):
        try:
            parent = _load_parent(extends, file, source, _extending)
        except PlanError as exc:
            problems += exc.problems
    if problems:
        raise PlanError(problems)
    if parent is None:
        return Plan(spec, rules, file, source)
    return _extend(parent, spec, rules, deleted, file, source)


def _load_parent(extends: str, file: str, source: SourceMap, extending: tuple[str, ...]) -> Plan:
    """The plan `extends:` names, relative to the directory of `file`; its own problems
    are located in it, problems with reaching it at the `extends:` value."""
    at = source.locate(("extends",))
    if not extends.strip():
        raise PlanError([error("TP107", "'extends' is empty: give the path of the parent plan, relative to this file", file, *at)])
    path = os.path.normpath(os.path.join(os.path.dirname(file), extends))
    chain = (*extending, os.path.realpath(file))
    if os.path.realpath(path) in chain:
        cycle = " -> ".join([*(os.path.relpath(p) for p in chain), os.path.relpath(path)])
        raise PlanError([error("TP107", f"'extends' makes a cycle ({cycle}): a plan cannot extend itself", file, *at)])
    try:
        text = read_plan_text(path)
    except PlanError as exc:
        reason = exc.problems[0].message.removeprefix("cannot read the plan: ")
        raise PlanError([error("TP107", f"cannot read the parent plan '{extends}' ({path}): {reason}", file, *at)]) from None
    return parse_plan(text, path, chain)


def _extend(parent: Plan, spec: PlanSpec, rules: list[Rule], deleted: list[tuple[str, int, int]], file: str, source: SourceMap) -> Plan:
    """The parent's rules, each replaced by the child's rule of the same key or deleted by
    its null, then the child's new rules; settings the child gives override the parent's."""
    inherited = {rule.pattern for rule in parent.rules}
    problems = [
        error("TP108", f"rule '{pattern}' is null, which deletes the inherited rule of that key, but {parent.file} has none"
              f"{_did_you_mean(pattern, sorted(inherited))}", file, line, column)
        for pattern, line, column in deleted
        if pattern not in inherited
    ]
    if problems:
        raise PlanError(problems)
    gone = {pattern for pattern, _, _ in deleted}
    own = {rule.pattern: rule for rule in rules}
    merged = [own.pop(rule.pattern, rule) for rule in parent.rules if rule.pattern not in gone]
    merged += own.values()
    settings = {key: getattr(spec, key) for key in spec.model_fields_set if key not in ("version", "rules", "extends")}
    merged_spec = parent.spec.model_copy(update={**settings, "rules": {rule.pattern: rule.spec for rule in merged}, "extends": None})
    return Plan(merged_spec, merged, file, source)


def _validate_rule(pattern: str, value: Any) -> StyleSpec | None:
    """One rule on its own, when another part of the plan failed validation, so that
    its cross-field problems are reported too. Goes through PlanSpec's validator:
    a separate one for a lone rule would cost start-up time on every run."""
    try:
        return PlanSpec.model_validate({"version": 1, "rules": {pattern: value}}).rules[pattern]
    except ValidationError:
        return None


def _kind(value: Any) -> str:
    kinds = {list: "list", dict: "mapping", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _data_path(loc: tuple, data: Any) -> tuple:
    """The part of a pydantic location that exists in the data (drops union tags and '[key]')."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and part not in node:
            # pydantic writes keys other than str/int as str(key) (None -> 'None')
            part = next((key for key in node if str(key) == part), part)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            continue
        path.append(part)
    return tuple(path)


def _model_at(path: tuple, data: Any) -> type[BaseModel] | None:
    if path == ():
        return PlanSpec
    if path == ("mesh",):
        return MeshSpec
    if len(path) == 2 and path[0] == "rules":
        value = data["rules"][path[1]]
        return STYLE_SPECS.get(value.get("style")) if isinstance(value, dict) else None
    return None


def _quoted(text) -> str:
    """The plan's own word in quotes; Python's repr when it holds a line break or other
    unprintable character (a message is one line)."""
    text = str(text)
    return f"'{text}'" if text.isprintable() else repr(text)


def _where(path: tuple) -> str:
    if len(path) >= 2 and path[0] == "rules":
        return f" in rule {_quoted(path[1])}"
    return f" in {_quoted('.'.join(map(str, path)))}" if path else " at the top level"


def _did_you_mean(word: Any, choices: list[str]) -> str:
    from difflib import get_close_matches  # error path only: keep start-up lean

    close = get_close_matches(str(word), choices, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _other_tools_name(style: str) -> str | None:
    from .aliases import suggestion  # error path only

    return suggestion(style)


def _schema_problem(err: dict, data: dict, source: SourceMap) -> Problem:
    kind, loc = err["type"], err["loc"]
    path = _data_path(loc, data)
    file = source.file

    if kind == "extra_forbidden":
        model = _model_at(path[:-1], data)
        allowed = [f for f in model.model_fields if f != "style"] if model else []
        key = path[-1]
        message = f"unknown key {_quoted(key)}{_where(path[:-1])}{_did_you_mean(key, allowed)}"
        if model is not None and model in STYLE_SPECS.values():
            message += f" (options of {data['rules'][path[1]]['style']}: {', '.join(allowed) or 'none'})"
        return error("TP100", message, file, *source.locate(path, key=True))
    if kind == "union_tag_invalid":
        style = err["ctx"]["tag"]
        at = path + ("style",) if isinstance(data["rules"][path[1]], dict) else path
        other_tool = _other_tools_name(style)
        hint = f"; {other_tool}" if other_tool else _did_you_mean(style, list(STYLE_NAMES))
        return error(
            "TP103",
            f"unknown style {_quoted(style)}{_where(path)}{hint} (styles: {', '.join(STYLE_NAMES)})",
            file, *source.locate(at),
        )
    if kind == "string_pattern_mismatch" and path[-1:] == ("style",):
        return error(
            "TP103",
            f"style {err['input']!r}{_where(path[:-1])} names no style: write a style name ({', '.join(STYLE_NAMES)}) "
            "or a ParallelStyle class as PKG.MOD:Class",
            file, *source.locate(path),
        )
    if kind == "union_tag_not_found" and isinstance(err["input"], dict):
        return error("TP102", f"rule '{path[1]}' needs a 'style:' key (one of {', '.join(STYLE_NAMES)})", file, *source.locate(path))
    if kind == "missing":
        return error("TP102", f"missing required key '{loc[-1]}'{_where(path)}", file, *source.locate(path, key=True))
    if loc and loc[0] == "version":
        return error("TP106", f"unsupported plan version {err['input']!r}: this tpplan reads 'version: 1'", file, *source.locate(path))
    if kind == "value_error":  # only placements raise ValueError
        return error("TP104", err["msg"].removeprefix("Value error, "), file, *source.locate(path))
    if "[key]" in loc:
        key = err["input"]
        if path[:-1] == ("rules",):
            what = "rule keys are module-path globs"
        else:
            what = f"keys of '{path[-2]}' are argument names" if len(path) >= 2 else "keys are names"
        return error("TP101", f"{what} (strings), not {_kind(key)} {key!r}", file, *source.locate(path, key=True))
    if len(path) == 2 and path[0] == "rules":
        return error("TP101", f"rule '{path[1]}' must be a style name or a mapping with 'style:', not {_kind(err['input'])}", file, *source.locate(path))
    last_key = max((i for i, p in enumerate(path) if isinstance(p, str)), default=0)
    field = "".join([str(path[last_key]) if path else "plan", *(f"[{i}]" for i in path[last_key + 1 :])])
    message = f"'{field}'{_where(path[:last_key])}: {err['msg'][0].lower()}{err['msg'][1:]}, got {err['input']!r}"
    return error("TP101", message, file, *source.locate(path))
