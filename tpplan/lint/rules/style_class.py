"""TP306: a rule names a ParallelStyle class (`style: PKG.MOD:Class`) that cannot
be used: it does not import, is not a ParallelStyle, or refuses the rule's keys."""

from __future__ import annotations

from ...core.external_styles import is_external
from ..registry import Finding, LintRule


def check(ctx):
    from ...sharding.compile import StyleClassError, style_class

    seen = set()
    for rule in ctx.matched.values():
        if rule.pattern in seen or not is_external(rule.spec.style):
            continue
        seen.add(rule.pattern)
        try:
            style_class(rule.spec)
        except StyleClassError as exc:
            yield Finding(ctx.at(rule), f"rule '{rule.pattern}': {exc}")


RULE = LintRule(
    code="TP306",
    name="style-class",
    severity="error",
    summary="A rule's `style: PKG.MOD:Class` does not import, is not a ParallelStyle, or refuses the rule's keys.",
    what="""
        For every rule that names its style by class (`style: PKG.MOD:Class`, a
        third-party style such as torchao's `Float8ColwiseParallel` or your
        own), imports the class and checks that it is a subclass of torch's
        `ParallelStyle` and that its constructor takes every other key of the
        rule (`like:` aside) as a keyword argument. Plan-only `validate`
        imports nothing; this runs with `--model`, and applying the plan
        reports the same problem.
    """,
    why="""
        A typo in the module path, a package missing from the cluster's image,
        or an argument the class does not take would otherwise fail every rank
        at start-up with an ImportError or a TypeError, far from the rule.
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        rules:
          blocks.*.in_proj: {style: no_such_package.styles:Colwise, like: colwise}
          blocks.*.out_proj: rowwise
    """,
    passing="""
        version: 1
        rules:
          blocks.*.in_proj: {style: torch.distributed.tensor.parallel:ColwiseParallel, like: colwise}
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
