"""TP370: `loss_parallel: true`, but the head's rule does not keep the logits vocabulary-sharded."""

from __future__ import annotations

from ..registry import Finding, LintRule


def _head(ctx) -> str | None:
    """The output head: the last module with parameters and no children (lm_head, output)."""
    last = None
    for fqn, module in ctx.modules.items():
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
            last = fqn
    return last


def _shards_last_dim(layouts) -> bool:
    # colwise returns (..., vocab): the last dim is -1, or 2 for (batch, seq, vocab) logits.
    return layouts is not None and layouts.kind == "shard" and layouts.blocks == 1 and layouts.dim in (-1, 2)


def check(ctx):
    if not ctx.plan.loss_parallel:
        return
    head = _head(ctx)
    if head is None:
        return
    rule = ctx.matched.get(head)
    fix = (
        f"give '{head}' {{style: colwise, use_local_output: false}} (output_layouts shard(-1), the default), "
        "or set loss_parallel: false"
    )
    if rule is None:
        yield Finding(ctx.plan_location(), (
            f"loss_parallel is true, but no rule shards the head '{head}': its logits are whole on every rank, "
            f"and loss_parallel() needs them sharded on the vocabulary dim; {fix}"
        ))
        return
    spec = rule.spec
    if not spec.semantics.feature_sharded_output:
        yield Finding(ctx.at(rule), (
            f"loss_parallel is true, but rule '{rule.pattern}' gives the head '{head}' style {spec.style}: only colwise "
            f"returns logits sharded on the vocabulary dim; {fix}"
        ))
        return
    layouts = getattr(spec, "output_layouts", None)
    if layouts is not None and not _shards_last_dim(layouts):
        yield Finding(ctx.at(rule), (
            f"loss_parallel is true, but rule '{rule.pattern}' gives the head '{head}' output_layouts: {layouts}: "
            f"the logits leave it whole, not sharded on the vocabulary dim; {fix}"
        ))
    if getattr(spec, "use_local_output", None) is not False:
        yield Finding(ctx.at(rule), (
            f"loss_parallel is true, but rule '{rule.pattern}' lets the head '{head}' return a local tensor "
            f"(use_local_output: true, colwise's default): loss_parallel() needs the DTensor; {fix}"
        ))


RULE = LintRule(
    code="TP370",
    name="loss-parallel-head",
    severity="error",
    summary="loss_parallel: true, but the head's rule does not return vocabulary-sharded DTensor logits.",
    what="""
        With `loss_parallel: true`, finds the model's head (its last module with
        parameters, e.g. `output` or `lm_head`) and checks the rule that shards
        it: colwise, `output_layouts` sharding the last (vocabulary) dim (the
        default), and `use_local_output: false`, so that the logits reach the
        loss as a DTensor sharded on the vocabulary.
    """,
    why="""
        Trainers (`tpplan apply --steps`, `examples/train.py`) compute the loss
        inside torch's `loss_parallel()` when the plan asks for it, which needs
        the logits as a DTensor sharded on the class dim. A head that gathers
        them (`output_layouts: replicate`) or returns a local shard fails at the
        first step, or, with replicated logits, spends the memory and the
        all-gather that loss parallelism exists to save.
    """,
    failing="""
        version: 1
        loss_parallel: true
        rules:
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: rowwise
          output: {style: colwise, output_layouts: replicate}
    """,
    passing="""
        version: 1
        loss_parallel: true
        rules:
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: rowwise
          output: {style: colwise, use_local_output: false}
    """,
    check=check,
)
