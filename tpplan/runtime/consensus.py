"""Plan consensus: before any sharding, every rank of a torchrun job tells the
others its plan (fingerprint and content), its model's structure and its errors;
any difference stops every rank with one problem that says what differs (TP503)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..core.plan import Plan
from ..core.problems import Problem, error, first_line
from ..core.yamltext import yaml_flow
from ..simulation.comm import CommFailure
from ..simulation.modelref import structure_hash


def plan_summary(plan: Plan) -> dict:
    return {
        "file": plan.file,
        "fingerprint": plan.fingerprint(),
        "settings": plan.spec.model_dump(mode="json", exclude={"rules", "name", "description"}),
        "rules": [
            {"pattern": r.pattern, "spec": r.spec.model_dump(mode="json", exclude_defaults=True), "line": r.line, "column": r.column}
            for r in plan.rules
        ],
    }


def rank_state(rank: int, plan: Plan | None, structure: list | None, problems: list[Problem], usage: Any = None) -> dict:
    """What a rank tells the others before any sharding (pickled): `usage` is its
    usage error (an exception, or its text), if any."""
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "plan": plan_summary(plan) if plan is not None else None,
        "structure": structure,
        "structure_hash": structure_hash(structure) if structure is not None else None,
        "problems": [p.to_dict() for p in problems],
        "usage": usage,
    }


def _groups(states: list[dict], key: Callable[[dict], Any]) -> list[tuple[Any, list[int]]]:
    """Ranks grouped by `key(state)`, rank 0's group first."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for state in states:
        value = key(state)
        groups.setdefault(repr(value), (value, []))[1].append(state["rank"])
    return list(groups.values())


def _ranks_namer(states: list[dict]) -> Callable[[list[int]], str]:
    hosts = {s["rank"]: s["host"] for s in states}

    def ranks_text(ranks: list[int]) -> str:
        text = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        # Across nodes, plan files are per-node copies: the host is the clue.
        if len(set(hosts.values())) > 1:
            text += " on " + ", ".join(sorted({hosts[r] for r in ranks}))
        return text

    return ranks_text


def usage_errors(states: list[dict]) -> list[tuple[str | None, Any]]:
    """The usage errors of the ranks, each with the ranks that had it (None when
    every rank had the same one: naming them adds nothing)."""
    ranks_text = _ranks_namer(states)
    groups = _groups(states, lambda s: s["usage"])
    everywhere = len(groups) == 1
    return [(None if everywhere else ranks_text(ranks), found) for found, ranks in groups if found]


def disagreements(states: list[dict]) -> tuple[list[str], list[Problem]]:
    """(usage errors, problems) that stop every rank before sharding: errors any
    rank had, and any difference in plan or model between ranks."""
    ranks_text = _ranks_namer(states)
    usage = [f"{ranks}: {found}" if ranks else str(found) for ranks, found in usage_errors(states)]
    if usage:
        return usage, []
    problems: list[Problem] = []
    groups = _groups(states, lambda s: s["problems"])
    for found, ranks in groups:
        for p in found:
            prefix = f"on {ranks_text(ranks)}: " if len(groups) > 1 else ""
            problems.append(Problem(p["code"], p["severity"], prefix + p["message"], p["file"], p["line"], p["column"]))
    if problems:
        return [], problems

    by_rank = {s["rank"]: s for s in states}
    (_, base_ranks), *others = _groups(states, lambda s: s["plan"]["fingerprint"])
    base = by_rank[base_ranks[0]]["plan"]
    for _, ranks in others:
        other = by_rank[ranks[0]]["plan"]
        differences, line, column = _plan_differences(base, other, ranks_text(base_ranks), ranks_text(ranks))
        problems.append(error(
            "TP503",
            f"the ranks hold different plans: {ranks_text(base_ranks)} {base['file']} (fingerprint {base['fingerprint']}), "
            f"{ranks_text(ranks)} {other['file']} (fingerprint {other['fingerprint']}): {'; '.join(at_most(differences, 4))}; "
            "every rank must load the same plan",
            base["file"],
            line,
            column,
        ))
    (_, base_ranks), *others = _groups(states, lambda s: s["structure_hash"])
    for _, ranks in others:
        differences = _structure_differences(
            by_rank[base_ranks[0]]["structure"], by_rank[ranks[0]]["structure"], ranks_text(base_ranks), ranks_text(ranks)
        )
        problems.append(error(
            "TP503",
            f"the ranks built different models: {'; '.join(at_most(differences, 4))}; the factory must build the same model on every rank",
            base["file"],
        ))
    return [], problems


def _plan_differences(a: dict, b: dict, a_ranks: str, b_ranks: str) -> tuple[list[str], int, int]:
    """What differs between two plan summaries, and where (in `a`) the first rule that differs is."""
    found = []
    for key in sorted(set(a["settings"]) | set(b["settings"])):
        if a["settings"].get(key) != b["settings"].get(key):
            found.append(f"{key} is {yaml_flow(a['settings'].get(key))} on {a_ranks} but {yaml_flow(b['settings'].get(key))} on {b_ranks}")
    a_rules, b_rules = {r["pattern"]: r for r in a["rules"]}, {r["pattern"]: r for r in b["rules"]}
    first: tuple[int, int] | None = None
    for pattern, rule in a_rules.items():
        if pattern not in b_rules:
            found.append(f"rule '{pattern}' only on {a_ranks}")
        elif b_rules[pattern]["spec"] != rule["spec"]:
            found.append(f"rule '{pattern}' is {_spec_text(rule['spec'])} on {a_ranks} but {_spec_text(b_rules[pattern]['spec'])} on {b_ranks}")
        else:
            continue
        first = first or (rule["line"], rule["column"])
    found += [f"rule '{pattern}' only on {b_ranks}" for pattern in b_rules if pattern not in a_rules]
    return found, *(first or (1, 1))


def _spec_text(spec: dict) -> str:
    """As the plan would spell it: `{style: rowwise, output_layouts: shard(1)}`."""
    options = {k: v for k, v in spec.items() if k != "style"}
    if not options:
        return spec["style"]
    return "{" + ", ".join(f"{k}: {yaml_flow(v)}" for k, v in {"style": spec["style"], **options}.items()) + "}"


def _structure_differences(a: list, b: list, a_ranks: str, b_ranks: str) -> list[str]:
    """Modules missing or of another class first (the likely cause), then parameter shapes."""
    a_modules, b_modules = {m[0]: m for m in a}, {m[0]: m for m in b}
    modules, params = [], []
    for name, (_, kind, own) in a_modules.items():
        other = b_modules.get(name)
        shown = name or "<root>"
        if other is None:
            modules.append(f"module '{shown}' ({kind}) only on {a_ranks}")
        elif other[1] != kind:
            modules.append(f"module '{shown}' is {kind} on {a_ranks} but {other[1]} on {b_ranks}")
        elif other[2] != own:
            params.append(f"'{shown}' has {_param_text(own)} on {a_ranks} but {_param_text(other[2])} on {b_ranks}")
    modules += [f"module '{name}' ({m[1]}) only on {b_ranks}" for name, m in b_modules.items() if name not in a_modules]
    return modules + params


def at_most(found: list[str], n: int) -> list[str]:
    return found[:n] + ([f"and {len(found) - n} more"] if len(found) > n else [])


def _param_text(params: list) -> str:
    return ", ".join(f"{key} {tuple(shape)} {dtype}" for key, shape, dtype in params) or "none"


def gather_states(state: dict, group: Any, timeout: float) -> list[dict]:
    """Every rank's state, or a CommFailure naming the ranks that did not arrive."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    try:
        if dist.get_backend(group) == "gloo":
            # Names the ranks that never arrive instead of one anonymous timeout.
            dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        states: list[Any] = [None] * world
        dist.all_gather_object(states, state, group=group)
    except RuntimeError as exc:
        raise CommFailure(error(
            "TP504",
            f"rank {state['rank']}: plan consensus failed within {timeout:g} s: {first_line(exc)}; "
            "a rank that dies or hangs before it loads the plan and builds the model stops all others",
            state["plan"]["file"] if state["plan"] else "<plan>",
        )) from None
    return states

