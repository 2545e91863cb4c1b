"""TP300: a style on a module of a kind it does not shard (colwise / rowwise on a
module that is not an nn.Linear, nn.Embedding, transformers' Conv1D or stacked expert
Linears; the kinds come from the style table)."""

from __future__ import annotations

from ...core.style_model import MODULE_KINDS
from ..facts import module_kind
from ..registry import Finding, LintRule
from ..text import article, rule_ref


def check(ctx):
    for fqn, rule in ctx.matched.items():
        style, kinds = rule.spec.style, rule.spec.semantics.contract.tp.kinds  # the kinds the style table says it shards
        module = ctx.modules[fqn]
        if not kinds or module_kind(module) in kinds:
            continue
        shardable = [name for name, sub in module.named_modules() if name and module_kind(sub) in kinds]
        if shardable:
            shown = ", ".join(shardable[:4]) + (", ..." if len(shardable) > 4 else "")
            fix = f"put {style} on the submodules it shards ({shown}), and prepare_module_input here if its input needs a layout"
        else:
            fix = f"it holds no module {style} shards: use no_parallel to replicate it, or drop the rule"
        labels = [MODULE_KINDS[kind].label for kind in kinds]
        yield Finding(ctx.at(rule), (
            f"{style} shards only {', '.join(labels[:-1])} and {labels[-1]}, but '{fqn or '<root>'}' is "
            f"{article(type(module).__name__)} ({rule_ref(rule)}); torch raises NotImplementedError when the plan is applied: {fix}"
        ))


RULE = LintRule(
    code="TP300",
    name="style-module",
    severity="error",
    summary="colwise or rowwise on a module that is not an nn.Linear, nn.Embedding, Conv1D or stacked expert Linears.",
    what="""
        Checks that every module a `colwise` or `rowwise` rule matches is an
        `nn.Linear`, an `nn.Embedding` (subclasses included), transformers'
        `Conv1D` (GPT-2's Linear with its weight stored `[in, out]`, sharded on
        its dim 1 by colwise and dim 0 by rowwise) or stacked expert Linears
        (JetMoE's `JetMoeParallelExperts`, weight `[num_experts, output_size,
        input_size]`, sharded on dim 1 by colwise and dim 2 by rowwise).
    """,
    why="""
        torch's ColwiseParallel and RowwiseParallel know how to split only
        Linears and Embeddings (tpplan's add the other two): on anything else
        `parallelize_module` raises NotImplementedError, after the model is
        built and the job has started. A glob one level too
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
