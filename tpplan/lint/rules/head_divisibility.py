"""TP311: a TP degree that does not divide the attention heads a rule splits."""

from __future__ import annotations

from ..facts import head_split
from ..registry import Finding, LintRule
from ..text import degrees_that_work, rule_ref


def check(ctx):
    # One finding per (rule, degree, attention module): its projections share the verdict.
    found: dict[tuple, tuple] = {}
    for fqn, rule in ctx.matched.items():
        split = head_split(ctx, fqn, rule)
        if split is None:
            continue
        heads, counts, _ = split
        replicates = getattr(rule.spec, "heads", None) is not None
        for tp in ctx.tp_sizes:
            # colwise with heads also takes a multiple of a KV-head count (those heads replicated)
            bad = [(name, count) for name, count in counts if count % tp and not (replicates and _is_kv(name) and tp % count == 0)]
            if bad:
                key = (id(rule), tp, heads.owner)
                _, _, _, names, modules = found.setdefault(key, (rule, tp, heads, {}, []))
                names.update(bad)
                modules.append(fqn)
    for rule, tp, heads, names, modules in found.values():
        what = " and ".join(f"{name} ({count})" for name, count in names.items())
        shown = ", ".join(f"'{m}'" for m in modules)
        all_counts = dict(heads.counts)
        query = [count for name, count in all_counts.items() if not _is_kv(name)]
        if not replicates and all(_is_kv(n) and tp % c == 0 for n, c in names.items()) and all(q % tp == 0 for q in query):
            fix = (f"replicate the KV heads instead: give '{rule.pattern}' {{style: colwise, heads: auto}} (rank r then "
                   f"holds KV head r // (tp / heads), whole, and their gradients are summed)")
        else:
            fix = f"degrees that work: {degrees_that_work(*all_counts.values())}"
            if replicates:
                fix += " (with heads, also the multiples of the KV heads that divide the query heads)"
        yield Finding(ctx.at(rule), (
            f"tp ({tp}) must divide {what} of '{heads.owner or '<root>'}' ({rule_ref(rule)}): {rule.spec.style} splits "
            f"{shown} into heads of {heads.head_dim} and each rank needs whole heads; {fix}"
        ))


def _is_kv(name: str) -> bool:
    return "kv" in name or "key_value" in name


RULE = LintRule(
    code="TP311",
    name="head-divisibility",
    severity="error",
    summary="A TP degree does not divide the attention heads (or KV heads) a rule splits.",
    what="""
        For every TP degree checked and every Linear a colwise or rowwise rule
        shards, looks for head counts on the module's parents or their
        `config`: `n_heads`, `num_heads`, `num_attention_heads`, `n_head`, and
        `n_kv_heads`, `num_key_value_heads`, `num_kv_heads`, with `head_dim`
        (or the hidden size divided by the head count). When the sharded
        features are exactly `count x head_dim`, the degree must divide that
        count; for colwise with `heads` (KV heads replicated) the degree may
        also be a multiple of the KV-head count. When only the KV heads fail and
        the degree is a multiple of them, the fix is `{style: colwise, heads:
        auto}`; otherwise the message lists the degrees that divide every head
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
