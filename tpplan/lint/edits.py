"""The lint's fixes as edits a tool can apply to a plan's rules (`tpplan init`, and
`init --from plan.yaml` on a plan written by hand).

Where a finding's fix is certain, this module says it as data instead of words:
which rule gets which options, or which module gets a new rule. Each edit comes from
the same facts the rule reads (the layout flow, the head counts), so an edit and the
finding it fixes cannot disagree:

- TP326 (fused projection): `packed` on the colwise rule whose output is cut into kinds;
- TP311 (heads): `heads: auto` where only the KV heads fail and the degree is a multiple of them;
- TP325 (replicated partial gradient): a `local_params` rule on the module;
- TP321/TP322 (a shard meets a module's own parameter that sharded the same way fits it,
  per-head attention sinks): that parameter in the `params` of a `local_params` rule on
  its module (a new rule, or the module's local_params or prepare_module_input rule
  turned into one);
- TP340 (shared input): a `prepare_module_input` on the parent whose colwise children
  each turn the same plain input into a DTensor (one backward all-reduce instead of one per child).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import LintContext


@dataclass(frozen=True)
class Edit:
    code: str  # the lint code whose fix this is
    key: str  # add: the module that gets a rule; else: the pattern of the rule that changes
    options: dict  # add: the whole rule value; else: the options set on the rule
    add: bool
    why: str


def with_options(value: Any, options: dict) -> Any:
    """A rule value (shorthand string or mapping) with `options` set on it."""
    mapping = {"style": value} if isinstance(value, str) else dict(value)
    return {**mapping, **options}


def lint_edits(ctx: "LintContext") -> list[Edit]:
    """Every edit the lint is sure of for `ctx`'s plan, model and degrees (in the order above)."""
    edits, added = [], set()
    for edit in [*_packed(ctx), *_heads(ctx), *_local_params(ctx), *_shared_inputs(ctx), *_param_shards(ctx)]:
        if edit.add and edit.key in added:
            continue  # one new rule per module: the next round sees it (and edits it)
        added.update([edit.key] if edit.add else [])
        edits.append(edit)
    return edits


def _packed(ctx) -> list[Edit]:
    from ..core.globs import generalize

    if ctx.flow is None:
        return []
    out, seen = [], set()
    for fused in ctx.flow.fused:
        rule = fused.value.src.rule
        if fused.where != "split" or not fused.pieces or len(fused.pieces) < 2 or rule.pattern in seen:
            continue
        seen.add(rule.pattern)
        pieces = list(fused.pieces)
        packed = len(pieces) if len(set(pieces)) == 1 else pieces
        out.append(Edit("TP326", rule.pattern, {"packed": packed}, False,
                        f"its output is cut into {len(pieces)} kinds by '{fused.detail}' in '{generalize(fused.fqn)}': each rank takes its slice of every block"))
    return out


def _heads(ctx) -> list[Edit]:
    from .rules.head_divisibility import failing_counts, heads_auto_fixes

    out, seen = [], set()
    for fqn, rule in ctx.matched.items():
        if rule.pattern in seen or getattr(rule.spec, "heads", None) is not None:
            continue
        split = ctx.heads.split(fqn, rule)
        if split is None or "heads" not in type(rule.spec).model_fields:  # the styles that can replicate heads
            continue
        heads, counts, _ = split
        for tp in ctx.tp_sizes:
            bad = failing_counts(counts, tp, replicates=False)
            if heads_auto_fixes(tp, bad, heads.counts):
                seen.add(rule.pattern)
                out.append(Edit("TP311", rule.pattern, {"heads": "auto"}, False,
                                f"TP {tp} is a multiple of the {bad[0][1]} KV heads of '{heads.owner}': each is replicated on {tp // bad[0][1]} ranks"))
                break
    return out


def _local_params(ctx) -> list[Edit]:
    from .rules.replicated_partial_grad import findings

    out, seen = [], set()
    for leak, names in findings(ctx):
        if leak.fqn in seen or leak.fqn in ctx.matched:
            continue
        seen.add(leak.fqn)
        out.append(Edit("TP325", leak.fqn, "local_params", True,  # type: ignore[arg-type]
                        f"replicated parameters ({', '.join(names)}) computing on sharded activations: their gradients are summed"))
    return out


def _param_shards(ctx) -> list[Edit]:
    """A module's own parameter sharded as the activation it meets (flow.py's OwnParam): in
    the params of a local_params rule on it. Only where no parameter of the module turns
    from a plain tensor into a replicated one with a summed gradient (local_params' default),
    which would be wrong for one used whole."""
    from ..core.globs import generalize

    if ctx.flow is None or not ctx.splits:
        return []
    out, seen = [], set()
    for leak in ctx.flow.leaks:
        found = leak.param
        if found is None:
            continue
        rule = ctx.matched.get(found.fqn)
        if rule is not None and not _inputs_only(rule.spec):
            continue
        holds = rule is not None and lays_out_own_params(rule.spec)
        params = {k: str(v) for k, v in ((rule.spec.params or {}) if holds else {}).items()}
        params[found.name] = f"shard({found.dim})"
        own = {k for k, p in ctx.modules[found.fqn]._parameters.items() if p is not None}
        if not holds and own - set(params):
            continue
        key = found.fqn if rule is None else rule.pattern
        if (key, found.name) in seen:
            continue
        seen.add((key, found.name))
        code = "TP322" if leak.sequence else "TP321"
        why = (f"{found.name} sharded on dim {found.dim}, as the local shard of '{generalize(leak.value.src.fqn)}' it meets: "
               "each rank holds its own part")
        out.append(Edit(code, key, {"style": "local_params", "params": params}, rule is None, why))
    return out


def lays_out_own_params(spec) -> bool:
    """Whether the style lays out its module's own parameters by an option (local_params' `params`)."""
    return "params" in type(spec).model_fields


def _inputs_only(spec) -> bool:
    """Whether the style does nothing but lay out its module's inputs (the table's semantics):
    such a rule can become local_params, its input options kept."""
    contract = spec.semantics.contract.tp
    return spec.semantics.inputs == "layouts" and not contract.outputs and not contract.state and contract.body == "traced"


def _shared_inputs(ctx) -> list[Edit]:
    """A prepare_module_input for the innermost module that receives, as an argument, the
    plain input two or more colwise siblings share (the receiver TP340's fix names)."""
    from collections import defaultdict

    from .rules.shared_input_comms import _receiver

    if ctx.flow is None:
        return []
    by_input = defaultdict(list)
    for entry in ctx.flow.colwise_inputs:
        if entry.value.dt is False and entry.value.kind in ("R", "S") and entry.needs_grad:
            by_input[entry.node].append(entry)
    out, seen = [], set()
    for node, siblings in by_input.items():
        if len(siblings) < 2 or any(s.value != siblings[0].value for s in siblings):
            continue
        found = _receiver(siblings, node)
        if found is None:
            continue
        fqn, where, call = found
        if fqn in seen or fqn in ctx.matched or _has_unplanned_params(ctx, fqn, {s.fqn for s in siblings}):
            continue
        seen.add(fqn)
        lay = siblings[0].value
        layout = "replicate" if lay.kind == "R" else f"shard({lay.dim})"
        value = {**replicating_input(where, len(call.args), layout), "use_local_output": False}
        out.append(Edit("TP340", fqn, value, True,
                        f"{', '.join(s.fqn.rpartition('.')[2] for s in siblings)} share one {layout} DTensor input: one backward all-reduce, not {len(siblings)}"))
    return out


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
    """Whether a child of `parent` holding parameters has no rule: it would receive the
    parent's input as a DTensor it cannot take (a MoE router, a norm)."""
    module = ctx.modules[parent]
    for name, child in module.named_children():
        fqn = f"{parent}.{name}" if parent else name
        if fqn in siblings or fqn in ctx.matched or not any(True for _ in child.parameters()):
            continue
        planned_inside = any(m == fqn or m.startswith(fqn + ".") for m in ctx.matched)
        if not planned_inside:
            return True
    return False
