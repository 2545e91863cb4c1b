"""TP301: sequence_parallel on a module whose parameters live in submodules."""

from __future__ import annotations

from ..facts import nested_parameters
from ..registry import Finding, LintRule
from ..text import rule_ref


def check(ctx):
    for fqn, rule in ctx.matched.items():
        style = rule.spec.style
        if not rule.spec.semantics.flat_params:  # the styles that refuse nested parameters
            continue
        module = ctx.modules[fqn]
        nested = nested_parameters(module)
        if not nested:
            continue
        shown = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")
        yield Finding(ctx.at(rule), (
            f"{style} replicates a module's parameters by name, but '{fqn or '<root>'}' "
            f"({type(module).__name__}) holds {len(nested)} in submodules ({shown}) ({rule_ref(rule)}); "
            f"torch fails with 'parameter name can't contain \".\"': put {style} on the "
            "position-wise leaves (norms, dropout) and shard the Linears with colwise/rowwise"
        ))


RULE = LintRule(
    code="TP301",
    name="sequence-parallel-nested",
    severity="error",
    summary="sequence_parallel on a module whose parameters are in its submodules.",
    what="""
        Checks that a module under `sequence_parallel` owns all its parameters
        directly, as norms and dropout layers do.
    """,
    why="""
        SequenceParallel re-registers every parameter of the module
        (`named_parameters()`, recursively) as a replicated DTensor under its
        full dotted name, which `register_parameter` refuses. Sequence
        parallelism is meant for the position-wise modules between the sharded
        Linears, not for a whole block.
    """,
    failing="""
        version: 1
        rules:
          layers.*.feed_forward: sequence_parallel
    """,
    passing="""
        version: 1
        rules:
          layers.*.ffn_norm: sequence_parallel
          layers.*.feed_forward:
            style: prepare_module_input
            input_layouts: shard(1)
            desired_input_layouts: replicate
          layers.*.feed_forward.w{1,3}: colwise
          layers.*.feed_forward.w2: {style: rowwise, output_layouts: shard(1)}
          tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
          layers.*.attention_norm: sequence_parallel
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [shard(1), null]
            desired_input_layouts: [replicate, null]
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: {style: rowwise, output_layouts: shard(1)}
          norm: sequence_parallel
          output: {style: colwise, input_layouts: shard(1), output_layouts: replicate}
    """,
    check=check,
)
