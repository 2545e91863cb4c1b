"""The one addition `import-hf --minimal` makes for communication: a parent whose
column-parallel children share one replicated DTensor input."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any


def parents_sharing_input(rules: Mapping[str, Any], model) -> dict[str, dict]:
    """prepare_module_input rules that make a parent's input one replicated DTensor
    for its column-parallel children, so backward all-reduces it once, not once per child.

    Only for parents no rule plans yet (a local_params attention holding sinks), with two
    or more plain colwise children and no unplanned child holding parameters (a MoE router, say, could not take a DTensor input).
    transformers' decoder layers call attention by keyword (`hidden_states=`) and
    MLPs positionally; tests/test_hf.py checks both by parity.
    """
    from ..core.globs import ModuleTree, compile_glob, generalize
    from ..core.schema import rule_spec

    modules = dict(model.named_modules())
    tree = ModuleTree(modules)
    matched = {pattern: tree.match(compile_glob(pattern)) for pattern in rules}
    planned = {name for names in matched.values() for name in names}
    colwise_children: dict[str, list[str]] = defaultdict(list)
    for pattern, names in matched.items():
        spec = rule_spec(rules[pattern])
        inputs = spec.semantics.contract.tp.inputs  # a plain colwise (no options): its input whole, its gradient summed
        if inputs and inputs[0].grad == "sum" and spec.model_fields_set == {"style"}:
            for name in names:
                colwise_children[name.rpartition(".")[0]].append(name)
    qualifying = {}
    for parent, children in colwise_children.items():
        module = modules[parent]
        unplanned = [
            name
            for name, child in module.named_children()
            if f"{parent}.{name}" not in planned and any(True for _ in child.parameters())
        ]
        if len(children) >= 2 and not unplanned and parent not in planned:  # a module takes one style
            qualifying[parent] = module
    added: dict[str, dict] = {}
    for parent, module in qualifying.items():
        # One glob for all layers, unless it would also reach a parent that does not
        # qualify (a sparse MoE block beside dense MLPs): then this layer's own path.
        general = generalize(parent)
        key = general if set(tree.match(compile_glob(general))) <= set(qualifying) else parent
        if type(module).__name__.endswith("Attention"):
            added[key] = {
                "style": "prepare_module_input",
                "input_kwarg_layouts": {"hidden_states": "replicate"},
                "desired_input_kwarg_layouts": {"hidden_states": "replicate"},
            }
        else:
            added[key] = {"style": "prepare_module_input", "input_layouts": "replicate", "desired_input_layouts": "replicate"}
    return added
