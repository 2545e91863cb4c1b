"""TP303: a style's inputs or outputs cannot line up with the module's forward."""

from __future__ import annotations

import inspect

from ...core.style_model import MODULE_KINDS
from ..facts import module_kind
from ..registry import Finding, LintRule
from ..text import plural, rule_ref


def forward_signature(module) -> tuple[list[str], int, bool] | None:
    """(positional parameter names, how many are required, takes *args) of
    `module.forward`, or None when Python cannot tell."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    positional = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    varargs = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    return [p.name for p in positional], required, varargs


def _signature_text(module, names: list[str], varargs: bool) -> str:
    return f"{type(module).__name__}.forward({', '.join(names + (['*args'] if varargs else []))})"


def check(ctx):
    yield from _static(ctx)
    if ctx.flow is not None:
        yield from _observed(ctx)


def _static(ctx):
    seen = set()
    for fqn, rule in ctx.matched.items():
        spec, module = rule.spec, ctx.modules[fqn]
        layouts = getattr(spec, "input_layouts", None)
        if spec.semantics.inputs != "layouts" or layouts is None:
            continue
        if (id(rule), type(module)) in seen:
            continue
        signature = forward_signature(module)
        if signature is None:
            continue
        seen.add((id(rule), type(module)))
        names, _, varargs = signature
        if len(layouts) > len(names) and not varargs:
            yield Finding(ctx.at(rule), (
                f"{spec.style} gives {plural(len(layouts), 'input layout')} but "
                f"{_signature_text(module, names, varargs)} of '{fqn or '<root>'}' takes at most "
                f"{plural(len(names), 'positional input')} ({rule_ref(rule)}): torch raises 'module inputs and "
                f"input_layouts should have same length!' on every call; give one entry per positional input "
                f"({', '.join(names) or 'none'}), null for those to leave alone"
            ))


def _observed(ctx):
    for call in ctx.flow.calls:
        spec, module = call.rule.spec, ctx.modules.get(call.fqn)
        name = call.fqn or "<root>"
        passed = f"{plural(call.positional, 'positional input')}" + (
            f" (and {', '.join(call.keywords)} by keyword)" if call.keywords else ""
        )
        inputs = spec.semantics.inputs
        if inputs == "layouts" and spec.input_layouts is not None:
            if len(spec.input_layouts) != call.positional:
                fix = (
                    f"give {call.positional} entries" if call.positional else "drop input_layouts"
                ) + (", and lay out keyword inputs with input_kwarg_layouts" if call.keywords else "")
                yield Finding(ctx.at(call.rule), (
                    f"{spec.style} gives {plural(len(spec.input_layouts), 'input layout')} but '{name}' is called "
                    f"with {passed} ({rule_ref(call.rule)}): torch raises 'module inputs and input_layouts "
                    f"should have same length!'; {fix}"
                ))
        elif inputs == "first" and call.positional > 1 and _applicable(ctx, call) and not _hands_on_more(ctx, call):
            signature = forward_signature(module)
            shown = f" of {_signature_text(module, signature[0], signature[2])}" if signature else ""
            yield Finding(ctx.at(call.rule), (
                f"{spec.style} hands '{name}' only its first positional input, but it is called with {passed}{shown} "
                f"({rule_ref(call.rule)}): torch drops the others and the forward fails; put {spec.style} on a "
                "module called with one input (a Linear, a norm), or prepare the inputs with prepare_module_input"
            ))
        elif inputs == "first_tensor" and not call.first_is_tensor:
            yield Finding(ctx.at(call.rule), (
                f"{spec.style} lays out the first positional input of '{name}', but it is called with {passed} and "
                f"the first is not a tensor ({rule_ref(call.rule)}): {spec.semantics.torch_class.rpartition(':')[2]} refuses it in the forward; put it on a "
                "module whose first positional input is a tensor"
            ))
    for site in ctx.flow.outputs:
        spec = site.rule.spec
        if len(spec.output_layouts) != site.count:
            yield Finding(ctx.at(site.rule), (
                f"{spec.style} gives {plural(len(spec.output_layouts), 'output layout')} but '{site.fqn or '<root>'}' "
                f"returns {plural(site.count, 'output')} ({rule_ref(site.rule)}): torch raises 'module outputs and "
                f"output_layouts should have same length!'; give {site.count} entries, null for those to leave alone"
            ))


def _applicable(ctx, call) -> bool:
    """A style on a module of a kind it does not shard is TP300's, whatever its inputs."""
    kinds = call.rule.spec.semantics.contract.tp.kinds
    return not kinds or module_kind(ctx.modules.get(call.fqn)) in kinds


def _hands_on_more(ctx, call) -> bool:
    """A kind whose styles hand on its other positional inputs (stacked Linears' expert_size)."""
    kind = module_kind(ctx.modules.get(call.fqn))
    return kind is not None and MODULE_KINDS[kind].more_inputs


RULE = LintRule(
    code="TP303",
    name="style-arity",
    severity="error",
    summary="A style's input or output layouts cannot line up with how the module is called.",
    what="""
        Compares each `prepare_module_input` / `prepare_module_output` rule's
        layout lists with the module's `forward` signature and with the calls
        and returns seen in a traced forward; checks that `colwise`, `rowwise`
        and `sequence_parallel` modules are called with one positional input and
        that a `no_parallel` module's first positional input is a tensor.
    """,
    why="""
        torch checks these at run time only: PrepareModuleInput raises when the
        number of positional inputs differs from `input_layouts` (inputs passed
        by keyword do not count: HuggingFace attention is called entirely by
        keyword), and the Linear-style hooks silently drop every positional
        input after the first.
    """,
    failing="""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_layouts: replicate
            desired_input_layouts: replicate
            use_local_output: false
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
