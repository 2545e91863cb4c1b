"""TP320: a style declares an input layout that is not what arrives."""

from __future__ import annotations

from ...core.placements import PlacementSpec
from ..facts import module_kind
from ..registry import Finding, LintRule
from ..text import rule_ref, shard_text, styled

_VOCAB_SHARD = PlacementSpec("shard", 0)  # of an Embedding's weight [vocab, dim]


def describe(lay, ndim: int) -> str:
    """A plain (local) layout as the plan would spell it."""
    if lay.kind == "S":
        return f"as a local {lay.text(ndim)}"
    return "replicated" if lay.kind == "R" else "as a local partial sum"


def origin(lay) -> str:
    return f" from {styled(lay.src.fqn, lay.src.rule)}" if lay.src else ""


def _fix(ctx, m, ndim: int) -> str:
    have, key = m.actual, "input_layouts" if m.what.startswith("input") else "output_layouts"
    if m.what.startswith("input '"):
        key = "input_kwarg_layouts"
    if m.impossible:
        return f"it has {ndim} dims: pick a dim in range"
    spec = m.rule.spec
    if m.declared_default and have.kind == "R" and module_kind(ctx.modules[m.fqn]) == "Embedding":
        vocab = " (vocabulary-parallel)" if spec.semantics.contract.tp.placement("Embedding", "weight") == _VOCAB_SHARD else ""
        return (f"a {spec.style} Embedding{vocab} takes token ids whole: give it {spec.semantics.input_option}: replicate "
                f"(torch's default is {m.declared})")
    if spec.semantics.sequence_shards:
        if have.kind == "R":
            producer = f"give '{have.src.rule.pattern}' output_layouts: {m.declared}" if have.src else "shard it before (a rowwise with output_layouts: shard(1))"
            return f"sequence parallelism starts where the sequence is sharded: {producer}, or drop {spec.style} here"
        return f"set sequence_dim to the dim that is sharded, or gather before it (it arrives {shard_text(have.dim, ndim) if have.kind == 'S' else 'partial'})"
    if m.what == "input 0" and m.rule.spec.semantics.input_option is not None:
        key = m.rule.spec.semantics.input_option
    if have.kind == "R":
        producer = f"give '{have.src.rule.pattern}' output_layouts: {m.declared} so that it arrives that way, or " if have.src else ""
        return f"{producer}declare {key}: replicate"
    if have.kind == "S" and have.split > 1:  # no placement a plan can declare says which rows each rank holds
        return (f"a view merged the dims in front of dim {have.dim}'s shard into it, so each rank holds its block in each of "
                f"{have.split} groups: view it back to those dims before handing it on (or gather before the view)")
    actual = shard_text(have.dim, ndim) if have.kind == "S" else "partial"
    producer = f", or make '{have.src.rule.pattern}' return it {m.declared}" if have.src else ""
    return f"declare {key}: {actual} (torch then redistributes it){producer}"


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); or TP 1 only, where every layout is the whole tensor
    for m in ctx.flow.mismatches:
        ndim = len(m.shape)
        declared = f"{m.declared}" + (" (torch's default)" if m.declared_default else "")
        yield Finding(ctx.at(m.rule), (
            f"{m.rule.spec.style} '{m.fqn or '<root>'}' ({rule_ref(m.rule)}) takes its {m.what} {m.shape} as {declared}, "
            f"but it arrives {describe(m.actual, ndim)}{origin(m.actual)}: DTensor.from_local believes the declaration "
            f"and computes on wrong data; {_fix(ctx, m, ndim)}"
        ))


RULE = LintRule(
    code="TP320",
    name="layout-mismatch",
    severity="error",
    summary="A style declares an input layout that is not the layout the tensor arrives in.",
    what="""
        Follows every tensor of a traced forward through the plan and checks,
        wherever a style turns a plain tensor into a DTensor (the inputs of
        colwise, rowwise, sequence_parallel, prepare_module_input and
        no_parallel, the outputs of prepare_module_output), that the declared
        layout (or torch's default) is the one the tensor really has: replicated,
        or the shard of a given dim that an earlier rule returned as a local
        tensor.
    """,
    why="""
        `DTensor.from_local` trusts the declaration. A replicated tensor declared
        `shard(1)` is taken for one rank's slice of a sequence `tp` times longer;
        a local shard declared `replicate` is taken for the whole tensor. Nothing
        fails: the model trains on wrong values. The classic case is a rowwise
        embedding without `input_layouts: replicate` (torch's default is
        `shard(-1)`), or a `sequence_parallel` norm after a layer that returns
        replicated activations.
    """,
    failing="""
        version: 1
        rules:
          tok_embeddings: rowwise
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [replicate, null]
            desired_input_layouts: [replicate, null]
            use_local_output: false
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
    """,
    passing="""
        version: 1
        rules:
          tok_embeddings: {style: rowwise, input_layouts: replicate}
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [replicate, null]
            desired_input_layouts: [replicate, null]
            use_local_output: false
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
    """,
    check=check,
)
