"""The fixes the lint's findings carry, as edits a tool applies to a plan's rules
(`tpplan init`, `init --from plan.yaml` on a plan written by hand, `import-hf --minimal`).

Each rule that is sure of a fix decides it where it finds the problem and returns it with
the finding (`Finding.fixes`, as ruff's `Diagnostic.fix`); this module only runs those
rules and applies what they return, so an edit and the finding it fixes cannot disagree:

- TP326 (fused projection): `packed` on the colwise rule whose output is cut into kinds;
- TP311 (heads): `heads: auto` where only the KV heads fail and the degree is a multiple of them;
- TP325 (replicated partial gradient): a `local_params` rule on the module;
- TP340 (shared input): a `prepare_module_input` on the parent whose colwise children
  each turn the same plain input into a DTensor (one backward all-reduce instead of one per child);
- TP321/TP322 (a shard meets a module's own parameter that sharded the same way fits it,
  per-head attention sinks): that parameter in the `params` of a `local_params` rule on
  its module (a new rule, or the module's local_params or prepare_module_input rule
  turned into one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.problems import Fix
    from .context import LintContext

# The rules whose findings carry fixes, in the order their edits apply: where two add a
# rule for one module, the first wins and the next round sees it (TP340's prepare_module_input
# on an attention, then TP322 turns it into local_params holding its sinks).
FIXING = ("TP326", "TP311", "TP325", "TP340", "TP321", "TP322")


@dataclass(frozen=True)
class Edit:
    code: str  # the lint code whose fix this is
    key: str  # add: the module that gets a rule; else: the pattern of the rule that changes
    options: Any  # add: the whole rule value; else: the options set on the rule
    add: bool
    why: str


def with_options(value: Any, options: dict) -> Any:
    """A rule value (shorthand string or mapping) with `options` set on it."""
    mapping = {"style": value} if isinstance(value, str) else dict(value)
    return {**mapping, **options}


def lint_edits(ctx: "LintContext", codes: Iterable[str] = FIXING) -> list[Edit]:
    """Every fix the findings of the rules `codes` (of FIXING, in its order) carry for `ctx`'s
    plan, model and degrees, once each."""
    from .rules import RULES

    wanted = set(codes)
    fixes = [(code, fix) for code in FIXING if code in wanted for finding in RULES[code].check(ctx) for fix in finding.fixes]
    return edits_of(fixes)


def edits_of(fixes: Iterable[tuple[str, "Fix"]]) -> list[Edit]:
    """(code, fix) pairs as edits: each once (findings per degree or per layer repeat one),
    one new rule per module (the next round sees it, and edits it)."""
    edits, seen, added = [], set(), set()
    for code, fix in fixes:
        key = (code, fix.key, fix.add, repr(fix.options))
        if key in seen or (fix.add and fix.key in added):
            continue
        seen.add(key)
        added.update([fix.key] if fix.add else [])
        edits.append(Edit(code, fix.key, fix.options, fix.add, fix.why))
    return edits


def apply_edits(rules: dict[str, Any], edits: Iterable[Edit], modules: Iterable[str]) -> dict[str, Any]:
    """`rules` ({pattern: value}) with `edits` applied: options set on the rules they name, and
    the rules added under one glob for all layers (generalize) where the same rule goes on
    every module it matches among `modules`, else under each module's own path (a sparse MoE
    block beside dense MLPs). Added rules come after the plan's, in the order of the edits."""
    from ..core.globs import ModuleTree, compile_glob, generalize

    out = dict(rules)
    added: dict[str, list[Edit]] = {}
    for edit in edits:
        if edit.add:
            added.setdefault(generalize(edit.key), []).append(edit)
        elif edit.key in out:
            out[edit.key] = with_options(out[edit.key], edit.options)
    tree = ModuleTree(list(modules))
    for glob, group in added.items():
        if set(tree.match(compile_glob(glob))) == {e.key for e in group} and len({repr(e.options) for e in group}) == 1:
            out[glob] = group[0].options
        else:
            out.update({e.key: e.options for e in group})
    return out
