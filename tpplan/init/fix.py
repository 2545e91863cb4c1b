"""`tpplan init --from plan.yaml`: a plan written by hand, with the fixes the lint is
sure of applied (the fixes its findings carry: lint/edits.py), then dry-run with `--check` at its degrees.

The user's rules stay as written (never dropped): an edit sets options on a rule or
adds a rule for a module; a rule that still fails is reported (exit 1), not removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from . import Inferred

_ROUNDS = 4


def fix_plan(path: str | os.PathLike, factory: Callable[[], "nn.Module"], *, ref: str, tp: Sequence[int] | None = None,
             inputs: str | None = None, output: str | None = None, compare: dict | None = None) -> "Inferred":
    import yaml

    from ..core.loader import load_plan, read_plan_text
    from ..core.schema_file import schema_comment
    from ..lint.context import LintContext
    from ..lint.edits import apply_edits, lint_edits
    from ..simulation.ladder import values_allowed
    from ..simulation.modelref import build_model
    from . import Inferred
    from .prove import Proven, Target, dry_runs

    text = read_plan_text(path)
    plan = load_plan(path)  # a PlanError (exit 1) for a plan that does not load
    data = yaml.safe_load(text)
    model = build_model(ref, "meta", factory)
    from ..core.degrees import tp_degrees
    from . import proposal_for
    from .infer import default_degrees

    # core/degrees.py's rule; its default the degrees init would pick for the model (infer.default_degrees:
    # init writes the plan for the model, so the model's sizes decide), analysed only when needed
    degrees = tp_degrees(sorted(set(tp)) if tp else None, plan.mesh_sizes,
                         lambda: default_degrees(proposal_for(model, ref, inputs).groups))
    rules: dict[str, Any] = dict(data.get("rules") or {})
    names = [n for n, _ in model.named_modules()]
    applied = []
    for _ in range(_ROUNDS):
        ctx = LintContext(load_plan(text=_with_rules(data, rules), file=str(path)), model, degrees, inputs=inputs)
        edits = [e for e in lint_edits(ctx) if e not in applied]
        if not edits:
            break
        rules = apply_edits(rules, edits, names)
        applied += edits
    lines = [schema_comment(output), f"# Fixed by tpplan init --from {os.fspath(path)}:"]
    lines += [f"#   {e.code} {e.key}: {e.why}" for e in applied] or ["#   nothing to fix: the lint knows no certain edit"]
    fixed = "\n".join(lines) + "\n" + _with_rules(data, rules)
    target = Target(model, ref, factory, inputs, check=values_allowed(model))
    results, failure = dry_runs(target, load_plan(text=fixed, file=output or "<fixed>"), degrees, lambda text: None)
    proven = Proven([], degrees, {key: (value, None) for key, value in rules.items()}, applied, [], results)
    inferred = Inferred(fixed, proven, [], target.check, ok=failure is None)
    if failure is not None:
        degree, problem = failure
        proven.notes.append(f"the fixed plan still fails at TP {degree}: {problem.code}: {problem.message}")
    if compare:
        from .compare import figures, plan_file

        for label, plan_text in compare.items():
            inferred.compare[label] = figures(target, plan_text, degrees, lambda text: None, file=plan_file(label))
    return inferred


def _with_rules(data: dict, rules: dict) -> str:
    """The plan's YAML with `rules` in place of its rules, every other key as it was."""
    from ..core.yamltext import plan_yaml

    return plan_yaml({key: value for key, value in data.items() if key != "rules"}, rules)
