"""The inferred plan as YAML: globs over repeated layers, one comment per rule group.

Rules come per module (`model.layers.3.mlp.up_proj`). A module's rule becomes its
glob's (`model.layers.*.mlp.up_proj`) when every module the glob matches has the
same rule; siblings with one value share a line (`{q_proj,k_proj,v_proj}`). Each
run of lines from one inferred group gets the group's note as a comment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.yamltext import yaml_flow, yaml_scalar


def generalized(rules: dict[str, tuple[Any, str]], names: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """{module fqn: (value, note)} -> {key: (value, note)}, keys as globs where they can be,
    in module order."""
    from ..core.globs import ModuleTree, compile_glob, generalize

    order = {name: i for i, name in enumerate(names)}
    tree = ModuleTree(names)
    out: dict[str, tuple[Any, str, int]] = {}
    for fqn, (value, note) in sorted(rules.items(), key=lambda item: order[item[0]]):
        glob = generalize(fqn)
        if glob in out:
            continue
        matched = tree.match(compile_glob(glob))
        same = all(m in rules and rules[m][0] == value for m in matched)
        key = glob if same else fqn
        if key not in out:
            out[key] = (value, note, order[fqn])
    grouped: dict[tuple, list[str]] = {}
    for key, (value, note, _) in out.items():
        parent, _, leaf = key.rpartition(".")
        grouped.setdefault((parent, repr(value), note), []).append(key)
    result: list[tuple[int, str, Any, str]] = []
    for (parent, _, note), keys in grouped.items():
        value, _, first = out[keys[0]]
        leaves = [k.rpartition(".")[2] for k in keys]
        tail = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        result.append((first, f"{parent}.{tail}" if parent else tail, value, note))
    return {key: (value, note) for _, key, value, note in sorted(result, key=lambda r: r[0])}


def render(name: str, description: str, sizes: Sequence[int], rules: dict[str, tuple[Any, str]], *,
           header: Sequence[str] = (), footer: Sequence[str] = (), loss_parallel: bool = False) -> str:
    """Plan YAML (SPEC §2): `rules` as {key: (value, note)}; a note is written once before
    the lines it explains."""
    lines = [*header, "version: 1", f"name: {yaml_scalar(name)}", f"description: {yaml_scalar(description)}",
             "mesh:", "  axis: tp", f"  sizes: {yaml_flow(list(sizes))}"]
    if loss_parallel:
        lines.append("loss_parallel: true")
    lines.append("rules:" if rules else "rules: {}")
    last_note = None
    for key, (value, note) in rules.items():
        if note and note != last_note:
            lines.append(f"  # {note}")
        last_note = note
        lines.append(f"  {yaml_scalar(key)}: {yaml_flow(value)}")
    lines += [f"# {line}" if line else "#" for line in footer]
    return "\n".join(lines) + "\n"
