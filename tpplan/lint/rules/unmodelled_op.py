"""TP328: the layout flow stopped at an op it does not model, so what follows was not judged."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import plural, shard_text, styled


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); at TP 1 nothing after the op would be judged anyway
    first: dict[int, tuple] = {}  # id(rule) -> (its first stop, how many)
    for stop in ctx.flow.stops:
        if stop.value.src is None:
            continue
        key = id(stop.value.src.rule)
        found, count = first.get(key, (stop, 0))
        first[key] = (found, count + 1)
    for stop, count in first.values():
        src, ndim = stop.value.src, len(stop.shape)
        what = f"local {shard_text(stop.value.dim, ndim)}" if stop.value.kind == "S" else "local partial sum"
        inside = f" inside '{stop.fqn}'" if stop.fqn else " in the model's own forward"
        more = f" ({plural(count - 1, 'more stop')} like it for this rule)" if count > 1 else ""
        yield Finding(ctx.at(src.rule), (
            f"the layout flow stops following the {what} {stop.shape} that {styled(src.fqn, src.rule)} returns at "
            f"'{stop.op}'{inside}: an op it does not model for this layout{more}, so nothing that value reaches was "
            "checked (TP320-TP325); `tpplan apply --dry-run --check` checks it with values"
        ))


RULE = LintRule(
    code="TP328",
    name="unmodelled-op",
    severity="warning",
    summary="A local shard reaches an op the layout flow does not model: what follows it was not checked.",
    what="""
        The layout flow (TP320-TP325) follows each local shard or partial sum
        that a rule returns through the ops of the forward it models (views,
        transposes, elementwise ops, reductions, matmul, attention, cat and
        split). When one reaches an op it does not model, or a modelled op with
        arguments it cannot follow (a view that interleaves the shard with
        another dim), its layout is unknown from there on and nothing it
        reaches is judged. This rule says so, once per rule, naming the first
        such op and the module it runs in.
    """,
    why="""
        A check that stopped must not look like a check that passed: the ops
        after it may still be wrong (a reduction over the sharded dim, a
        module that needs the whole tensor), and the lint cannot tell. Run
        `tpplan apply --dry-run --check` (values on every simulated rank); when
        it passes, the op is safe for this plan and the warning can be ignored
        (`--ignore TP328`). In the example the running mean (`cumsum` over the
        positions) is per feature, so the feature shard is fine: `--check`
        passes, but only `--check` can say so.
    """,
    model="tpplan.models.rule_examples:prefix_mlp",
    failing="""
        version: 1
        rules:
          up: colwise
          down: rowwise
    """,
    passing="""
        version: 1
        rules:
          up: {style: colwise, output_layouts: replicate}
    """,
    check=check,
)
