"""`tpplan init`'s report for people: per degree what the inferred plan costs, beside
any compared plan, and what was dropped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.units import human_bytes

if TYPE_CHECKING:
    from ..init import Inferred


def _comms(comms: dict) -> str:
    def side(ops: dict) -> str:
        return ", ".join(f"{n} {op.replace('_', '-')}" for op, n in sorted(ops.items()) if n) or "none"

    return f"forward {side(comms.get('forward', {}))}; backward {side(comms.get('backward', {}))}"


def _line(label: str, figures) -> str:
    share = figures.rank_bytes / figures.total_bytes if figures.total_bytes else 1.0
    head = f"  {label:<13} per-rank params {human_bytes(figures.rank_bytes)} of {human_bytes(figures.total_bytes)} ({share:.2f}); "
    check = figures.check
    if check is not None and "summary" in check:  # a compared plan's dry run failed: no collectives to show
        return head + f"dry run FAILED: {check['summary']}"
    verdict = ("" if check is None else " check passed" if check.get("passed") else f" check FAILED ({check.get('error', 'values differ')})")
    return head + f"{_comms(figures.comms)};{verdict}"


def render_report(inferred: "Inferred") -> str:
    proven = inferred.proven
    lines = []
    for degree in proven.degrees:
        lines.append(f"TP {degree}:")
        if degree in proven.results:
            lines.append(_line("inferred", proven.results[degree]))
        for name, figures in inferred.compare.items():
            if degree in figures:
                lines.append(_line(name, figures[degree]))
    lines += [f"warning: {why}" for why in proven.warnings]
    # what `validate --strict` would fail the written plan on: said here, not found later
    lines += dict.fromkeys(f"lint warning {p.code}: {' '.join(p.message.split())[:300]}" for p in proven.lint_warnings)
    if not inferred.checked:
        lines.append("not checked with values (a model above the values limit, or on the meta device): shapes and collectives only")
    for rule, why in dict.fromkeys((d.rule, " ".join(d.why.split())[:300]) for d in proven.dropped):
        lines.append(f"dropped {rule}: {why}")  # once: the blocks alike are dropped together, each with the same why
    from ..core.globs import generalize

    edits: dict[tuple, int] = {}
    for edit in proven.edits:
        key = (edit.code, generalize(edit.key), edit.why.replace(edit.key, generalize(edit.key)))
        edits[key] = edits.get(key, 0) + 1
    for (code, key, why), count in edits.items():
        lines.append(f"lint edit {code} on {key}{f' ({count} modules)' if count > 1 else ''}: {why}")
    for note in proven.notes:
        lines.append(note)
    if not proven.rules:  # the rules written (--from: the fixed plan's, with no groups inferred)
        lines.append("nothing could be sharded: the plan is empty (every module stays whole; the plan's comments say why)")
    return "\n".join(lines)
