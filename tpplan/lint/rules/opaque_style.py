"""TP307: a rule names a ParallelStyle class without `like:`, so the lint does not
know what it does to layouts and follows none through its modules."""

from __future__ import annotations

from ..registry import Finding, LintRule


def check(ctx):
    counts: dict[str, list] = {}
    for fqn, rule in ctx.matched.items():
        if rule.spec.semantics.contract.tp.body == "unknown":  # the style table's fact for a class without `like:`
            counts.setdefault(rule.pattern, [rule, 0])[1] += 1
    for pattern, (rule, count) in counts.items():
        yield Finding(ctx.at(rule), (
            f"rule '{pattern}' names {rule.spec.style} without 'like:': the lint does not know its layouts, so it "
            f"judges nothing in or after the {count} module{'s' if count > 1 else ''} it matches; add like: colwise, "
            "rowwise, sequence_parallel, ... (the built-in style it behaves as) to check them"
        ))


RULE = LintRule(
    code="TP307",
    name="opaque-style",
    severity="warning",
    summary="A rule names a ParallelStyle class without `like:`; the lint treats its modules as opaque.",
    what="""
        Says, once per rule, that a style named by its class (`style:
        PKG.MOD:Class`) has no `like:`: the layout flow skips the modules it
        matches (their inputs are not judged, their outputs' layouts are
        unknown, so nothing downstream of them is judged either).
    """,
    why="""
        A skipped check must not look like a passed one. `like: colwise` (or
        rowwise, prepare_module_input, ...) tells the lint which built-in
        semantics the class has, as torchao's `Float8ColwiseParallel` has
        colwise's.
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        rules:
          blocks.*.in_proj: {style: torch.distributed.tensor.parallel:ColwiseParallel}
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
