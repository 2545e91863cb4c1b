"""Plan text -> Plan, with every problem located at its file:line:col."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ValidationError

from .globs import GlobSyntaxError, compile_glob
from .plan import Plan, Rule
from .problems import PlanError, Problem, error
from .sections import glob_syntax_problems
from .schema import EXPERT_STYLES, STYLE_NAMES, STYLE_SPECS, PlanSpec, StyleSpec, plan_spec_for
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
    return read_text(path)


def read_text(path: str | os.PathLike, code: str = "TP001", noun: str = "plan", kind: str = "a YAML plan") -> str:
    """The text of a file tpplan reads (a plan; `tpplan import-config`'s config, with its
    own code and noun): unreadable, binary or not UTF-8 is `code` at the file, or at the
    first bad byte's line and column."""
    file = str(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise PlanError([error(code, f"cannot read the {noun}: {exc.strerror or exc}", file)]) from None
    if b"\0" in raw:
        raise PlanError([error(code, f"this is a binary file, not {kind}", file)])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8-sig")  # valid up to the bad byte; columns count characters
        line, column = text_position(before, len(before))
        raise PlanError([error(code, f"the {noun} is not UTF-8 text (byte 0x{raw[exc.start]:02x})", file, line, column)]) from None


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
    spec_class = plan_spec_for(data)
    try:
        spec = spec_class.model_validate(data)
    except ValidationError as exc:
        problems += [_schema_problem(err, data, source) for err in exc.errors()]
    extends = data.get("extends")
    rules, deleted = _section_rules("rules", data, spec, source, problems)
    if spec_class is not PlanSpec:
        _section_rules("experts", data, spec, source, problems)
        if spec is not None:
            problems += glob_syntax_problems(spec, source)
        if spec is not None and not problems:
            from .axes import load_problems

            problems += load_problems(spec, source)
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


def _section_rules(section: str, data: dict, spec: Any, source: SourceMap, problems: list[Problem]) -> tuple[list[Rule], list]:
    """The rules of `section` ("rules", or version 2's "experts", whose rules name an expert
    style), their glob and cross-field problems appended to `problems`; and the null rules
    (deletions of inherited ones, "rules" only) as (pattern, line, column)."""
    file = source.file
    raw = data.get(section) if isinstance(data.get(section), dict) else {}
    rules, deleted = [], []
    for pattern, value in raw.items():
        if not isinstance(pattern, str):
            continue  # reported by the schema
        line, column = source.locate((section, pattern), key=True)
        if value is None and section == "rules":
            if data.get("extends") is None:  # null deletes an inherited rule: there is none here
                problems.append(error(
                    "TP101", f"rule '{pattern}' must be a style name or a mapping with 'style:', not null",
                    file, *source.locate((section, pattern)),
                ))
            deleted.append((pattern, line, column))
            continue
        try:
            glob = compile_glob(pattern)
        except GlobSyntaxError as exc:
            shift = exc.offset + (1 if (section, pattern) in source.quoted_keys else 0)
            problems.append(error("TP110", f"bad glob '{pattern}': {exc}", file, line, column + shift))
            continue
        rule_spec = getattr(spec, section)[pattern] if spec else _validate_rule(pattern, value)
        if rule_spec is None:
            continue  # reported by the schema
        for subpath, message in rule_spec.cross_field_problems():
            path = (section, pattern, *subpath)
            problems.append(error("TP105", f"rule '{pattern}': {message}", file, *source.locate(path, key=len(subpath) == 1)))
        if section == "experts" and rule_spec.style not in EXPERT_STYLES:
            at = (section, pattern, "style") if isinstance(value, dict) else (section, pattern)
            problems.append(error(
                "TP103", f"experts rule '{pattern}' names style '{rule_spec.style}': the experts section places experts "
                f"over the ep axis with {' or '.join(EXPERT_STYLES)}; put other styles under 'rules'",
                file, *source.locate(at),
            ))
        rules.append(Rule(pattern, rule_spec, glob, file, line, column))
    return rules, deleted


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
    update = {**settings, "rules": {rule.pattern: rule.spec for rule in merged}, "extends": None}
    if parent.spec.version == spec.version:
        return Plan(parent.spec.model_copy(update=update), merged, file, source)
    if spec.version < parent.spec.version:
        raise PlanError([error("TP107", f"a version {spec.version} plan cannot extend {parent.file}, a version "
                               f"{parent.spec.version} plan: its sections would be lost; make this plan version {parent.spec.version}",
                               file, *source.locate(("extends",)))])
    # a version 2 plan extending a version 1 plan: the parent's settings both versions share, and
    # its promised TP degrees as mesh.tp where this plan does not give one
    shared = {key: getattr(parent.spec, key) for key in parent.spec.model_fields_set
              if key in ("src_data_rank", "loss_parallel") and key not in spec.model_fields_set}
    if parent.spec.mesh.sizes and "tp" not in spec.mesh.model_fields_set:
        update["mesh"] = spec.mesh.model_copy(update={"tp": list(parent.spec.mesh.sizes)})
    return Plan(spec.model_copy(update={**shared, **update}), merged, file, source)


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


_RULE_SECTIONS = ("rules", "experts")  # mappings of module-path globs to style rules


def _model_at(path: tuple, data: Any) -> type[BaseModel] | None:
    """The spec class of the mapping at `path`: the plan's version's, a section's, a rule's style's."""
    if len(path) == 2 and path[0] in _RULE_SECTIONS:
        value = data[path[0]][path[1]]
        return STYLE_SPECS.get(value.get("style")) if isinstance(value, dict) else None
    model: Any = plan_spec_for(data)
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = _model_class(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`X`, `X | None`)."""
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((cls for cls in map(_model_class, get_args(annotation)) if cls is not None), None)


def _quoted(text) -> str:
    """The plan's own word in quotes; Python's repr when it holds a line break or other
    unprintable character (a message is one line)."""
    text = str(text)
    return f"'{text}'" if text.isprintable() else repr(text)


def _where(path: tuple) -> str:
    if len(path) >= 2 and path[0] in _RULE_SECTIONS:
        return f" in {'experts ' if path[0] == 'experts' else ''}rule {_quoted(path[1])}"
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
            message += f" (options of {data[path[0]][path[1]]['style']}: {', '.join(allowed) or 'none'})"
        return error("TP100", message, file, *source.locate(path, key=True))
    if kind == "union_tag_invalid":
        style = err["ctx"]["tag"]
        at = path + ("style",) if isinstance(data[path[0]][path[1]], dict) else path
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
        return error("TP106", f"unsupported plan version {err['input']!r}: this tpplan reads 'version: 1' and 'version: 2'", file, *source.locate(path))
    if kind == "value_error":  # placements in rules; sizes and sections' values elsewhere
        code = "TP104" if path[:1] in (("rules",), ("experts",)) else "TP101"
        message = err["msg"].removeprefix("Value error, ")
        if code == "TP101":
            message = f"{_quoted('.'.join(map(str, path)))}: {message}"
        return error(code, message, file, *source.locate(path))
    if kind == "literal_error" and path[:1] not in (("rules",), ("experts",)):
        import re  # error path only

        choices = re.findall(r"'([^']*)'", err["ctx"]["expected"])
        hint = _did_you_mean(err["input"], choices) if isinstance(err["input"], str) else ""
        return error("TP101", f"{_quoted('.'.join(map(str, path)))}: {err['input']!r} is not one of {', '.join(choices)}{hint}",
                     file, *source.locate(path))
    if "[key]" in loc:
        key = err["input"]
        if path[:-1] in (("rules",), ("experts",)):
            what = "rule keys are module-path globs"
        else:
            what = f"keys of '{path[-2]}' are argument names" if len(path) >= 2 else "keys are names"
        return error("TP101", f"{what} (strings), not {_kind(key)} {key!r}", file, *source.locate(path, key=True))
    if len(path) == 2 and path[0] in _RULE_SECTIONS:
        return error("TP101", f"rule '{path[1]}' must be a style name or a mapping with 'style:', not {_kind(err['input'])}", file, *source.locate(path))
    last_key = max((i for i, p in enumerate(path) if isinstance(p, str)), default=0)
    field = "".join([str(path[last_key]) if path else "plan", *(f"[{i}]" for i in path[last_key + 1 :])])
    message = f"'{field}'{_where(path[:last_key])}: {err['msg'][0].lower()}{err['msg'][1:]}, got {err['input']!r}"
    return error("TP101", message, file, *source.locate(path))
