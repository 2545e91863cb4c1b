"""Plan values written back as YAML flow text, as a plan file would spell them:
`null`, `true`, `[2, 4]`, `{style: rowwise, output_layouts: shard(1)}`.

Used where tpplan writes plans (import-hf) and where it quotes a plan's values
in a message (the ranks' plan differences)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    import yaml  # lazily: only writing a plan needs the dumper

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def yaml_flow(value: Any) -> str:
    """`value` (scalars, lists, mappings) as one line of YAML flow style."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {yaml_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_flow(v) for v in value) + "]"
    return yaml_scalar(value)


def group_siblings(rules: Mapping[str, Any]) -> dict[str, Any]:
    """`a.q_proj`, `a.k_proj`, `a.v_proj` with one value -> `a.{q_proj,k_proj,v_proj}`,
    each group where its first key was."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key in rules:
        parent, _, leaf = key.rpartition(".")
        groups.setdefault((parent, repr(rules[key])), []).append(leaf)
    out = {}
    for (parent, _), leaves in groups.items():
        tail = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        out[f"{parent}.{tail}" if parent else tail] = rules[f"{parent}.{leaves[0]}" if parent else leaves[0]]
    return out


def plan_fields(name: str, description: str, sizes) -> dict[str, Any]:
    """The top-level keys of a plan tpplan writes (one `tp` mesh axis)."""
    return {"version": 1, "name": name, "description": description, "mesh": {"axis": "tp", "sizes": list(sizes)}}


def plan_yaml(top: Mapping[str, Any], rules: Mapping[str, Any], *, notes: Mapping[str, str] | None = None,
              header: tuple[str, ...] | list[str] = (), footer: tuple[str, ...] | list[str] = (),
              after: Mapping[str, Any] | None = None) -> str:
    """A plan file (SPEC §2): `header` lines, the top-level keys in order (a mapping one
    key per line), then one line per rule, shorthand or a flow mapping; a rule's note
    (`notes`) is a comment written once before the run of rules it explains; then the
    keys of `after` as `top`'s (version 2's sections); `footer` lines as comments."""
    lines = list(header) + _top_lines(top)
    lines.append("rules:" if rules else "rules: {}")
    last_note = None
    for key, value in rules.items():
        note = (notes or {}).get(key)
        if note and note != last_note:
            lines.append(f"  # {note}")
        last_note = note
        lines.append(f"  {yaml_scalar(key)}: {yaml_flow(value)}")
    lines += _top_lines(after or {})
    lines += [f"# {line}" if line else "#" for line in footer]
    return "\n".join(lines) + "\n"


def _top_lines(top: Mapping[str, Any]) -> list[str]:
    """Top-level keys, a mapping one key per line (its keys quoted where YAML needs it: globs)."""
    lines = []
    for key, value in top.items():
        if isinstance(value, Mapping):
            lines += [f"{key}:", *(f"  {yaml_scalar(k)}: {yaml_flow(v)}" for k, v in value.items())]
        else:
            lines.append(f"{key}: {yaml_flow(value)}")
    return lines
