"""The inferred plan as YAML: globs over repeated layers, one comment per rule group.

Rules come per module (`model.layers.3.mlp.up_proj`). A module's rule becomes its
glob's (`model.layers.*.mlp.up_proj`) when every module the glob matches has the
same rule; siblings with one value share a line (`{q_proj,k_proj,v_proj}`). Each
run of lines from one inferred group gets the group's note as a comment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.yamltext import group_siblings, plan_fields, plan_yaml


def generalized(rules: dict[str, tuple[Any, str]], names: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """{module fqn: (value, note)} -> {key: (value, note)}, keys as globs where they can be,
    in module order."""
    from ..core.globs import ModuleTree, compile_glob, generalize

    order = {name: i for i, name in enumerate(names)}
    tree = ModuleTree(names)
    out: dict[str, tuple[Any, str]] = {}
    for fqn, (value, note) in sorted(rules.items(), key=lambda item: order[item[0]]):
        glob = generalize(fqn)
        if glob in out:
            continue
        matched = tree.match(compile_glob(glob))
        same = all(m in rules and rules[m][0] == value for m in matched)
        key = glob if same else fqn
        out.setdefault(key, (value, note))
    return group_siblings(out)  # in module order; a (value, note) pair groups only with its like


def render(name: str, description: str, sizes: Sequence[int], rules: dict[str, tuple[Any, str]], *,
           header: Sequence[str] = (), footer: Sequence[str] = (), loss_parallel: bool = False) -> str:
    """Plan YAML (SPEC §2): `rules` as {key: (value, note)}; a note is written once before
    the lines it explains."""
    top = plan_fields(name, description, sizes)
    if loss_parallel:
        top["loss_parallel"] = True
    return plan_yaml(top, {key: value for key, (value, _) in rules.items()},
                     notes={key: note for key, (_, note) in rules.items()}, header=header, footer=footer)
