"""A copy of the model with runs of identical blocks cut to two, for the dry run.

A 1,000-layer model costs as much to simulate as its layers; the plan treats
them all alike, so two consecutive ones show every layout a layer receives and
hands on. A ModuleList (or ModuleDict) is cut only when the traced forward
called each of its children once, in order (layers, not experts picked by a
router), and blocks count as identical when their structure (block identity:
simulation/blocks.py, the trace's `Structures`) and the rules that match inside
them do (two rules with the same style and options count as one). The kept
blocks keep their names, so problems name real modules; rules that match only
in cut blocks are left out of the simulated plan.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from typing import TYPE_CHECKING

from ..simulation.blocks import only_children, runs

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan, Rule
    from .trace import Trace


def _call_order(trace: "Trace") -> dict[str, list[str]]:
    """{module: the names of its children, in the order the forward called them}."""
    from .trace import Call

    order: dict[str, list[str]] = defaultdict(list)
    for event in trace.events:
        if isinstance(event, Call) and event.fqn:
            parent, _, key = event.fqn.rpartition(".")
            order[parent].append(key)
    return order


def _rules_by_child(matched: "dict[str, Rule]", containers) -> dict[str, dict[str, list]]:
    """{container: {child: [(path inside it, what its rule does)]}}: by meaning, not by
    pattern, so blocks that two rules with equal styles cover count as identical.
    One pass over the matched modules: each one is filed under its container ancestors."""
    meaning: dict[int, str] = {}
    inside: dict[str, dict[str, list]] = {fqn: defaultdict(list) for fqn in containers}
    for name, rule in matched.items():
        parent, rest = name, ""
        while parent:
            parent, _, key = parent.rpartition(".")
            children = inside.get(parent)
            if children is not None:
                if id(rule) not in meaning:
                    meaning[id(rule)] = rule.spec.model_dump_json()
                children[key].append((rest, meaning[id(rule)]))
            rest = f"{key}.{rest}" if rest else key
    return inside


def kept_blocks(trace: "Trace | None", matched: "dict[str, Rule]", modules: "dict[str, nn.Module]") -> list[tuple["nn.Module", dict]]:
    """(container, the children it keeps) for each container worth cutting, from the
    traced forward and the plan's {fqn: rule} (`ctx.kept_blocks` computes it once)."""
    from torch import nn

    if trace is None:
        return []
    order = _call_order(trace)
    containers = {
        fqn: module for fqn, module in modules.items()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module._modules) >= 3
        and order.get(fqn) == list(module._modules)
    }
    rules = _rules_by_child(matched, containers)
    structures = trace.structures
    cuts = []
    for fqn, module in containers.items():
        children = list(module._modules.items())
        identities = [(structures.of(child), tuple(rules[fqn].get(key, ()))) for key, child in children]
        kept = {key: child for run in runs(identities) for key, child in children[run.start:run.start + 2]}
        if len(kept) < len(children):
            cuts.append((module, kept))
    return cuts


def collapsed_copy(model: "nn.Module", cuts: list[tuple["nn.Module", dict]]) -> "nn.Module":
    """A deep copy of `model` (to shard), with each container of `cuts` (kept_blocks)
    keeping only its kept children."""
    with contextlib.ExitStack() as stack:
        for module, kept in cuts:
            stack.enter_context(only_children(module, kept.__contains__))
        return copy.deepcopy(model)


def plan_for(plan: "Plan", model: "nn.Module") -> "Plan":
    """`plan` without the rules that match nothing in the collapsed `model`."""
    from ..core.plan import Plan

    tree, under = plan.module_tree(model)
    rules = [rule for rule in plan.rules if tree.match(rule.glob, under)]
    if len(rules) == len(plan.rules):
        return plan
    return Plan(plan.spec, rules, plan.file)
