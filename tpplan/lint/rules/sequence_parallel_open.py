"""TP322: a sequence-parallel region that is not closed."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import generalize, shard_text
from .replicated_partial_grad import claims
from .shard_leak import leak_message, own_param_fix, own_param_fixes


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); or TP 1 only, where every layout is the whole tensor
    for leak in ctx.flow.leaks:
        if not leak.sequence or claims(ctx, leak):
            continue  # TP321; TP325 (a colwise output's heads reaching a per-head module)
        src, ndim = leak.value.src, len(leak.shape)
        shard = shard_text(leak.value.dim, ndim)
        if leak.where == "module":
            style = "sequence_parallel" + ("" if leak.value.dim == 1 else f" with sequence_dim: {leak.value.dim}")
            yield Finding(ctx.at(src.rule), (
                f"{leak_message(leak)}: it computes fine on its {shard} input, but its parameters are plain tensors, so each "
                f"rank's gradient covers only its own part of dim {leak.value.dim} and the replicas drift apart; give "
                f"'{generalize(leak.fqn)}' {style} (its parameters become replicated DTensors, whose gradients are "
                f"reduced), or gather before it (prepare_module_input: {shard} -> replicate)"
            ))
        elif leak.where == "output":
            yield Finding(ctx.at(src.rule), (
                f"{leak_message(leak)}: the sequence-parallel region is never closed; gather before the end, e.g. give "
                f"the last rule input_layouts: {shard} and output_layouts: replicate"
            ))
        elif leak.param is not None:
            yield Finding(ctx.at(src.rule), f"{leak_message(leak)}; {own_param_fix(ctx, leak)}", fixes=own_param_fixes(ctx, leak))
        else:
            yield Finding(ctx.at(src.rule), (
                f"{leak_message(leak)}; close the sequence-parallel region before it (input_layouts: {shard}, "
                "desired_input_layouts: replicate on a prepare_module_input)"
            ))


RULE = LintRule(
    code="TP322",
    name="sequence-parallel-open",
    severity="error",
    summary="A sequence shard reaches a module the plan leaves alone, or the model's output.",
    what="""
        Follows the sequence shards that sequence parallelism creates (a rowwise
        rule with `output_layouts: shard(1)`, a `sequence_parallel` module with
        `use_local_output: true`), and any other local shard of a dim that is not
        the features (attention heads, say), and reports where one reaches a
        module with parameters that no rule covers, an op that needs the whole
        dim, or the model's output. Heads that meet a parameter of the
        attention module as long as the heads (attention sinks added to the
        scores) need that parameter sharded with them, not a closed region:
        `local_params` with `params: {sinks: shard(0)}` (as TP321 says).
    """,
    why="""
        Position-wise modules run fine on a sequence shard, so a norm forgotten
        in the plan raises nothing: its weight gradient is computed from this
        rank's tokens only and differs across ranks, and the replicas drift
        apart (the same holds for a per-head norm on a heads shard). Under a
        `sequence_parallel` style the weight is a replicated DTensor and its
        gradient is reduced. A region left open at the end returns `seq / tp`
        positions.
    """,
    failing="""
        version: 1
        rules:
          tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
          layers.*.attention_norm: sequence_parallel
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [shard(1), null]
            desired_input_layouts: [replicate, null]
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: {style: rowwise, output_layouts: shard(1)}
          layers.*.ffn_norm: sequence_parallel
          layers.*.feed_forward:
            style: prepare_module_input
            input_layouts: shard(1)
            desired_input_layouts: replicate
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: {style: rowwise, output_layouts: shard(1)}
          output: {style: colwise, input_layouts: shard(1), output_layouts: replicate}
    """,
    passing="""
        version: 1
        rules:
          tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
          layers.*.attention_norm: sequence_parallel
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [shard(1), null]
            desired_input_layouts: [replicate, null]
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: {style: rowwise, output_layouts: shard(1)}
          layers.*.ffn_norm: sequence_parallel
          layers.*.feed_forward:
            style: prepare_module_input
            input_layouts: shard(1)
            desired_input_layouts: replicate
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: {style: rowwise, output_layouts: shard(1)}
          norm: sequence_parallel
          output: {style: colwise, input_layouts: shard(1), output_layouts: replicate}
    """,
    check=check,
)
