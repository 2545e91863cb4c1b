"""TP326: a fused projection's output (q, k and v, or gate and up, side by side) sharded
as one plain colwise, then cut into its kinds."""

from __future__ import annotations

from ...core.problems import Fix
from ..registry import Finding, LintRule
from ..text import generalize, styled


def _packed_fix(fused) -> str:
    pieces = fused.pieces
    if pieces and len(set(pieces)) > 1:
        return f"{{style: colwise, packed: [{', '.join(map(str, pieces))}]}}"
    if pieces and len(pieces) > 1:
        return f"{{style: colwise, packed: {len(pieces)}}}"
    return "{style: colwise, packed: N} (N blocks, or their sizes)"


def message(fused) -> tuple[str, str]:
    """(what goes wrong, how to fix it)."""
    src = fused.value.src
    made = f"the local output of {styled(src.fqn, src.rule)}"
    inside = f" in '{fused.fqn}' (on its full shape {fused.shape})" if fused.fqn else f" (on its full shape {fused.shape})"
    if fused.where == "split":
        return (
            f"{made} is cut into kinds along its sharded dim by '{fused.detail}'{inside}: a fused projection, and plain "
            "colwise gives each rank a contiguous run of its features, a mix of kinds (rank 0 of 2 holds all of the "
            "first block and half of the second), so every rank computes on wrong values without an error",
            f"shard each block: give '{src.rule.pattern}' {_packed_fix(fused)} where the model cuts its output in "
            "proportion (chunk, split by the local width, view(..., blocks, -1, head_dim)), else output_layouts: replicate "
            "(transformers' colwise_gather_output)",
        )
    if fused.where == "handoff":
        return (
            f"{made} holds this rank's slice of every packed block, but '{fused.fqn}' ({fused.detail}) takes it as one "
            "contiguous shard",
            f"cut it into its kinds before it reaches '{fused.detail}', or drop '{src.rule.pattern}''s packed",
        )
    what = "a slice at fixed offsets" if fused.where == "slice" else f"a '{fused.detail}' that does not split out its blocks"
    return (
        f"{made} is packed ({list(fused.value.blocks)}), but {what}{inside} cuts it: each rank holds 1/tp of every "
        "block, so offsets and sizes written for the whole output are wrong on a rank",
        f"split the local output in proportion to the blocks (chunk, or view(..., blocks, -1, head_dim)), or give "
        f"'{src.rule.pattern}' output_layouts: replicate instead of packed",
    )


def fit(ctx):
    """A packed rule whose blocks do not fit its Linear: they do not add up to its output
    features, or a TP degree does not divide one."""
    from ...sharding.packed import PackedInputError, block_sizes, local_rows

    for fqn, rule in ctx.matched.items():
        packed, module = getattr(rule.spec, "packed", None), ctx.modules.get(fqn)
        features = getattr(module, "out_features", None)
        if packed is None or not isinstance(features, int):
            continue  # not a Linear: TP300 says so
        try:
            sizes = block_sizes(tuple(packed) if isinstance(packed, list) else packed, features)
            for tp in ctx.tp_sizes:
                local_rows(sizes, 0, tp)
        except PackedInputError as exc:
            yield Finding(ctx.at(rule), f"'{fqn}' ({features} output features): {exc}")


def check(ctx):
    misfits: dict[tuple, Finding] = {}
    for finding in fit(ctx):
        misfits.setdefault(finding.at, finding)  # the first module of a rule says it
    yield from misfits.values()
    if ctx.flow is None:
        return
    for fused in ctx.flow.fused:
        if ctx.at(fused.value.src.rule) in misfits:
            continue  # its blocks are wrong already
        what, fix = message(fused)
        yield Finding(ctx.at(fused.value.src.rule), f"{what}; {fix}", fixes=packed_fix(fused))


def packed_fix(fused) -> tuple[Fix, ...]:
    """`packed` on the colwise rule whose output a split cuts into two or more kinds: each
    rank then takes its slice of every block."""
    if fused.where != "split" or not fused.pieces or len(fused.pieces) < 2:
        return ()
    pieces = list(fused.pieces)
    packed = len(pieces) if len(set(pieces)) == 1 else pieces
    return (Fix(fused.value.src.rule.pattern, {"packed": packed}, False,
                f"its output is cut into {len(pieces)} kinds by '{fused.detail}' in '{generalize(fused.fqn)}': each rank takes its slice of every block"),)


RULE = LintRule(
    code="TP326",
    name="fused-projection",
    severity="error",
    summary="A fused projection (q, k, v or gate, up in one Linear) is sharded plain colwise and its output cut into kinds.",
    what="""
        Follows the local output of a colwise Linear and reports the first op
        that cuts it into kinds along its sharded dim: `chunk`, `split`,
        `unbind` or indexing, also after a view that splits the features into
        `(3, heads, head_dim)`, as GPT-2's `c_attn`, Phi-3's `qkv_proj` and
        `gate_up_proj`, and ViTs' `qkv` do. With `packed` on the rule, checks
        instead that the cut follows the blocks (chunk into them, a view that
        splits them out, a split into their sizes) and that the packed output
        is not handed on as one contiguous shard.
    """,
    why="""
        A fused `Linear(dim, 3 * dim)` holds q, k and v side by side. Plain
        colwise gives rank r output features `[r * 3dim/tp, (r + 1) * 3dim/tp)`:
        at TP 2 rank 0 holds q and half of k, rank 1 the rest of k and v. The
        model splits its local output in three as if it were whole, so q, k and
        v are each a mix of kinds: no shape error, wrong values (`--check`
        fails at the next rule). `packed: 3` gives rank r its slice of every
        block instead (weight and bias `packed_shard(0, 3)`), and the split
        gives it whole heads of q, k and v; `packed: [q, k, v]` (sizes in
        features) does the same for unequal blocks, a GQA `[q | k | v]`.
    """,
    model="tpplan.models.fused:tiny",
    failing="""
        version: 1
        rules:
          blocks.*.attn.qkv: colwise
          blocks.*.attn.proj: rowwise
          blocks.*.mlp.gate_up: colwise
          blocks.*.mlp.down: rowwise
    """,
    passing="""
        version: 1
        rules:
          blocks.*.attn.qkv: {style: colwise, packed: 3}
          blocks.*.attn.proj: rowwise
          blocks.*.mlp.gate_up: {style: colwise, packed: 2}
          blocks.*.mlp.down: rowwise
    """,
    check=check,
)
