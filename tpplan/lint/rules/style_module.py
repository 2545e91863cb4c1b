"""TP300: colwise / rowwise on a module that is not an nn.Linear or nn.Embedding."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import article, rule_ref


def check(ctx):
    from torch import nn

    for fqn, rule in ctx.matched.items():
        style = rule.spec.style
        module = ctx.modules[fqn]
        if style not in ("colwise", "rowwise") or isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        shardable = [name for name, sub in module.named_modules() if name and isinstance(sub, (nn.Linear, nn.Embedding))]
        if shardable:
            shown = ", ".join(shardable[:4]) + (", ..." if len(shardable) > 4 else "")
            fix = f"put {style} on its Linear/Embedding submodules ({shown}), and prepare_module_input here if its input needs a layout"
        else:
            fix = "it holds no Linear or Embedding to shard: use no_parallel to replicate it, or drop the rule"
        yield Finding(ctx.at(rule), (
            f"{style} shards only nn.Linear and nn.Embedding, but '{fqn or '<root>'}' is {article(type(module).__name__)} "
            f"({rule_ref(rule)}); torch raises NotImplementedError when the plan is applied: {fix}"
        ))


RULE = LintRule(
    code="TP300",
    name="style-module",
    severity="error",
    summary="colwise or rowwise on a module that is not an nn.Linear or nn.Embedding.",
    what="""
        Checks that every module a `colwise` or `rowwise` rule matches is an
        `nn.Linear` or an `nn.Embedding` (subclasses included).
    """,
    why="""
        torch's ColwiseParallel and RowwiseParallel know how to split only those
        two: on anything else `parallelize_module` raises NotImplementedError,
        after the model is built and the job has started. A glob one level too
        short (`layers.*.attention` instead of `layers.*.attention.wq`) is the
        usual cause.
    """,
    failing="""
        version: 1
        rules:
          layers.*.attention: colwise
    """,
    passing="""
        version: 1
        rules:
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
    """,
    check=check,
)
