"""Prove a proposal: the lint's edits, then the lint, then the dry run's `--check` at
every degree; a group whose rule fails is dropped (with why) and the rest proven again.

The plan is checked exactly as a user would check the file `init` writes: the
rendered text is loaded with `load_plan` and run by the dry run's own engine
(`runtime.dryrun.dry_run_with`, `check_parity` inside), so `tpplan apply --dry-run
--check` on the written plan gives the verdicts recorded here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.degrees import tp_degrees
from ..core.loader import load_plan
from ..core.problems import PlanError, Problem
from .infer import Group, Proposal, default_degrees, weak_degree
from .render import generalized, render

if TYPE_CHECKING:
    from torch import nn

    from ..runtime.report import ApplyReport

# Where an unlocated failure is blamed, most fragile first.
_KIND_ORDER = ("norm", "head", "embedding", "experts", "pair")
_MAX_ROUNDS = 8


@dataclass
class Dropped:
    rule: str  # the group's first rule's key (a module, or the glob it belongs to)
    why: str
    modules: tuple = ()  # every module the dropped group's rules planned


@dataclass
class Degree:
    degree: int
    rank_bytes: int
    total_bytes: int
    comms: dict
    check: dict | None  # {"passed", "max_abs_diff"}; None when not run with values

    def to_json(self) -> dict:
        return {"rank_bytes": self.rank_bytes, "total_bytes": self.total_bytes, "comms": self.comms, "check": self.check}


@dataclass
class Proven:
    groups: list  # the groups that passed
    degrees: list  # the degrees written into mesh.sizes
    rules: dict  # {key: (value, note)} as rendered
    edits: list  # lint edits applied
    dropped: list = field(default_factory=list)
    results: dict = field(default_factory=dict)  # degree -> Degree
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # a degree asked for that shards little (infer.weak_degree)
    lint_warnings: list = field(default_factory=list)  # the lint's warnings on the written plan (Problem)


@dataclass
class Target:
    """What the proof runs: the model (meta or real, for the lint) and, for the dry run,
    its reference and factory."""

    model: "nn.Module"
    ref: str
    factory: Callable[[], "nn.Module"]
    inputs: str | None = None
    check: bool = True  # with real values (off above the values limit: shapes and collectives only)


def choose_degrees(groups: list[Group], given: Sequence[int] | None, dropped: list[Dropped], total: int = 0,
                   warnings: list | None = None) -> tuple[list[Group], list[int]]:
    """The degrees to prove at and the groups that fit them. Given degrees are kept, a
    group that does not divide one is dropped, and a degree that shards much less than
    the default ones is warned of (`warnings`; `total`: the model's parameters);
    otherwise the default degrees (infer.default_degrees: those that divide the sizes of
    all a degree can shard)."""
    # core/degrees.py's rule; no plan yet (init writes it), and the default the model's own: init
    # writes the plan for this model, so the degrees that shard the most of it
    degrees = tp_degrees(sorted(set(given)) if given else None, None, lambda: default_degrees(groups))
    for degree in degrees if given else ():
        why = weak_degree(groups, degree, total)
        if why is not None and warnings is not None:
            warnings.append(why)
    kept = []
    for group in groups:
        bad = [d for d in degrees if not group.allows(d)]
        if bad:
            dropped.append(Dropped(_first_key(group), f"TP {', '.join(map(str, bad))} does not divide {_sizes(group)}", tuple(group.rules)))
        else:
            kept.append(group)
    return kept, degrees


def _sizes(group: Group) -> str:
    return "its sizes " + ", ".join(map(str, group.sizes()))


def _shape(group: Group) -> tuple:
    from ..core.globs import generalize

    return (group.kind, tuple((generalize(f), repr(v)) for f, v in group.rules.items()))


def _first_key(group: Group) -> str:
    from ..core.globs import generalize

    return generalize(next(iter(group.rules)))


def prove(target: Target, proposal: Proposal, given: Sequence[int] | None, *, name: str, description: str,
          header: Sequence[str] = (), on_event: Callable[[str], None] | None = None) -> tuple[Proven, str]:
    """The proven plan and its YAML text."""
    event = on_event or (lambda text: None)
    dropped: list[Dropped] = []
    warnings: list[str] = []
    total = sum(p.numel() for p in target.model.parameters())
    groups, degrees = choose_degrees(proposal.groups, given, dropped, total, warnings)
    for _ in range(_MAX_ROUNDS + len(groups)):
        rules, edits, text, plan = _lint_fixed(target, groups, degrees, proposal, name, description, header, event)
        results: dict = {}
        blamed, lint_warnings = _lint_blame(target, plan, groups, degrees, rules)
        if not blamed:
            results, failure = dry_runs(target, plan, degrees, event)
            if failure is None:
                break
            degree, problem = failure
            if problem.code == "TP500":
                raise PlanError([problem])  # the model fails on one device: no rule of the plan is the cause
            blamed = [(g, f"TP {degree}: {problem.code}: {problem.message}") for g in _owner_groups(plan, problem, groups, rules)]
            blamed = blamed or _unlocated(groups, problem)
            if not blamed:
                raise PlanError([problem])  # nothing of the plan to blame: the model itself fails
        for group, why in blamed:
            # Blocks alike (the same rules under their globs) fail alike: dropped together.
            for alike in [g for g in groups if _shape(g) == _shape(group)]:
                gathered = alike.gather()  # a pair tries once more with whole activations between its halves
                if gathered is not None:
                    groups[groups.index(alike)] = gathered
                    continue
                groups.remove(alike)
                dropped.append(Dropped(_first_key(alike), why, tuple(alike.rules)))
    return Proven(groups, degrees, rules, edits, dropped, results, warnings=warnings, lint_warnings=lint_warnings), text


def _all_rules(groups: list[Group], degrees: list[int]) -> dict[str, tuple[Any, str]]:
    out = {}
    for group in groups:
        for fqn, value in group.rules_at(degrees).items():
            out[fqn] = (value, group.note_at(degrees))
    return out


def _lint_fixed(target, groups, degrees, proposal, name, description, header, event):
    """The plan with every edit the lint is sure of applied, until it has none left."""
    from ..lint.context import LintContext
    from ..lint.edits import lint_edits, with_options

    names = [n for n, _ in target.model.named_modules()]
    rules = _all_rules(groups, degrees)
    applied = []
    for _ in range(4):
        text = plan_text(rules, names, degrees, proposal, name, description, header)
        plan = load_plan(text=text, file="<init>")
        ctx = LintContext(plan, target.model, degrees, inputs=target.inputs)
        edits = [e for e in lint_edits(ctx) if e not in applied]
        if not edits:
            break
        event(f"lint edits: {', '.join(f'{e.code} {e.key}' for e in edits)}")
        by_pattern = {}
        for fqn, rule in ctx.matched.items():
            by_pattern.setdefault(rule.pattern, []).append(fqn)
        for edit in edits:
            if edit.add:
                rules[edit.key] = (edit.options, f"{edit.why} ({edit.code})")
            else:
                for fqn in by_pattern.get(edit.key, ()):
                    value, note = rules[fqn]
                    if "style" in edit.options:  # the rule becomes another style: its comment says why too
                        note = f"{note}; {edit.why} ({edit.code})" if note else f"{edit.why} ({edit.code})"
                    rules[fqn] = (with_options(value, edit.options), note)
        applied += edits
    return rules, applied, text, plan


def plan_text(rules, names, degrees, proposal, name, description, header) -> str:
    """The plan's YAML for `rules` ({module fqn: (value, note)}), globbed over `names`; loss_parallel
    when asked and the head is still planned."""
    return render(name, description, degrees, generalized(rules, names), header=header,
                  loss_parallel=proposal.loss_parallel and any(f in rules for g in proposal.groups if g.kind == "head" for f in g.rules))


def _owner_groups(plan, problem: Problem, groups: list[Group], rules: dict) -> list[Group]:
    """The groups whose rules the problem is located at (by the rule's line in the rendered plan)."""
    from ..core.globs import ModuleTree

    if problem.line is None or problem.file != plan.file:
        return []  # located elsewhere (the model's own code): no rule's line
    at = [rule for rule in plan.rules if rule.line == problem.line]
    if not at:
        return []
    tree = ModuleTree(list(rules))  # only planned modules: the glob's matches among them
    fqns = set(tree.match(at[0].glob))
    return [g for g in groups if fqns & set(g.rules)] or ([] if not fqns else _added_owner(fqns, groups))


def _added_owner(fqns: set, groups: list[Group]) -> list[Group]:
    """A rule the lint's edits added (local_params on a norm, a parent's prepare_module_input)
    is blamed on the groups inside or beside it: the pair it was added for."""
    out = []
    for group in groups:
        if any(f.startswith(m + ".") or m.rpartition(".")[0] == f.rpartition(".")[0] for m in fqns for f in group.rules):
            out.append(group)
    return out[:1]


def _lint_blame(target, plan, groups, degrees, rules) -> tuple[list[tuple[Group, str]], list[Problem]]:
    """The groups the lint's errors are located at, and the lint's warnings."""
    from ..lint import lint_model, ordered_rules

    codes = [rule.code for rule in ordered_rules() if rule.code != "TP330"]  # the dry run below is that check
    found = lint_model(plan, target.model, degrees, select=codes, inputs=target.inputs)
    problems = [p for p in found if p.severity == "error"]
    warnings = [p for p in found if p.severity != "error"]
    blamed = []
    for problem in problems:
        for group in _owner_groups(plan, problem, groups, rules):
            blamed.append((group, f"{problem.code}: {problem.message}"))
    if problems and not blamed:
        return _unlocated(groups, problems[0]), warnings
    return blamed, warnings


def _unlocated(groups, problem) -> list[tuple[Group, str]]:
    for kind in _KIND_ORDER:
        found = [g for g in groups if g.kind == kind]
        if found:
            return [(g, f"{problem.code} (not located at a rule; {kind} rules dropped first): {problem.message}") for g in found]
    return []


def dry_runs(target, plan, degrees, event) -> tuple[dict, tuple | None]:
    """({degree: its figures}, None) when `plan` passes the dry run (with --check when the
    target allows) at every degree, else ({}, (the degree, its first error))."""
    from ..runtime.dryrun import dry_run_with
    from ..runtime.options import ApplyOptions

    results = {}
    for degree in degrees:
        options = ApplyOptions(plan="<init>", model=target.ref, tp=degree, check=target.check, inputs=target.inputs)
        event(f"dry run at TP {degree}" + (" with --check" if target.check else ""))
        report = dry_run_with(options, plan, target.factory, event)
        errors = [p for p in report.problems if p.severity == "error"]
        if errors:
            return {}, (degree, errors[0])
        results[degree] = _degree(report, degree)
    return results, None


def _degree(report: "ApplyReport", degree: int) -> Degree:
    check = report.check.to_json() if report.check is not None else None
    return Degree(degree, report.per_rank_bytes, report.total_bytes, report.comms or {}, check)
