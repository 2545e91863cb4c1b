"""TP305: expert styles on a module without the expert dim first on its parameters (or, for
expert_tp on a layout other than transformers', without params), or a degree that does not
divide what they shard (the experts for expert_parallel, their intermediate dim for expert_tp)."""

from __future__ import annotations

from ..registry import Finding, LintRule
from ..text import degrees_that_work, rule_ref


def _sharded_sizes(module, rule) -> list[tuple[str, int, int]]:
    """(parameter, size of its sharded dim, blocks) under the rule's placements."""
    out = []
    for name, placement in rule.spec.param_placements(module).items():
        if placement.kind != "shard":
            continue
        param = module._parameters[name]
        dim = placement.dim % param.dim() if -param.dim() <= placement.dim < param.dim() else None
        out.append((name, param.shape[dim] if dim is not None else -1, placement.blocks))
    return out


def check(ctx):
    from ...core.expert_styles import is_experts_module, not_experts

    for fqn, rule in ctx.matched.items():
        style, experts = rule.spec.style, rule.spec.semantics.experts
        if experts is None:
            continue
        module = ctx.modules[fqn]
        if not is_experts_module(module):
            exc = not_experts(style, module)  # its text ends with the fix
            yield Finding(ctx.at(rule), f"'{fqn or '<root>'}' ({rule_ref(rule)}): {exc}")
            continue
        try:
            sizes = _sharded_sizes(module, rule)
        except ValueError as exc:
            yield Finding(ctx.at(rule), f"{style} params on '{fqn}' ({rule_ref(rule)}): {exc}")  # a StyleInputError: it ends with the fix
            continue
        for tp in ctx.tp_sizes:
            for name, size, blocks in sizes:
                if size < 0:
                    yield Finding(ctx.at(rule), f"{style} on '{fqn}' ({rule_ref(rule)}) shards '{name}' on a dim it does not have")
                    break
                if size % (blocks * tp) == 0:
                    continue
                if experts == "whole":
                    what = f"{size} experts of '{fqn}'"
                    fix = f"degrees that work: {degrees_that_work(size)}, or expert_tp (shards each expert instead)"
                else:
                    block = f" ({blocks} blocks of {size // blocks})" if blocks > 1 else ""
                    what = f"dim of size {size}{block} that '{fqn}.{name}' is sharded on"
                    fix = f"degrees that work: {degrees_that_work(size // blocks)}"
                yield Finding(ctx.at(rule), (
                    f"tp ({tp}) does not divide the {what} ({style}, {rule_ref(rule)}): every rank needs an equal "
                    f"share; {fix}"
                ))
                break


RULE = LintRule(
    code="TP305",
    name="expert-divisibility",
    severity="error",
    summary="expert_tp / expert_parallel on a module without the expert dim first, params it cannot take, or a degree that does not divide them.",
    what="""
        For every rule with `expert_tp` or `expert_parallel`: the module must
        have the expert dim first on every own parameter (at least 2-D, one
        common first size E: transformers' fused `experts`, torchtitan's
        `GroupedExperts` with `w1`/`w2`/`w3`). `expert_tp` has default
        placements only for transformers' layout (`gate_up_proj` or `up_proj`,
        and `down_proj`); any other layout needs `params`, and the checks read
        the placements the plan declares. For every TP degree
        checked, `expert_parallel` (either dispatch: `all_reduce` on replicated
        tokens, `all_to_all` on sharded tokens) needs the degree to divide the
        number of experts E (each rank holds E / tp whole experts); `expert_tp` needs it
        to divide every dim it shards: the intermediate size I of each packed
        gate/up block (`packed_shard(D, 2)` splits each of the 2 blocks) and of
        `down_proj`. `params` must name the module's own parameters, on dims they have.
    """,
    why="""
        The styles split these dims evenly, like colwise splits out_features:
        uneven experts would leave a rank with fewer experts than the routing
        assumes, and an uneven intermediate dim would pair one rank's gate rows
        with another's up rows. torch finds out only when the plan is applied.
    """,
    model="tpplan.models.hf:mixtral",
    failing="""
        version: 1
        mesh: {sizes: [3]}
        rules:
          model.layers.*.mlp.experts: expert_parallel
    """,
    passing="""
        version: 1
        mesh: {sizes: [2, 4]}
        rules:
          model.layers.*.mlp.experts: expert_parallel
    """,
    check=check,
)
