"""The layout's rules, checked on the source: the plan core and the CLI never
import torch, and no two modules of tpplan/ import each other, lazy imports
(inside functions) and type-only ones included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpplan"

# Known cycles, each the sorted set of its modules; none today, and a listed cycle
# that is gone must leave the list too.
ALLOWED_CYCLES: list[list[str]] = []


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the tpplan modules it imports anywhere in its source (top level,
    functions, and `if TYPE_CHECKING:` blocks: a type named from a module is a
    dependency for the reader as much as a call). `from pkg import name` counts as importing
    `pkg.name` when that is a module, else `pkg`. Implicit imports of parent
    packages are not edges: every `import a.b` runs `a/__init__.py`, a cycle of
    Python's making, not ours."""
    names = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                candidates = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in names else prefix for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in names:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_between_modules_lazy_imports_included():
    found = cycles(import_graph())
    assert [c for c in found if c not in ALLOWED_CYCLES] == []
    # An allowlisted cycle that is gone must leave the list too.
    assert [c for c in ALLOWED_CYCLES if c not in found] == []


def test_the_cycle_finder_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "tpplan.core.loader" in graph["tpplan.cli.validate"]  # imported inside the command
    assert "tpplan.cli.output" in graph["tpplan.cli.apply"]  # `from .output import ...`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_and_cli_modules_import_without_torch():
    modules = sorted(name for name in module_names() if name.startswith(("tpplan.core", "tpplan.cli")))
    assert "tpplan.core.schema" in modules and "tpplan.cli.apply" in modules
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"



# Which layers each layer may import (docs/layout.md's table, which
# test_the_layout_table_says_what_this_test_checks holds to this). A layer is a folder
# of tpplan/ or a sub-package listed here ("checkpoint.training"); what it may import
# is layers, or single modules ("checkpoint.errors").
# cli/, docs.py and __main__ sit on top and may import anything.
MAY_IMPORT = {
    "core": {"core"},
    "sharding": {"core"},
    "checkpoint": {"core", "checkpoint.training"},  # torch.distributed.checkpoint on any model; its codes' docs need no torch
    # The training loop's side (step roots, retention, async saves, the crash-safe commit,
    # completeness): knows no model or plan, so of the checkpoint package its errors alone.
    "checkpoint.training": {"checkpoint.errors"},
    # The substrate the dry run, the lint, init and checkpoint simulation share: the fake
    # world, the ladder, model building (hf.build: `--model hf:SPEC`), located runs.
    "simulation": {"core", "sharding", "checkpoint", "hf"},
    "check": {"core", "sharding", "checkpoint", "simulation"},  # the --check engine: a run against one device (CP's batches cut by sharding)
    "memory": {"core", "simulation", "sharding"},  # memory planning: one step under MemTracker, blocks once (a CP rank's sequence cut)
    "runtime": {"core", "sharding", "checkpoint", "simulation", "check", "memory"},  # orchestration: the dry run, torchrun
    "fitting": {"core", "simulation", "memory", "runtime", "sharding", "lint", "init"},  # tpplan fit: layouts, their dry runs, FLOPs, the cost model; the lint's TP127 message and init's rules
    "render": {"core", "simulation", "memory", "runtime", "init"},  # the reports' data, which render prints
    "lint": {"core", "sharding", "simulation", "runtime", "checkpoint"},  # checkpoint.errors: the TP6xx docs
    "hf": {"core", "sharding"},
    "init": {"core", "sharding", "simulation", "runtime", "lint", "hf"},  # tpplan init: infers, lints, dry-runs, compares with transformers' plan
    "interop": {"core"},  # other frameworks' configs: export and import-config, plan-side, no torch
    "models": set(),  # the reference models: model code, importing no tpplan module
}
# The one way down a layer: Plan.apply, Plan.resolve and Plan.pipeline_stages (SPEC §5's API) call
# the applier, lazily (and name the styles' type for their annotations).
ALLOWED_EDGES = {
    ("tpplan.core.plan", "tpplan.sharding.apply"),
    ("tpplan.core.plan", "tpplan.sharding.pipeline"),
    ("tpplan.core.plan", "tpplan.sharding.styles"),
}


def _layer(module: str) -> str:
    """The layer of a module: the deepest sub-package of it MAY_IMPORT lists, else its folder."""
    parts = module.split(".")[1:]
    for depth in range(len(parts), 1, -1):
        if ".".join(parts[:depth]) in MAY_IMPORT:
            return ".".join(parts[:depth])
    return parts[0] if parts else module


def _may_import(module: str, target: str) -> bool:
    allowed = MAY_IMPORT[_layer(module)] | {_layer(module)}
    return _layer(target) in allowed or target.partition(".")[2] in allowed


def test_each_layer_imports_only_the_layers_below_it():
    crossings = sorted(
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if _layer(module) in MAY_IMPORT
        and not _may_import(module, target)
        and (module, target) not in ALLOWED_EDGES
    )
    assert crossings == []
    assert set(MAY_IMPORT) >= {_layer(m) for m in module_names() if _layer(m) not in ("cli", "docs", "__main__", "__init__", "tpplan")}


def test_a_sub_package_listed_is_a_layer_of_its_own():
    assert _layer("tpplan.checkpoint.training.steps") == "checkpoint.training"
    assert _layer("tpplan.checkpoint.load") == "checkpoint"
    assert _may_import("tpplan.checkpoint.load", "tpplan.checkpoint.training.state")
    assert _may_import("tpplan.checkpoint.training.commit", "tpplan.checkpoint.errors")
    assert not _may_import("tpplan.checkpoint.training.commit", "tpplan.checkpoint.load")  # upward: the plan's I/O
    assert not _may_import("tpplan.runtime.dryrun", "tpplan.checkpoint.training.steps")  # through checkpoint's API only


def test_the_substrate_sits_below_what_uses_it():
    # the lint and init run models through the substrate; it knows none of them, nor the dry run
    assert _may_import("tpplan.lint.context", "tpplan.simulation.ladder")
    assert _may_import("tpplan.init.prove", "tpplan.simulation.modelref")
    for above in ("tpplan.lint.checks", "tpplan.init.prove", "tpplan.runtime.dryrun", "tpplan.check.verify", "tpplan.memory.memory"):
        assert not _may_import("tpplan.simulation.simulate", above)
    assert not _may_import("tpplan.check.verify", "tpplan.runtime.report")
    assert not _may_import("tpplan.memory.memory", "tpplan.runtime.dryrun")


def _layout_table() -> dict[str, set[str]]:
    """docs/layout.md's "may import" column: {layer: the layers it names in backticks}."""
    import re

    names = set(MAY_IMPORT).union(*MAY_IMPORT.values())
    table = {}
    for row in (PACKAGE.parent / "docs" / "layout.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if not row.startswith("| `tpplan/") or len(cells) != 3:
            continue
        named = set(re.findall(r"`([a-z_.]+)`", cells[2]))
        for folder in re.findall(r"`tpplan/([a-z_/]+?)(?:/|\.py)`", cells[0]):
            layer = folder.replace("/", ".")
            if layer in MAY_IMPORT:
                table[layer] = named & names
    return table


def test_the_layout_table_says_what_this_test_checks():
    assert _layout_table() == MAY_IMPORT
