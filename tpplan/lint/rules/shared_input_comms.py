"""TP340: colwise siblings that each pay a collective for the same input."""

from __future__ import annotations

from collections import defaultdict

from ...core.problems import Fix
from ..registry import Finding, LintRule
from ..text import generalize, plural, rule_ref, shard_text


def _receivers(enclosing, node):
    """The modules running around a call (`enclosing`) that take `node` as an argument,
    innermost first: (fqn, positional index or keyword, call)."""
    for fqn, call in reversed(enclosing):
        for index, arg in enumerate(call.args):
            if arg == node:
                yield fqn, index, call
                break
        else:
            for key, arg in call.kwargs.items():
                if arg == node:
                    yield fqn, key, call
                    break


def _receiver(siblings, node):
    """The innermost module running around the siblings that takes `node` as an
    argument: (fqn, positional index or keyword, call), or None."""
    return next(_receivers(siblings[0].enclosing, node), None)


def _fix(ctx, siblings, node, layout: str) -> str:
    found = _receiver(siblings, node)
    producer = siblings[0].value.src
    if found is None:
        if producer is not None:
            return f"make '{producer.rule.pattern}' ({rule_ref(producer.rule)}) return a DTensor (use_local_output: false)"
        return "make the shared input one DTensor before the siblings use it"
    fqn, where, call = found
    rule = ctx.matched.get(fqn)
    if rule is not None:
        if rule.spec.semantics.inputs == "layouts" and rule.spec.inputs_local():
            return f"set {rule.spec.local_option()}: false on {rule_ref(rule)}"
        return f"have {rule_ref(rule)} hand '{generalize(fqn)}' its input as a DTensor"
    if isinstance(where, int):
        given = ", ".join(layout if i == where else "null" for i in range(len(call.args)))
        wanted = ", ".join("replicate" if i == where else "null" for i in range(len(call.args)))
        options = (f"input_layouts: [{given}], desired_input_layouts: [{wanted}]" if len(call.args) > 1
                   else f"input_layouts: {layout}, desired_input_layouts: replicate")
    else:
        options = f"input_kwarg_layouts: {{{where}: {layout}}}, desired_input_kwarg_layouts: {{{where}: replicate}}"
    return f"add '{generalize(fqn)}: {{style: prepare_module_input, {options}, use_local_output: false}}'"


def shared_input_fix(ctx, siblings, node) -> tuple[Fix, ...]:
    """The rules _fix proposes, where it is sure of them: a prepare_module_input for the
    innermost module that receives the shared input as an argument around all the siblings,
    when no rule plans that module yet and no child of it holding parameters is left
    unplanned (it would receive the input as a DTensor it cannot take: a MoE router, a norm).
    Where that module cannot take one, the siblings are split by the innermost module that
    receives the input around each, and each part of two or more gets its own: a MoE block's
    experts and its shared expert's gate_proj and up_proj share the block's input, which its
    router must get plain, so the shared expert's two pay one all-reduce, not two."""
    if not siblings[0].needs_grad:
        return ()
    found = _common_receiver(siblings, node)
    if found is not None:
        fqn, where, call = found
        if fqn not in ctx.matched and not _has_unplanned_params(ctx, fqn, {s.fqn for s in siblings}):
            lay = siblings[0].value
            layout = "replicate" if lay.kind == "R" else f"shard({lay.dim})"
            value = {**replicating_input(where, len(call.args), layout), "use_local_output": False}
            return (Fix(fqn, value, True,
                        f"{', '.join(s.fqn.rpartition('.')[2] for s in siblings)} share one {layout} DTensor input: "
                        f"one backward all-reduce, not {len(siblings)}"),)
    parts = defaultdict(list)
    for sibling in siblings:
        inner = _receiver([sibling], node)
        if inner is not None:
            parts[inner[0]].append(sibling)
    # a part of them all has the receiver that could not take the DTensor: each smaller part of two or more is tried
    return tuple(fix for part in parts.values() if 1 < len(part) < len(siblings) for fix in shared_input_fix(ctx, part, node))


def _common_receiver(siblings, node):
    """The innermost module running around every sibling that takes `node` as an argument:
    (fqn, positional index or keyword, call), or None."""
    around = set.intersection(*({fqn for fqn, _ in s.enclosing} for s in siblings))
    return next((found for found in _receivers(siblings[0].enclosing, node) if found[0] in around), None)


def replicating_input(where: int | str, positional: int, layout: str) -> dict:
    """A prepare_module_input that takes the argument at `where` (a position among
    `positional` arguments, or a keyword) as `layout` and hands it on replicated."""
    if isinstance(where, str):
        return {"style": "prepare_module_input", "input_kwarg_layouts": {where: layout},
                "desired_input_kwarg_layouts": {where: "replicate"}}
    if positional == 1:
        return {"style": "prepare_module_input", "input_layouts": layout, "desired_input_layouts": "replicate"}
    return {"style": "prepare_module_input",
            "input_layouts": [layout if i == where else None for i in range(positional)],
            "desired_input_layouts": ["replicate" if i == where else None for i in range(positional)]}


def _has_unplanned_params(ctx, parent: str, siblings: set[str]) -> bool:
    """Whether a child of `parent` holding parameters has no rule, nor any module inside it."""
    module = ctx.modules[parent]
    for name, child in module.named_children():
        fqn = f"{parent}.{name}" if parent else name
        if fqn in siblings or fqn in ctx.matched or not any(True for _ in child.parameters()):
            continue
        if not any(m == fqn or m.startswith(fqn + ".") for m in ctx.matched):
            return True
    return False


def check(ctx):
    if ctx.flow is None:
        return
    by_input = defaultdict(list)
    for entry in ctx.flow.colwise_inputs:
        if entry.value.dt is False and entry.value.kind in ("R", "S"):
            by_input[entry.node].append(entry)
    groups: dict[tuple, list] = {}
    for node, siblings in by_input.items():
        if len(siblings) < 2:
            continue
        lay = siblings[0].value
        if any(s.value != lay for s in siblings):
            continue
        count = len(siblings)
        saved = {}
        if lay.kind == "S":
            saved["all_gather"] = count - 1  # forward: each gathers the shards
            if siblings[0].needs_grad:
                saved["reduce_scatter"] = count - 1
        elif siblings[0].needs_grad:
            saved["all_reduce"] = count - 1  # backward: each all-reduces its input gradient
        if not saved:
            continue
        ndim = len(ctx.trace.shapes[node])
        layout = "replicate" if lay.kind == "R" else shard_text(lay.dim, ndim)
        names = tuple(generalize(s.fqn) for s in siblings)
        key = (id(siblings[0].rule), names, layout, tuple(saved.items()))
        groups.setdefault(key, []).append((node, siblings))
    for (_, _, layout, saved), found in groups.items():
        node, siblings = found[0]
        rule = siblings[0].rule
        shown = ", ".join(f"'{s.fqn}'" for s in siblings)
        per_call = ", ".join(plural(n, op.replace("_", "-")) for op, n in saved)
        total = ", ".join(plural(n * len(found), op.replace("_", "-")) for op, n in saved)
        pays = ("all-gathers it in forward" + (" and reduce-scatters its gradient in backward" if len(saved) > 1 else "")
                if layout != "replicate" else "all-reduces its gradient in backward")
        yield Finding(ctx.at(rule), (
            f"colwise {shown} ({rule_ref(rule)}) each turn the same plain {'replicated' if layout == 'replicate' else 'local ' + layout} "
            "input into a DTensor of their own, "
            f"so each one {pays}: {len(siblings)} times where one would do; {_fix(ctx, siblings, node, layout)} "
            f"to save {per_call} per call ({total} per forward-backward, over {plural(len(found), 'call')})"
        ), fixes=tuple(fix for node, siblings in found for fix in shared_input_fix(ctx, siblings, node)))


RULE = LintRule(
    code="TP340",
    name="shared-input-comms",
    severity="warning",
    summary="Colwise siblings each pay a collective for the same input, where one would do.",
    what="""
        Finds colwise modules that receive the same tensor as a plain local
        tensor (wq, wk and wv reading one normed input; w1 and w3 of a SwiGLU),
        counts the collectives this costs, and proposes the rule that makes the
        input one DTensor before they use it: a prepare_module_input on their
        parent with `use_local_output: false`.
    """,
    why="""
        Each colwise style turns a plain input into a DTensor of its own. Fed a
        replicated tensor, each one all-reduces its partial input gradient in
        backward: three for q/k/v where autograd could first sum the three
        partial gradients of one shared DTensor and all-reduce once. Fed a
        sequence shard, each also all-gathers it in forward. The plan works
        either way; it just moves more bytes than it needs.
    """,
    failing="""
        version: 1
        rules:
          layers.*.attention.w{q,k,v}: colwise
          layers.*.attention.wo: rowwise
    """,
    passing="""
        version: 1
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
