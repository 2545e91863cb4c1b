"""Plan YAML as `import_hf` writes it: one line per rule, siblings with one value grouped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any


def group_siblings(rules: Mapping[str, Any]) -> dict[str, Any]:
    """`a.q_proj`, `a.k_proj`, `a.v_proj` with one value -> `a.{q_proj,k_proj,v_proj}`."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    order: list[tuple[str, str]] = []
    for key, value in rules.items():
        parent, _, leaf = key.rpartition(".")
        group = (parent, repr(value))
        if group not in groups:
            order.append(group)
        groups[group].append(leaf)
    out = {}
    for parent, value_repr in order:
        leaves = groups[(parent, value_repr)]
        value = rules[f"{parent}.{leaves[0]}" if parent else leaves[0]]
        tail = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        out[f"{parent}.{tail}" if parent else tail] = value
    return out


def render_plan(name: str, description: str, sizes: list[int], rules: Mapping[str, Any], header: list[str]) -> str:
    """Plan YAML (SPEC §2) with one line per rule: shorthand or a flow mapping."""
    from ..core.yamltext import yaml_flow as flow, yaml_scalar as scalar

    lines = [*header, "version: 1", f"name: {scalar(name)}", f"description: {scalar(description)}"]
    lines += ["mesh:", "  axis: tp", f"  sizes: {flow(sizes)}", "rules:"]
    lines += [f"  {scalar(key)}: {flow(value)}" for key, value in rules.items()] or ["  {}"]
    return "\n".join(lines) + "\n"
