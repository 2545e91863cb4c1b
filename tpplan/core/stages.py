"""A pipeline section's stages against the model's module names (SPEC §8's located
checks that need the model; no torch): what the stages are cut from, and whether
the plan's stages cut it right.

The model is cut between the blocks of its largest module list (a module whose
children are all numbered: `layers`, `model.layers`): the **units** of a pipeline
are those blocks and, around them, the other children of the list's ancestors
(`tok_embeddings`, `norm`, `output`; `model.embed_tokens`, `model.norm`,
`model.rotary_emb`, `lm_head`), in the model's order. A stage is a run of units.
A unit without parameters (a rotary table) is kept in every stage, as torchtitan
and transformers keep the modules a stage's forward still calls; every unit with
parameters is in exactly one stage, and the stages follow the model's order.

`{a..b}` in a path segment is the integers a to b (`layers.{0..9}`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .axes_spec import V_SCHEDULES
from .globs import ModuleTree
from .problems import Problem, error

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")

# A stage module's attribute: the units it dropped, the other stages' (sharding/pipeline.py
# sets it; a checkpoint of the stage leaves their keys to the ranks that hold them).
OTHER_STAGES = "tpplan_other_stages"


def expand(path: str) -> list[str]:
    """Every path `path` names, its `{a..b}` ranges expanded in order; ValueError for a
    range that runs backwards."""
    match = _RANGE.search(path)
    if match is None:
        return [path]
    low, high = int(match.group(1)), int(match.group(2))
    if low > high:
        raise ValueError(f"the range {{{low}..{high}}} runs backwards: write {{{high}..{low}}}")
    head, tail = path[:match.start()], path[match.end():]
    return [found for i in range(low, high + 1) for found in expand(f"{head}{i}{tail}")]


def split_units(tree: ModuleTree) -> tuple[list[str], str | None]:
    """The units the stages are made of, in module order (module docstring), and the
    module list whose blocks they cut between (None: the model has none, each child of
    the root is a unit)."""
    lists = [node for node in _nodes(tree.root) if node.children and all(key.isdigit() for key in node.children)]
    blocks = max(lists, key=lambda node: len(node.children)) if lists else None  # the first of the longest
    ancestors = {blocks.fqn.rsplit(".", i)[0] for i in range(1, blocks.fqn.count(".") + 1)} | {""} if blocks else set()
    units: list[str] = []

    def visit(node) -> None:
        for child in node.children.values():
            if child is blocks:
                units.extend(block.fqn for block in child.children.values())
            elif child.fqn in ancestors:
                visit(child)
            else:
                units.append(child.fqn)

    visit(tree.root)
    return units, blocks.fqn if blocks else None


def _nodes(node) -> list:
    found = [node]
    for child in node.children.values():
        found += _nodes(child)
    return found


def stage_problems(plan: Any, tree: ModuleTree, has_params: Callable[[str], bool]) -> tuple[list[list[str]], list[Problem]]:
    """The stages (each a list of units with parameters, in order) and the problems of a
    version 2 plan's pipeline against `tree`: TP154 an entry naming no unit, TP155 a unit
    in two stages or out of the model's order, TP156 units with parameters in no stage,
    TP157 layers_per_stage that does not make the stages from the blocks."""
    pipe, source = plan.spec.pipeline, plan.source
    units, blocks = split_units(tree)
    if pipe.stages is None:
        return _by_count(plan, units, blocks, has_params)
    known = set(units)
    where: dict[str, tuple[int, tuple]] = {}  # unit -> (its stage, the entry's key)
    problems: list[Problem] = []

    def fail(code: str, key: tuple, message: str) -> None:
        problems.append(error(code, message, plan.file, *source.locate(key)))

    for i, stage in enumerate(pipe.stages):
        for j, entry in enumerate(stage):
            key = ("pipeline", "stages", i, j)
            try:
                paths = expand(entry)
            except ValueError as exc:
                fail("TP154", key, f"pipeline.stages[{i}]: '{entry}': {exc}")
                continue
            for path in paths:
                if path not in known:
                    fail("TP154", key, f"pipeline.stages[{i}]: '{path}' {_not_a_unit(path, tree, units, blocks)}")
                elif path in where:
                    fail("TP155", key, f"pipeline.stages[{i}]: '{path}' is in stage {where[path][0]} already: a module runs in one stage")
                else:
                    where[path] = (i, key)
    last, last_unit = -1, None
    for unit in units:  # the stages in the model's order
        if unit not in where:
            continue
        stage, key = where[unit]
        if stage < last:
            fail("TP155", key, f"pipeline.stages[{stage}]: '{unit}' comes after '{last_unit}' (stage {last}) in the model: "
                                "the stages follow the model's order, each taking the units after the last stage's")
        elif stage > last:
            last, last_unit = stage, unit
        else:
            last_unit = unit
    missing = [unit for unit in units if unit not in where and has_params(unit)]
    if missing and not any(p.code == "TP154" for p in problems):  # a misnamed entry's units are missing: said once, there
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        fail("TP156", ("pipeline", "stages"), f"pipeline.stages: {len(missing)} module(s) with parameters are in no stage: "
                                               f"{shown}; every one runs in exactly one stage (those without parameters run in every stage)")
    stages = [[unit for unit in units if unit in where and where[unit][0] == i] for i in range(len(pipe.stages))]
    return stages, problems


def _not_a_unit(path: str, tree: ModuleTree, units: list[str], blocks: str | None) -> str:
    """Why `path` is no unit, and which are."""
    cut = f"cut between the blocks of {blocks}" if blocks else "cut between the children of the model"
    if path not in tree.order:
        return f"is no module of the model; the stages are made of {', '.join(units[:3])}, ... ({len(units)} units)"
    inside = next((unit for unit in units if path.startswith(unit + ".")), None)
    if inside is not None:
        return f"is inside '{inside}': a stage takes whole units ({cut}); name '{inside}'"
    held = [unit for unit in units if unit.startswith(path + ".") or not path]
    return f"holds {len(held)} units ({held[0]} to {held[-1]}): list the ones of this stage ({cut}, with {{a..b}} ranges)"


def _by_count(plan: Any, units: list[str], blocks: str | None, has_params: Callable[[str], bool]) -> tuple[list[list[str]], list[Problem]]:
    """layers_per_stage: the blocks cut into pp·virtual_stages stages of that many, the
    units before them in the first stage, those after in the last."""
    pipe, pp = plan.spec.pipeline, plan.mesh.sizes["pp"]
    at = plan.source.locate(("pipeline", "layers_per_stage"))
    if blocks is None:
        return [], [error("TP157", "pipeline.layers_per_stage: the model has no module list of blocks to cut; give the stages "
                           "as module lists (stages)", plan.file, *at)]
    count, per = pp * pipe.virtual_stages, pipe.layers_per_stage
    numbered = [unit for unit in units if unit.startswith(blocks + ".")]
    if pp < 1:  # pp takes the rest of the world: the count is known under torchrun
        return [], []
    if len(numbered) != count * per:
        fits = f"layers_per_stage {len(numbered) // count}" if len(numbered) % count == 0 else \
            f"a stage count that divides {len(numbered)}"
        return [], [error("TP157", f"pipeline.layers_per_stage: {len(numbered)} blocks of {blocks} do not make pp·virtual_stages = "
                                   f"{pp}·{pipe.virtual_stages} = {count} stages of {per}: give {fits}", plan.file, *at)]
    first, last = units.index(numbered[0]), units.index(numbered[-1])
    stages = [numbered[i * per:(i + 1) * per] for i in range(count)]
    stages[0] = [u for u in units[:first] if has_params(u)] + stages[0]
    stages[-1] = stages[-1] + [u for u in units[last + 1:] if has_params(u)]
    return stages, []


def rank_stages(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices the pp rank `pp_rank` runs, in the order its schedule takes them:
    pp_rank, then pp_rank + pp·k (looped), or pp_rank and 2·pp − 1 − pp_rank (a V)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that runs stage `stage` (rank_stages' inverse)."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def split_batch(plan: Any, batch: int | None = None) -> tuple[int, int, int]:
    """(the batch each data-parallel rank is given, its microbatches, their size) under a
    version 2 plan's pipeline: `batch` (--batch, or the training section's share of the
    global batch), or by default the plan's microbatches of one sequence each, or
    pp·virtual_stages microbatches of `microbatch_size`. ValueError where the batch does
    not split."""
    pipe = plan.spec.pipeline
    if batch is None:
        batch = pipe.microbatches if pipe.microbatches is not None else pipe.microbatch_size * plan.mesh.sizes["pp"] * pipe.virtual_stages
    count = pipe.microbatches if pipe.microbatches is not None else batch // pipe.microbatch_size
    size = pipe.microbatch_size if pipe.microbatch_size is not None else (batch // count if count else 0)
    if not count or count * size != batch:
        key = "microbatches" if pipe.microbatches is not None else "microbatch_size"
        raise ValueError(f"the batch of {batch} does not split into pipeline.{key} {getattr(pipe, key)}: give a batch that it divides")
    return batch, count, size
