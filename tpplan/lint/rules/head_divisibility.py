"""TP311: a TP degree that does not divide the attention heads a rule splits."""

from __future__ import annotations

from ...core.problems import Fix
from ...core.head_counts import HEAD_ATTRS, HEAD_DIM_ATTRS, KV_HEAD_ATTRS, is_kv_count
from ..registry import Finding, LintRule
from ..text import degrees_that_work, rule_ref


def check(ctx):
    # One finding per (rule, degree, attention module): its projections share the verdict.
    found: dict[tuple, tuple] = {}
    for fqn, rule in ctx.matched.items():
        split = ctx.heads.split(fqn, rule)
        if split is None:
            continue
        heads, counts, _ = split
        replicates = getattr(rule.spec, "heads", None) is not None
        for tp in ctx.tp_sizes:
            bad = failing_counts(counts, tp, replicates)
            if bad:
                key = (id(rule), tp, heads.owner)
                _, _, _, names, modules = found.setdefault(key, (rule, tp, heads, {}, []))
                names.update(bad)
                modules.append(fqn)
    for rule, tp, heads, names, modules in found.values():
        what = " and ".join(f"{name} ({count})" for name, count in names.items())
        shown = ", ".join(f"'{m}'" for m in modules)
        all_counts = dict(heads.counts)
        replicates = getattr(rule.spec, "heads", None) is not None
        fixes = ()
        if not replicates and heads_auto_fixes(tp, names.items(), heads.counts):
            fix = (f"replicate the KV heads instead: give '{rule.pattern}' {{style: colwise, heads: auto}} (rank r then "
                   f"holds KV head r // (tp / heads), whole, and their gradients are summed)")
            if "heads" in type(rule.spec).model_fields:  # the styles that can replicate heads
                kv = next(count for _, count in names.items())
                fixes = (Fix(rule.pattern, {"heads": "auto"}, False,
                             f"TP {tp} is a multiple of the {kv} KV heads of '{heads.owner}': each is replicated on {tp // kv} ranks"),)
        else:
            fix = f"degrees that work: {degrees_that_work(*all_counts.values())}"
            if replicates:
                fix += " (with heads, also the multiples of the KV heads that divide the query heads)"
        yield Finding(ctx.at(rule), (
            f"tp ({tp}) must divide {what} of '{heads.owner or '<root>'}' ({rule_ref(rule)}): {rule.spec.style} splits "
            f"{shown} into heads of {heads.head_dim} and each rank needs whole heads; {fix}"
        ), fixes=fixes)


def failing_counts(counts, tp: int, replicates: bool) -> list[tuple[str, int]]:
    """The (attribute, count) of `counts` a rule splits that `tp` does not divide into whole
    heads; with `replicates` (colwise with heads), a KV-head count `tp` is a multiple of
    passes too (those heads replicated)."""
    return [(name, count) for name, count in counts if count % tp and not (replicates and is_kv_count(name) and tp % count == 0)]


def heads_auto_fixes(tp: int, failing, all_counts) -> bool:
    """Whether `heads: auto` makes `tp` work for a rule whose `failing` counts (failing_counts,
    without heads) it does not divide: only KV heads fail, `tp` is a multiple of each, and it
    divides the query heads of `all_counts` (which stay split): then the finding carries that fix."""
    failing = list(failing)
    query = [count for name, count in all_counts if not is_kv_count(name)]
    return bool(failing) and all(is_kv_count(name) and tp % count == 0 for name, count in failing) and all(q % tp == 0 for q in query)


def _names(attrs: tuple) -> str:
    return ", ".join(f"`{name}`" for name in attrs)


RULE = LintRule(
    code="TP311",
    name="head-divisibility",
    severity="error",
    summary="A TP degree does not divide the attention heads (or KV heads) a rule splits.",
    what=f"""
        For every TP degree checked and every Linear a colwise or rowwise rule
        shards, looks for head counts on the module's parents or their
        `config` (as `heads: auto` reads them): {_names(HEAD_ATTRS)}, and
        {_names(KV_HEAD_ATTRS)}, with {_names(HEAD_DIM_ATTRS)} (or the hidden
        size divided by the query-head count). When the sharded
        features are exactly `count x head_dim`, the degree must divide that
        count; for colwise with `heads` (KV heads replicated) the degree may
        also be a multiple of the KV-head count. When only the KV heads fail and
        the degree is a multiple of them, the fix is `{{style: colwise, heads:
        auto}}`; otherwise the message lists the degrees that divide every head
        count.
    """,
    why="""
        Attention views each rank's projection as `n_heads / tp` heads of
        `head_dim`. When the degree does not divide the head count (GQA models
        have few KV heads: 8 for Llama 3 8B), a rank would hold part of a head;
        the view fails or, worse, mixes features of two heads. torch finds out
        in the first forward (transformers#48307, torchtitan#2574).
    """,
    failing="""
        version: 1
        mesh: {sizes: [2, 3]}
        rules:
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
        mesh: {sizes: [2, 4, 8]}
        rules:
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
