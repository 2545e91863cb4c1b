"""TP310: a TP degree that does not divide the dimension a rule shards."""

from __future__ import annotations

from ...core.style_model import MODULE_KINDS
from ..facts import module_kind, sharded_weight_dim
from ..registry import Finding, LintRule
from ..text import chunks_text, degrees_that_work, rule_ref


def sharded_dims(ctx):
    """(fqn, rule, dim name, weight dim, size) for each Linear/Embedding a rule shards,
    except those split by whole heads (TP311 checks those)."""
    for fqn, rule in ctx.matched.items():
        module = ctx.modules[fqn]
        dim = sharded_weight_dim(module, rule)  # from the style table
        if dim is None or ctx.heads.split(fqn, rule) is not None:
            continue
        yield fqn, rule, MODULE_KINDS[module_kind(module)].weight_dims[dim], dim, module.weight.shape[dim]


def check(ctx):
    for fqn, rule, name, dim, size in sharded_dims(ctx):
        for tp in ctx.tp_sizes:
            if size % tp == 0:
                continue
            empty = " (some ranks hold nothing)" if tp > size else ""
            yield Finding(ctx.at(rule), (
                f"tp ({tp}) does not divide {name} ({size}) of '{fqn}' ({rule.spec.style} shards weight dim {dim}; "
                f"{rule_ref(rule)}): ranks hold {chunks_text(size, tp)}{empty}; uneven shards pad every collective "
                f"and break wherever a local tensor is handed on (TP324); degrees that work: {degrees_that_work(size)}"
            ))


RULE = LintRule(
    code="TP310",
    name="shard-divisibility",
    severity="warning",
    summary="A TP degree does not divide the dimension a colwise or rowwise rule shards.",
    what="""
        For every TP degree checked (`--tp`, else `mesh.sizes`) and every Linear
        or Embedding a rule shards, checks that the degree divides the sharded
        dimension: `out_features` for colwise Linears, `in_features` for
        rowwise ones, `embedding_dim` / `num_embeddings` for Embeddings.
        Projections split by whole attention heads are TP311's.
    """,
    why="""
        DTensor accepts uneven shards, so nothing fails when the plan is
        applied. But ranks then hold different shapes: collectives pad, memory
        is unbalanced, checkpoints reshard awkwardly, and any place where a
        style hands a local tensor to the next one (`use_local_output: true`,
        the default) rebuilds the global shape as if shards were even (TP324).
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        mesh: {sizes: [3]}
        rules:
          blocks.*.in_proj: {style: colwise, use_local_output: false}
          blocks.*.out_proj: rowwise
    """,
    passing="""
        version: 1
        mesh: {sizes: [2, 4]}
        rules:
          blocks.*.in_proj: {style: colwise, use_local_output: false}
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
