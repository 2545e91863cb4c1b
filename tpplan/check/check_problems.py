"""The located problems of a failed `--check`, worded the same under torchrun and in
the dry run: TP505 for outputs or gradients that differ from one device, located at
the rule to blame for the first differing tensor (`first_difference`); TP506 for each
replicated parameter whose replicas differ between ranks (`replicas`)."""

from __future__ import annotations

from ..core.plan import Plan
from ..core.problems import Problem, error


def check_problems(result, plan: Plan, tp: int, message: str) -> list[Problem]:
    """The problems of a failed check (`result`: a CheckResult with its `located` and
    `replicas`); `message` opens TP505's text."""
    located = result.located
    forward_differs = located is not None and located.first.what.startswith(("the output", "the model"))
    if result.replicas and not forward_differs:
        # the forward matches one device: what differs starts at the diverging replicas
        return replica_problems(result, plan, tp)
    # a wrong forward makes replicas downstream differ too: its first difference is the news
    return [check_failure(result, plan, message)]


def check_failure(result, plan: Plan, message: str) -> Problem:
    """TP505 for a failed check: `message`, then the first differing tensor, located at
    the rule that shards its module (or its closest planned ancestor)."""
    located = result.located
    if located is None:
        return error("TP505", message, plan.file)
    message += f"; {located.first.describe()}"
    if located.rule is None:
        return error("TP505", message, plan.file)
    rule = located.rule
    return error("TP505", f"{message}; located at rule '{rule.pattern}' ({located.relation})", rule.file, rule.line, rule.column)


def replica_problems(result, plan: Plan, tp: int) -> list[Problem]:
    """TP506 for each replicated parameter whose value or gradient differs between ranks
    (its first difference), at the rule of its module, closest planned ancestor or first planned child."""
    problems, seen = [], set()
    for found, rule, relation in result.replicas:
        if found.parameter in seen:
            continue
        seen.add(found.parameter)
        message = f"at TP {tp}, {found.describe()}" + _partial_gradient_fix(found, relation)
        if rule is None:
            problems.append(error("TP506", message, plan.file))
        else:
            problems.append(error("TP506", f"{message}; located at rule '{rule.pattern}' ({relation})", rule.file, rule.line, rule.column))
    return problems


def _partial_gradient_fix(found, relation: str | None) -> str:
    """The fix TP325 (validate --model) names for the same cause: a gradient that differs
    while the forward matched, of a module no rule covers (its input was a rank's slice)."""
    from ..core.globs import generalize

    if found.kind != "gradient" or relation is None or not relation.endswith("the last planned module that ran before it"):
        return ""
    module = found.parameter.rpartition(".")[0]
    if not module:
        return ""
    return (
        f"; its module computes on this rank's slice only, so the gradient is this rank's share (TP325): "
        f"add the rule '{generalize(module)}: local_params' (replicated parameters whose gradients are summed over the mesh)"
    )


