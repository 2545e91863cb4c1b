"""The module globs of a plan, matched strictly against a model (SPEC §2, and §7 for
version 2's sections): the TP rules, the `experts` rules, `context_parallel.modules`,
`fsdp.units` and `checkpointing.modules`. One matcher for all of them (`claim`): a glob
that matches nothing is TP200 at that glob, a module two globs of one section match is
TP201 at the later glob. `fsdp_units` adds what FSDP2 needs of its units (TP129: innermost
first), and is what `sharding/data_parallel.py` wraps: the check and the apply read one
function.

No torch: the globs are matched against module names (a `ModuleTree`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .globs import Glob, GlobSyntaxError, ModuleTree, compile_glob
from .problems import Problem, error, sort_problems

# The sections whose value is a list of module globs, by their key path in a plan.
LIST_SECTIONS = (("context_parallel", "modules"), ("fsdp", "units"), ("checkpointing", "modules"))
ROOT = ""  # fsdp.units' name of the root module

# Why a module may be claimed once, per section (the fix is always: narrow one of the globs).
_ONCE = {
    "rules": "a module takes one style",
    "experts": "a module takes one style",
    "context_parallel.modules": "context parallelism wraps a module's attention once",
    "fsdp.units": "fully_shard wraps a module once",
    "checkpointing.modules": "a module's activations are recomputed by one wrapper",
}


@dataclass(frozen=True)
class SectionGlob:
    """One glob of a section, where it is written: `index` is its position in the list
    (None for a mapping's key: an experts rule, whose style is `spec`)."""

    section: str  # "experts", "context_parallel.modules", ...
    pattern: str
    glob: Glob
    file: str
    line: int
    column: int
    index: int | None = None
    spec: Any = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def problem(self, code: str, message: str) -> Problem:
        return error(code, message, self.file, self.line, self.column)


def _written(spec: Any, source: Any) -> Iterator[tuple[str, int, str, tuple[int, int]]]:
    """(section, index, pattern, (line, column)) of every glob of the list sections: a
    glob written alone (`modules: layers.*`) is located at that value."""
    for path in LIST_SECTIONS:
        section = getattr(spec, path[0], None)
        patterns = getattr(section, path[1], None) if section is not None else None
        for index, pattern in enumerate(patterns or ()):
            yield ".".join(path), index, pattern, source.locate((*path, index))


def glob_syntax_problems(spec: Any, source: Any) -> list[Problem]:
    """TP110 for a glob of a list section that is no glob (the loader's check: `rules` and
    `experts` keys are checked where they are read)."""
    problems = []
    for section, _, pattern, (line, column) in _written(spec, source):
        try:
            compile_glob(pattern)
        except GlobSyntaxError as exc:
            problems.append(error("TP110", f"{section}: bad glob '{pattern}': {exc}", source.file, line, column))
    return problems


def section_globs(spec: Any, source: Any) -> dict[str, list[SectionGlob]]:
    """{section: its globs, in the order written} of a loaded version 2 plan (its globs
    compile: the loader checked them); fsdp.units without the root "", which is no glob
    to match (`fsdp_units` reads where it is listed)."""
    found: dict[str, list[SectionGlob]] = {}
    for pattern, rule in (getattr(spec, "experts", None) or {}).items():
        line, column = source.locate(("experts", pattern), key=True)
        found.setdefault("experts", []).append(SectionGlob("experts", pattern, compile_glob(pattern), source.file, line, column, spec=rule))
    for section, index, pattern, (line, column) in _written(spec, source):
        if section == "fsdp.units" and pattern == ROOT:
            continue
        found.setdefault(section, []).append(SectionGlob(section, pattern, compile_glob(pattern), source.file, line, column, index))
    return found


def claim(tree: ModuleTree, entries: Sequence[Any], under: str = "", section: str = "rules") -> tuple[dict[str, Any], list[Problem]]:
    """{module path: the first entry whose glob matches it}, in module order, and the
    problems: TP200 for an entry matching no module, TP201 for a module a later entry
    matches too. `entries` have .pattern, .glob, .file, .line and .problem(code, message)
    (the plan's Rules, or SectionGlobs); `under`: the module the globs start from."""
    claimed: dict[str, int] = {}
    problems: list[Problem] = []
    lead, noun = ("", "rule ") if section == "rules" else ("", "experts rule ") if section == "experts" else (f"{section}: ", "")
    for position, entry in enumerate(entries):
        matched = tree.match(entry.glob, under)
        if not matched:
            at = f" of the model at '{under}'" if under else ""
            problems.append(entry.problem("TP200", f"{lead}{noun}'{entry.pattern}' matches no module{at}: {tree.explain_no_match(entry.glob, under)}"))
            continue
        conflicts: dict[int, list[str]] = {}
        for fqn in matched:
            if fqn in claimed:
                conflicts.setdefault(claimed[fqn], []).append(fqn)
            else:
                claimed[fqn] = position
        for earlier, fqns in conflicts.items():
            other = entries[earlier]
            shown = ", ".join(repr(f or "<root>") for f in fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
            here, other_at = _where(entry, other)
            problems.append(entry.problem(
                "TP201",
                f"{lead}{noun}'{entry.pattern}' ({here}) and {noun}'{other.pattern}' ({other_at}) "
                f"both match {shown}: {_ONCE[section]}, narrow one of the globs",
            ))
    ordered = sorted(claimed.items(), key=lambda item: tree.order[item[0]])
    return {fqn: entries[position] for fqn, position in ordered}, sort_problems(problems)


def _where(entry: Any, other: Any) -> tuple[str, str]:
    """How the TP201 message places two entries: by line, by line and column when they share
    a line (globs of one list), by file:line when the other is inherited (extends)."""
    if other.file != entry.file:
        return f"line {entry.line}", f"{other.file}:{other.line}"
    if other.line == entry.line:
        return f"line {entry.line}, column {entry.column}", f"column {other.column}"
    return f"line {entry.line}", f"line {other.line}"


def claim_section(plan: Any, tree: ModuleTree, under: str, section: str) -> tuple[dict[str, SectionGlob], list[Problem]]:
    """`claim` of one section of a version 2 plan (nothing for a section it does not have)."""
    entries = section_globs(plan.spec, plan.source).get(section, []) if plan.version == 2 else []
    return claim(tree, entries, under, section)


def claimed_twice(tp_claimed: dict[str, Any], experts_claimed: dict[str, SectionGlob]) -> list[Problem]:
    """TP201 at each experts rule that matches a module a TP rule (`rules`) matches too: the
    experts rule places its parameters over ep, the TP rule over tp; a module takes one."""
    both: dict[tuple[int, int], list[str]] = {}  # (experts rule, TP rule) -> the modules both match
    pairs: dict[tuple[int, int], tuple[SectionGlob, Any]] = {}
    for fqn, entry in experts_claimed.items():
        rule = tp_claimed.get(fqn)
        if rule is not None:
            both.setdefault((id(entry), id(rule)), []).append(fqn)
            pairs[id(entry), id(rule)] = (entry, rule)
    problems = []
    for key, fqns in both.items():
        entry, rule = pairs[key]
        at = f"line {rule.line}" if rule.file == entry.file else f"{rule.file}:{rule.line}"
        fix = f"delete the inherited rule with '{rule.pattern}: null' under rules" if rule.file != entry.file else "remove one"
        more = f" (and {len(fqns) - 1} more)" if len(fqns) > 1 else ""
        problems.append(entry.problem("TP201", (
            f"experts rule '{entry.pattern}' and rule '{rule.pattern}' ({at}) both match '{fqns[0]}'{more}: a module "
            f"takes one style (the experts rule places it over ep, the TP rule over tp); {fix}")))
    return problems


def _ancestors(fqn: str) -> Iterator[str]:
    parts = fqn.split(".")
    for end in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:end])


def fsdp_units(plan: Any, tree: ModuleTree, under: str = "") -> tuple[list[str], list[Problem]]:
    """The module paths a version 2 plan's `fsdp.units` wraps, innermost first, the root
    "" last, and the problems: `claim`'s, and TP129 for a unit listed after a unit that
    holds it (an ancestor: FSDP2 wraps innermost first), the root "" listed before
    another unit included."""
    claimed, problems = claim_section(plan, tree, under, "fsdp.units")
    written = list(plan.spec.fsdp.units or ())
    root_at = written.index(ROOT) if ROOT in written else None
    listed_after = {entry.index: entry.pattern for entry in claimed.values() if root_at is not None and root_at < entry.index}
    after_root = [listed_after[index] for index in sorted(listed_after)]
    if after_root:
        listed = ", ".join(f"'{pattern}'" for pattern in after_root)
        problems.append(error("TP129", (
            f"fsdp.units: \"\" (the root, which holds every module) is listed before {listed}: fully_shard wraps units "
            "innermost first and the root last; list \"\" last, or leave it out (the root is always wrapped last)"),
            plan.file, *plan.source.locate(("fsdp", "units", root_at))))
    reported: set[int] = set()
    for fqn, entry in claimed.items():
        if entry.index in reported or entry.pattern in after_root:
            continue
        outer = next(((a, claimed[a]) for a in _ancestors(fqn) if a in claimed and claimed[a].index <= entry.index), None)
        if outer is None:
            continue
        ancestor, holder = outer
        if holder is entry:
            what = f"matches both '{ancestor}' and '{fqn}' inside it"
            fix = "name the inner or the outer modules with it, and the others with a glob of their own listed after it"
        else:
            what = f"(its '{fqn}') is listed after '{holder.pattern}' ({_where(entry, holder)[1]}), whose '{ancestor}' holds it"
            fix = f"list '{entry.pattern}' before '{holder.pattern}'"
        problems.append(entry.problem("TP129", (
            f"fsdp.units: '{entry.pattern}' {what}: fully_shard wraps units innermost first (an outer unit "
            f"wrapped first would already hold the inner one's parameters); {fix}")))
        reported.add(entry.index)
    inner_first = sorted(claimed, key=lambda fqn: (claimed[fqn].index, tree.order[fqn]))  # as listed
    return [*inner_first, ROOT], sort_problems(problems)
