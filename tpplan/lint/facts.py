"""Facts about the model that several rules read: attention head counts (read by
core/head_counts.py, as `heads: auto` reads them), and the
placement each parameter gets under the plan (from the style table,
core/style_table.py). The context computes each once (`LintContext.heads`, a `HeadIndex`;
`LintContext.placements`); this module takes the model's modules and the plan's
matches, not the context, which sits above it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.head_counts import head_counts
from ..core.placements import PlacementSpec
from ..core.plan import Rule

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Heads:
    owner: str  # the module the counts were read from
    counts: tuple  # ((attribute, value), ...): query heads, then KV heads (core/head_counts.py)
    head_dim: int | None


class HeadIndex:
    """The head counts inside each module of a model, read once per module as asked."""

    def __init__(self, modules: "dict[str, nn.Module]"):
        self.modules = modules
        self._found: dict[str, Heads | None] = {}

    def of(self, fqn: str) -> Heads | None:
        """The head counts that apply to module `fqn`: those of its closest ancestor
        (itself excluded: a Linear has none) that has any."""
        parent = fqn.rpartition(".")[0] if "." in fqn else ("" if fqn else None)
        if parent is None:
            return None
        if parent not in self._found:
            found = head_counts(self.modules[parent]) if parent in self.modules else None
            self._found[parent] = Heads(parent, found.counts, found.head_dim) if found else self.of(parent) if parent else None
        return self._found[parent]

    def split(self, fqn: str, rule: Rule) -> tuple[Heads, list[tuple[str, int]], int] | None:
        """For a Linear sharded by `rule` whose sharded features are whole heads
        (count x head_dim): the heads, the counts it splits, and the sharded size."""
        module = self.modules.get(fqn)
        dim = sharded_weight_dim(module, rule) if module is not None else None
        if dim is None or module_kind(module) != "Linear":
            return None
        size = module.weight.shape[dim]
        heads = self.of(fqn)
        if heads is None or heads.head_dim is None:
            return None
        if heads.owner == "" and "att" not in fqn.lower():
            # Counts on the model's own config describe attention only; elsewhere (an FFN as
            # wide as the model) an equal size is a coincidence.
            return None
        split = [(name, count) for name, count in heads.counts if count * heads.head_dim == size]
        return (heads, split, size) if split else None


def nested_parameters(module: "nn.Module") -> list[str]:
    """Names of the parameters `module` holds in its submodules: sequence_parallel
    re-registers parameters under these dotted names, which torch refuses."""
    return [name for name, _ in module.named_parameters() if "." in name]


# -- parameter placements ---------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    placement: PlacementSpec | None  # None: left a plain tensor
    module: str
    rule: Rule | None  # the rule that decides it


def module_kind(module: "nn.Module") -> str | None:
    """The kind of `module` in the style table ('Linear', 'Embedding'), else None."""
    from ..sharding.styles import module_kind as kind

    return kind(module)


def sharded_weight_dim(module: "nn.Module", rule: Rule) -> int | None:
    """The dim of `module`'s weight that `rule`'s style shards; None when it shards none."""
    placement = rule.spec.semantics.contract.tp.placement(module_kind(module), "weight")
    if placement is None or placement.kind != "shard" or placement.blocks > 1:
        return None
    return placement.dim


_REPLICATED = PlacementSpec("replicate")


def parameter_placements(modules: "dict[str, nn.Module]", matched: dict[str, Rule]) -> dict[str, Placed]:
    """{parameter name (as named_parameters gives it): its placement under the plan's
    {fqn: rule}}, for every name of a parameter, shared ones included (`ctx.placements`).
    A rule places its module's own parameters as its contract says (`StyleSpec.own_placements`,
    what the compiled style does); a rule that replicates its subtree places its
    submodules' too, unless a rule of theirs says otherwise."""
    replicated_by: dict[str, Rule | None] = {}
    out: dict[str, Placed] = {}
    for fqn, module in modules.items():
        rule = matched.get(fqn)
        parent = fqn.rpartition(".")[0] if fqn else None
        inherited = replicated_by.get(parent) if parent is not None else None
        replicates = rule is not None and rule.spec.semantics.contract.tp.subtree == _REPLICATED
        replicated_by[fqn] = rule if replicates else inherited
        own = _own_placements(module, rule) if rule is not None else {}
        for key, param in module._parameters.items():
            if param is None:
                continue
            name = f"{fqn}.{key}" if fqn else key
            placement = own.get(key)
            if placement is not None:
                out[name] = Placed(placement, fqn, rule)
            elif replicated_by[fqn] is not None:
                out[name] = Placed(_REPLICATED, fqn, replicated_by[fqn])
            else:
                out[name] = Placed(None, fqn, None)
    return out


def _own_placements(module: "nn.Module", rule: Rule) -> dict[str, PlacementSpec]:
    """The placement of each own parameter of `module` under `rule` (the contract's, by
    its kind); {} where the style cannot shard the module (TP305 says so)."""
    spec = rule.spec
    try:
        return spec.own_placements(module, module_kind(module) if spec.semantics.contract.tp.kinds else None)
    except ValueError:
        return {}  # not an experts module, or an unknown parameter name: TP305 says so
