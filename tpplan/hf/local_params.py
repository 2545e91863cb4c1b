"""The `local_params` rules `import-hf` writes where transformers runs a module on local
shards (`local_params`) and shards its own parameters by their own entries (the per-head
attention sinks of GraniteSWA, MiMo-V2-Flash, HY-V4)."""

from __future__ import annotations

from typing import Any

NAMES_A_PARAMETER = "names a parameter, not a module: tpplan rules apply styles to modules"


def local_params_rules(rules: dict[str, Any], skipped: list, added: list[tuple[str, str]], model) -> dict[str, Any]:
    """A `local_params` rule for each module transformers runs on local shards (`local_params`)
    whose own parameters have colwise entries (the per-head attention `sinks` of GraniteSWA,
    MiMo-V2-Flash, HY-V4): transformers shards such a parameter by its entry (colwise:
    shard(0), as the heads of the colwise q_proj), which is tpplan's
    `{style: local_params, params: {sinks: shard(0)}}`, on the modules that have them
    (MiMo-V2-Flash's sliding-window layers only: one rule per module when not all do).
    The entries it folds in (importer.Skipped) leave `skipped`."""
    from ..core.globs import ModuleTree, compile_glob

    tree = ModuleTree(name for name, _ in model.named_modules())
    owners = {s.key for s in skipped if s.hf_style == "local_params"}
    found: dict[str, dict[str, str]] = {}
    folded = []
    for entry in skipped:
        owner, _, name = entry.key.rpartition(".")
        if owner in owners and entry.hf_style == "colwise" and entry.reason == NAMES_A_PARAMETER:
            found.setdefault(owner, {})[name] = "shard(0)"
            folded.append(entry)
            added.append((owner, f"lays out {name} (colwise) as shard(0), as transformers does"))
    folded += [s for s in skipped if s.key in found and s.hf_style == "local_params"]
    skipped[:] = [s for s in skipped if s not in folded]
    layouts: dict[str, dict[str, str]] = {}
    for owner, params in found.items():
        names = tree.match(compile_glob(owner))
        having = [n for n in names if set(params) <= set(dict(model.get_submodule(n).named_parameters(recurse=False)))]
        for key in [owner] if having == names else having:
            layouts[key] = params
    out: dict[str, Any] = {}
    for key, value in rules.items():  # each new rule before its module's children
        for owner in [o for o in layouts if _parent_of(o, key) and o not in out]:
            out[owner] = {"style": "local_params", "params": layouts[owner]}
        out[key] = value
    return {**out, **{key: {"style": "local_params", "params": p} for key, p in layouts.items() if key not in out}}


def _parent_of(owner: str, key: str) -> bool:
    """Whether `key`'s modules lie under `owner`'s (a glob, or one module of it: layers.1 under layers.*)."""
    from ..core.globs import generalize

    return key.startswith(owner + ".") or key.startswith(generalize(owner) + ".")
