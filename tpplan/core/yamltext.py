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
