"""TP321: a local shard reaches something that needs the whole tensor."""

from __future__ import annotations

from ...core.problems import Fix
from .replicated_partial_grad import claims
from ..registry import Finding, LintRule
from ..text import generalize, shard_text, styled


def leak_message(leak) -> str:
    lay, ndim = leak.value, len(leak.shape)
    what = f"the local {shard_text(lay.dim, ndim) if lay.kind == 'S' else 'partial sum'} {leak.shape} that {styled(lay.src.fqn, lay.src.rule)} returns"
    inside = f" inside '{leak.fqn}'" if leak.fqn else ""
    if leak.where == "module":
        return f"{what} reaches '{leak.fqn}' ({leak.detail}), a module with parameters that no rule covers"
    if leak.where == "output":
        return f"{what} is what the model returns: callers get one rank's piece"
    if leak.where == "partial":
        return (f"the partial sum {leak.shape} that {styled(lay.src.fqn, lay.src.rule)} computes (each rank's share, reduced when "
                f"the module returns) goes through '{leak.detail}'{inside}, which is not linear: the ranks' results do not add up "
                "to the result")
    if leak.where == "reduce":
        return f"{what} is reduced over its sharded dim by '{leak.detail}'{inside}: each rank computes on its part only"
    return f"{what} meets a tensor of full size in '{leak.detail}'{inside}: a shape error at run time, or wrong values"


def own_param_fix(ctx, leak) -> str | None:
    """The fix of a leak into a module's own parameter (per-head sinks) that, sharded as the
    activation is, fits it: that parameter laid out by local_params on its module."""
    found = leak.param
    if found is None:
        return None
    layout = f"{{{found.name}: shard({found.dim})}}"
    rule = ctx.matched.get(found.fqn)
    where = f"'{generalize(found.fqn)}'"
    if rule is not None and lays_out_own_params(rule.spec):
        how = f"add {found.name}: shard({found.dim}) to the params of {styled(found.fqn, rule)}"
    else:
        how = f"give {where} {{style: local_params, params: {layout}}}"
    size = leak.shape[leak.value.dim]
    return (f"that tensor comes straight from the parameter '{generalize(found.fqn)}.{found.name}' of the module it "
            f"runs in, whose dim {found.dim} is as long as the sharded dim ({size}): shard it the same way, {how} "
            "(each rank holds the entries of its own part)")


def own_param_fixes(ctx, leak) -> tuple[Fix, ...]:
    """The edit own_param_fix says, where it is sure: the parameter in the `params` of a
    local_params rule on its module (a new rule, or the module's local_params or
    prepare_module_input rule turned into one). Only where no parameter of the module turns
    from a plain tensor into a replicated one with a summed gradient (local_params' default),
    which would be wrong for one used whole."""
    found = leak.param
    if found is None:
        return ()
    rule = ctx.matched.get(found.fqn)
    if rule is not None and not _inputs_only(rule.spec):
        return ()
    holds = rule is not None and lays_out_own_params(rule.spec)
    params = {k: str(v) for k, v in ((rule.spec.params or {}) if holds else {}).items()}
    params[found.name] = f"shard({found.dim})"
    own = {k for k, p in ctx.modules[found.fqn]._parameters.items() if p is not None}
    if not holds and own - set(params):
        return ()
    why = (f"{found.name} sharded on dim {found.dim}, as the local shard of '{generalize(leak.value.src.fqn)}' it meets: "
           "each rank holds its own part")
    return (Fix(found.fqn if rule is None else rule.pattern, {"style": "local_params", "params": params}, rule is None, why),)


def lays_out_own_params(spec) -> bool:
    """Whether the style lays out its module's own parameters by an option (local_params' `params`)."""
    return "params" in type(spec).model_fields


def _inputs_only(spec) -> bool:
    """Whether the style does nothing but lay out its module's inputs (the table's semantics):
    such a rule can become local_params, its input options kept."""
    contract = spec.semantics.contract.tp
    return spec.semantics.inputs == "layouts" and not contract.outputs and not contract.state and contract.body == "traced"


def check(ctx):
    if ctx.flow is None or not ctx.splits:
        return  # no trace (TP329); or TP 1 only, where every layout is the whole tensor
    for leak in ctx.flow.leaks:
        if leak.sequence:
            continue  # TP322
        if claims(ctx, leak):
            continue  # TP325: only the parameters' gradients are wrong
        src = leak.value.src
        if leak.where == "module":
            fix = (f"it computes on the whole tensor: add a rule for '{generalize(leak.fqn)}' (rowwise, or prepare_module_input with "
                   f"input_layouts: {shard_text(leak.value.dim, len(leak.shape))}), or give '{src.rule.pattern}' "
                   "output_layouts: replicate")
        elif leak.where == "output":
            fix = (f"give '{src.rule.pattern}' output_layouts: replicate, or use_local_output: false to return a "
                   "DTensor (with loss_parallel)")
        elif leak.where == "partial":
            fix = ("keep whole experts per rank instead (expert_parallel with dispatch: all_to_all: each token's rows computed "
                   f"whole), or leave '{src.rule.pattern}' unsharded")
        elif leak.param is not None:
            yield Finding(ctx.at(src.rule), f"{leak_message(leak)}; {own_param_fix(ctx, leak)}", fixes=own_param_fixes(ctx, leak))
            continue
        else:
            fix = (f"give '{src.rule.pattern}' output_layouts: replicate, or shard what it meets with a rule of its own")
        yield Finding(ctx.at(src.rule), f"{leak_message(leak)}; {fix}")


RULE = LintRule(
    code="TP321",
    name="shard-leak",
    severity="error",
    summary="A local shard (or partial sum) reaches a module, op or output that needs the whole tensor.",
    what="""
        Follows the local tensors that colwise (and other styles with
        `use_local_output: true` and a shard or partial layout) return, through
        views, transposes, elementwise ops and attention, and reports the first
        place that needs the whole tensor: a module with parameters that the
        plan leaves alone, an op that meets a tensor of full size or reduces
        over the sharded dim, or the model's output. Shards of the sequence dim
        are TP322's. Where the full tensor an op meets comes straight (through
        views and expands) from a parameter of the module the op runs in, along
        a dim as long as the sharded one (a per-feature scale after a colwise
        Linear, per-head attention sinks), the fix is to shard that parameter
        the same way: `local_params` on the module with `params: {NAME:
        shard(D)}` (`tpplan init` applies it). Inside a module whose style
        reduces its output as a partial sum only when it returns (`expert_tp`),
        a norm or another nonlinear op on that partial sum (transformers'
        Ergo normalizes each route's rows before the module returns) is
        reported too: each rank's result is not its share of the result.
    """,
    why="""
        A colwise Linear hands on one rank's slice of its output features. Only a
        rowwise Linear (or a rule that gathers it) may consume that slice; any
        other module gets a tensor of the wrong width and fails with a shape
        error deep in the forward, or, when shapes happen to broadcast, silently
        computes on part of the features.
    """,
    model="tpplan.models.mlp:tiny",
    failing="""
        version: 1
        rules:
          blocks.*.in_proj: colwise
    """,
    passing="""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """,
    check=check,
)
