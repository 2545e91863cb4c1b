"""TP304: a keyword layout that no call ever uses."""

from __future__ import annotations

import inspect

from ..registry import Finding, LintRule
from ..text import rule_ref


def _parameters(module):
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None


def check(ctx):
    passed: dict[str, set] = {}
    if ctx.flow is not None:
        for call in ctx.flow.calls:
            passed.setdefault(call.fqn, set()).update(call.keywords)
    for fqn, rule in ctx.matched.items():
        layouts = getattr(rule.spec, "input_kwarg_layouts", None)
        if not layouts:
            continue
        module = ctx.modules[fqn]
        parameters = _parameters(module)
        open_ended = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        for key in layouts:
            if not open_ended and key not in parameters:
                yield Finding(ctx.at(rule), (
                    f"input_kwarg_layouts names '{key}', but {type(module).__name__}.forward({', '.join(parameters)}) "
                    f"of '{fqn or '<root>'}' has no such parameter ({rule_ref(rule)}): the layout is never applied; "
                    "use the parameter's name"
                ))
            elif fqn in passed and key not in passed[fqn]:
                yield Finding(ctx.at(rule), (
                    f"input_kwarg_layouts names '{key}', but the traced forward never passes '{key}' to "
                    f"'{fqn or '<root>'}' by keyword ({rule_ref(rule)}): torch lays out keyword inputs by name only, "
                    "so this layout is never applied; lay out a positional input with input_layouts instead"
                ))


RULE = LintRule(
    code="TP304",
    name="unused-kwarg-layout",
    severity="warning",
    summary="input_kwarg_layouts names a keyword that never reaches the module.",
    what="""
        Checks each key of `input_kwarg_layouts` against the module's `forward`
        parameters, and against the keywords the traced forward actually passes.
    """,
    why="""
        PrepareModuleInput lays out keyword inputs by name and silently ignores
        names it never sees: a misspelt key, or an input the caller passes
        positionally, keeps its local layout, with no error.
    """,
    failing="""
        version: 1
        rules:
          layers.*.attention:
            style: prepare_module_input
            input_layouts: [replicate, null]
            desired_input_layouts: [replicate, null]
            input_kwarg_layouts: {freqs: replicate}
            desired_input_kwarg_layouts: {freqs: replicate}
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
