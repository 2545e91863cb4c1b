"""TP307: a rule names a ParallelStyle class without `like:` or the layouts of its
outputs, so the lint does not know what its modules hand on and follows nothing
after them."""

from __future__ import annotations

from ..registry import Finding, LintRule


def check(ctx):
    counts: dict[str, list] = {}
    for fqn, rule in ctx.matched.items():
        contract = rule.spec.semantics.contract.tp
        # the contract of a class without `like:`: nothing known, or derived from the layouts its rule gives
        if contract.body == "unknown" or (contract.body == "sharded" and not contract.outputs):
            counts.setdefault(rule.pattern, [rule, 0])[1] += 1
    for pattern, (rule, count) in counts.items():
        modules = f"{count} module{'s' if count > 1 else ''}"
        if rule.spec.semantics.contract.tp.body == "unknown":
            yield Finding(ctx.at(rule), (
                f"rule '{pattern}' names {rule.spec.style} without 'like:': the lint does not know its layouts, so it "
                f"judges nothing in or after the {modules} it matches; add like: colwise, "
                "rowwise, sequence_parallel, ... (the built-in style it behaves as), or its input_layouts and "
                "output_layouts, to check them"
            ))
        else:
            yield Finding(ctx.at(rule), (
                f"rule '{pattern}' names {rule.spec.style} with no 'like:' or 'output_layouts': the lint judges what "
                f"its layouts say but not what the {modules} it matches hand on, so nothing after them; add "
                "output_layouts (or like:) to check it"
            ))


RULE = LintRule(
    code="TP307",
    name="opaque-style",
    severity="warning",
    summary="A rule names a ParallelStyle class without `like:` (or its output_layouts); the lint treats its modules as opaque.",
    what="""
        Says, once per rule, that a style named by its class (`style:
        PKG.MOD:Class`) has no `like:`: without layouts in the rule, the
        layout flow skips the modules it matches (their inputs are not judged,
        their outputs' layouts are unknown, so nothing downstream of them is
        judged either); with `input_layouts` (or `params`) but no
        `output_layouts`, their inputs are judged but not what follows them.
    """,
    why="""
        A skipped check must not look like a passed one. `like: colwise` (or
        rowwise, prepare_module_input, ...) tells the lint which built-in
        semantics the class has, as torchao's `Float8ColwiseParallel` has
        colwise's; a class like none of them states its layouts in the rule
        (`input_layouts`, `desired_input_layouts`, `output_layouts`, `params`),
        and the lint follows them.
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
