"""TP325: a parameter left replicated that computes on sharded activations (or a whole
tensor computed from parameters that meets a shard or a partial sum): its gradient on
each rank is that rank's share only (partial)."""

from __future__ import annotations

from ...core.problems import Fix
from ..registry import Finding, LintRule
from ..text import generalize, shard_text, styled


def partial_grad_params(ctx, leak) -> list[str] | None:
    """The parameters of the module a plain shard reaches (`leak`, where='module') when
    the module can compute on the shard as it is (it is no Linear/Embedding, and every
    parameter broadcasts over the sharded dim): then only their gradients are wrong,
    and `local_params` on the module fixes it. None when the module needs the whole tensor."""
    from torch import nn

    if leak.where != "module" or leak.value.kind != "S":
        return None
    if leak.sequence and not leak.value.src.rule.spec.semantics.feature_sharded_output:
        return None  # a sequence shard (TP322): sequence_parallel is the fix there
    module = ctx.modules.get(leak.fqn)
    if module is None or isinstance(module, (nn.Linear, nn.Embedding)):
        return None
    params = list(module.named_parameters())
    if not params:
        return None
    ndim, dim = len(leak.shape), leak.value.dim
    for _, param in params:
        # right-aligned broadcasting: the parameter's dim facing the sharded one must be absent or 1
        offset = dim - (ndim - param.dim())
        if param.dim() > ndim or (offset >= 0 and param.shape[offset] != 1):
            return None
    return [name for name, _ in params]


def findings(ctx):
    """(leak, parameter names) for every leak this rule reports (TP321 and TP322 skip them)."""
    if ctx.flow is None or not ctx.splits:
        return []  # at TP 1 each rank's share of a gradient is all of it
    cached = ctx.__dict__.get("_partial_grad")
    if cached is None:
        cached = [(leak, names) for leak in ctx.flow.leaks if (names := partial_grad_params(ctx, leak)) is not None]
        ctx.__dict__["_partial_grad"] = cached
    return cached


def claims(ctx, leak) -> bool:
    return any(found is leak for found, _ in findings(ctx))


def check(ctx):
    for leak, names in findings(ctx):
        src = leak.value.src
        module = ctx.modules[leak.fqn]
        shown = ", ".join(f"'{n}'" for n in names)
        yield Finding(ctx.at(src.rule), (
            f"the local {shard_text(leak.value.dim, len(leak.shape))} {leak.shape} that {styled(src.fqn, src.rule)} returns "
            f"reaches '{leak.fqn}' ({type(module).__name__}), whose parameters {shown} no rule covers: they stay whole on "
            f"every rank but compute on this rank's slice only, so each rank's gradient of them is its share (partial) and "
            f"the ranks' copies drift apart in training; add the rule '{generalize(leak.fqn)}: local_params' (replicated "
            f"parameters whose gradients are summed over the mesh)"
        ), fixes=() if leak.fqn in ctx.matched else (
            Fix(leak.fqn, "local_params", True,
                f"replicated parameters ({', '.join(names)}) computing on sharded activations: their gradients are summed"),))
    if ctx.flow is None or not ctx.splits:
        return
    for found in ctx.flow.shared_operands:
        src, ndim = found.value.src, len(found.shape)
        inside = f" inside '{found.fqn}'" if found.fqn else ""
        what = f"local {shard_text(found.value.dim, ndim)}" if found.value.kind == "S" else "local partial sum"
        share = "covers its own slice only" if found.value.kind == "S" else "is its share of a sum"
        producer = (f" (returned by '{found.producer}')" if found.returned else f" (from the output of '{found.producer}')") if found.producer else ""
        site = _fix_site(ctx, found.producer)
        if found.producer is None:
            fix = "sum that tensor's gradient over the mesh (sum_output_grad on the module that returns it)"
        elif site is not None and ctx.matched.get(found.producer) is site:  # its rule leaves the gradient a share
            fix = (f"make the rule for '{site.pattern}' (now {site.spec.style}) '{generalize(found.producer)}: sum_output_grad' "
                   "(its output's gradient summed over the mesh)")
        else:
            fix = f"add the rule '{generalize(found.producer)}: sum_output_grad' (its output's gradient summed over the mesh)"
        yield Finding(ctx.at(site or src.rule), (
            f"the {what} {found.shape} that {styled(src.fqn, src.rule)} returns meets, in "
            f"'{found.op}'{inside}, a whole tensor computed from parameters{producer}: each rank's gradient of that tensor "
            f"{share} (partial), so the parameters before it get a rank's share of their gradient; {fix}"
        ))


def _fix_site(ctx, producer: str | None):
    """The rule where the fix goes: the one styling the module to sum at (it does not sum
    its output's gradient, or there would be nothing to report), else the innermost rule
    around it (a MoE's, whose router it leaves alone); None when no rule covers either."""
    while producer:
        rule = ctx.matched.get(producer)
        if rule is not None:
            return rule
        producer = producer.rpartition(".")[0]
    return None


RULE = LintRule(
    code="TP325",
    name="replicated-partial-grad",
    severity="error",
    summary="A parameter left replicated computes on sharded activations or partial sums, so its gradient is partial.",
    what="""
        Follows the layout flow to each module with parameters that no rule
        covers and that receives a local shard (a colwise output, say), where
        the module can compute on the shard as it is: it is no Linear or
        Embedding and every parameter broadcasts over the sharded dim (a
        learnable activation such as Apertus's xIELU with `alpha_p`/`alpha_n`
        between a colwise and a rowwise projection, or Qwen3's per-head
        `q_norm`/`k_norm` on head-sharded queries). It is reported at the rule
        whose output reaches the module; the fix is `local_params` on the
        module (transformers' `replicated_with_grad_allreduce`), which
        `import-hf --minimal` adds.

        The same holds for a whole tensor computed from parameters that meets
        a local shard or a partial sum in an op: `R * S` is a shard and
        `R * P`, `R @ P` a partial sum, fine in forward, but the gradient of
        the whole operand is then each rank's share (partial). The lint follows
        it back to the output of a module with parameters of its own (a MoE
        router's `gate`, whose scores weigh the experts' partial outputs after
        the experts) and names `sum_output_grad` there, reported at the rule
        that covers that module or, if none does, the innermost rule around it
        (the MoE's), else at the rule whose shard it meets.
    """,
    why="""
        The forward is right, so nothing fails and outputs match one device.
        But each rank sees only its slice of the activations, so the gradient
        of the replicated parameter on each rank is that rank's share, not the
        sum: the optimizer steps differ per rank, the copies drift apart, and
        the model trains wrong (transformers' own Apertus plan, found only by
        comparing gradients with `apply --check`; torchtitan 0.2.2's
        DeepSeek-V3 MoE router gate, pytorch/torchtitan#2387).
    """,
    model="tpplan.models.hf:apertus",
    failing="""
        version: 1
        mesh: {sizes: [2]}
        rules:
          model.layers.*.mlp:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
          model.layers.*.mlp.up_proj: colwise
          model.layers.*.mlp.down_proj: rowwise
    """,
    passing="""
        version: 1
        mesh: {sizes: [2]}
        rules:
          model.layers.*.mlp:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
          model.layers.*.mlp.up_proj: colwise
          model.layers.*.mlp.act_fn: local_params
          model.layers.*.mlp.down_proj: rowwise
    """,
    check=check,
)
