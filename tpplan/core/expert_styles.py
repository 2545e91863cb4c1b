"""tpplan's styles beyond torch's (SPEC §2a), as entries of the style table:
expert_tp and expert_parallel on expert modules (every own parameter with the expert
dim first, any layout), local_params for a module whose parameters are replicated
inside a sharded region, and
sum_output_grad for a whole module whose output every rank's shard uses. No torch here;
the styles themselves are in sharding/experts.py, expert_parallel.py, params.py and
sharding/grad_sum.py.

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

from typing import Any, Literal, Optional

from pydantic import Field

from .contract import TP, Option, Port, tp
from .cross_field import Allowed, Equals
from .placements import PlacementSpec
from .problems import StyleInputError
from .style_model import (
    INPUT_PORTS,
    _PARTIAL,
    _REPLICATE,
    _SHARD0,
    Layout,
    StyleSemantics,
    StyleSpec,
    _InputOptions,
)

# The fused expert parameters transformers uses; anything else on the module is replicated.
GATE_UP, DOWN, UP = "gate_up_proj", "down_proj", "up_proj"


def _own_parameters(module: Any) -> dict[str, Any]:
    return {name: p for name, p in module._parameters.items() if p is not None}


def expert_count(module: Any) -> int | None:
    """E when every own parameter is at least 2-D with the expert dim first (one common
    first size): any layout, transformers' fused experts and torchtitan's GroupedExperts
    (w1 [E, hidden, dim], w2 [E, dim, hidden], w3) alike; else None."""
    own = _own_parameters(module)
    firsts = {p.shape[0] for p in own.values() if p.dim() >= 2}
    if not own or len(firsts) != 1 or any(p.dim() < 2 for p in own.values()):
        return None
    return firsts.pop()


def is_experts_module(module: Any) -> bool:
    """A module of stacked expert weights: its own parameters all have the expert dim first."""
    return expert_count(module) is not None


def is_transformers_experts(module: Any) -> bool:
    """transformers' fused layout (own `gate_up_proj`/`up_proj` and a 3-D `down_proj`): expert_tp has defaults for it."""
    own = _own_parameters(module)
    return is_experts_module(module) and DOWN in own and (GATE_UP in own or UP in own) and own[DOWN].dim() == 3


def experts_layout(module: Any) -> tuple[bool, bool]:
    """(transposed, concatenated) as transformers' `use_experts_implementation` records them:
    transposed weights are [E, in, out]; concatenated gate/up is [gate; up], else interleaved.
    Experts without that decorator (Llama 4's, [E, H, 2I] and [E, I, H]) are told by their shapes."""
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:
        own = _own_parameters(module)
        if GATE_UP in own and DOWN in own and own[GATE_UP].dim() == own[DOWN].dim() == 3:
            (_, a, b), (_, c, d) = own[GATE_UP].shape, own[DOWN].shape
            transposed = a == d and b != c  # [E, H, 2I] and [E, I, H]; else [E, 2I, H] and [E, H, I]
    return bool(transposed), bool(getattr(module, "is_concatenated", True))


def expert_tp_placements(module: Any) -> dict[str, PlacementSpec]:
    """The placement of each own parameter under expert TP, for transformers' layouts
    (sharding/experts.py distributes them; the lint reads them through the table)."""
    transposed, concatenated = experts_layout(module)
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    placements: dict[str, PlacementSpec] = {}
    for name in _own_parameters(module):
        if name == GATE_UP:  # [E, 2I, H] (or [E, H, 2I]): shard the 2I dim, gate and up alike
            placements[name] = PlacementSpec("shard", out_dim, blocks=2 if concatenated else 1)
        elif name == f"{GATE_UP}_bias":  # [E, 2I]
            placements[name] = PlacementSpec("shard", 1, blocks=2 if concatenated else 1)
        elif name == UP:  # [E, I, H] without a gate
            placements[name] = PlacementSpec("shard", out_dim)
        elif name == f"{UP}_bias":
            placements[name] = PlacementSpec("shard", 1)
        elif name == DOWN:  # [E, H, I] (or [E, I, H]): shard its input, I
            placements[name] = PlacementSpec("shard", in_dim)
        else:  # down_proj_bias and anything else: whole on every rank
            placements[name] = _REPLICATE
    return placements


def _shapes(module: Any) -> str:
    own = _own_parameters(module)
    return ", ".join(f"{name} {list(p.shape)}" for name, p in own.items()) or "no parameters"


def not_experts(style: str, module: Any) -> StyleInputError:
    return StyleInputError(
        f"{style} needs a module whose own parameters all have the expert dim first (at least 2-D, one common "
        f"first size E); {type(module).__name__} has: {_shapes(module)}",
        "put the rule on the experts module itself (transformers: mlp.experts)",
    )


def unknown_params(module: Any, unknown: set[str], known) -> StyleInputError:
    return StyleInputError(
        f"params names no parameter of {type(module).__name__}: {', '.join(map(repr, sorted(unknown)))}",
        f"name its own parameters: {', '.join(known)}",
    )


def _experts_only(module: Any, style: str) -> None:
    if not is_experts_module(module):
        raise not_experts(style, module)


def expert_tp_base(module: Any, style: str, given) -> dict[str, PlacementSpec]:
    """expert_tp's placements before the plan's `params` (the names `given`): transformers'
    defaults for its layout; for any other layout every parameter replicated, so the
    plan must name what to shard. Refusals are StyleInputErrors."""
    _experts_only(module, style)
    if is_transformers_experts(module):
        placed = expert_tp_placements(module)
    elif not given:
        raise StyleInputError(
            f"{style} has no default placements for {type(module).__name__} (own parameters: {_shapes(module)}): "
            "only transformers' gate_up_proj/up_proj + down_proj layout has them",
            "give params: the placement of each weight, e.g. {w1: shard(1), w2: shard(2), w3: shard(1)} "
            "for torchtitan's GroupedExperts",
        )
    else:
        placed = {name: _REPLICATE for name in _own_parameters(module)}
    unknown = set(given) - set(placed)
    if unknown:
        raise unknown_params(module, unknown, placed)
    return placed


def check_param_dims(module: Any, style: str, dims: dict) -> None:
    """Every sharded dim ({name: dim or None}) exists on its parameter: a StyleInputError
    at the rule, not torch's error from inside distribute_tensor."""
    own = _own_parameters(module)
    for name, dim in dims.items():
        if dim is not None and not -own[name].dim() <= dim < own[name].dim():
            raise StyleInputError(
                f"{style} shards '{name}' {list(own[name].shape)} of {type(module).__name__} on dim {dim}, which it does not have",
                f"give '{name}' a dim in 0..{own[name].dim() - 1} (the expert dim is 0)",
            )



class _ExpertOptions(StyleSpec):
    input_layouts: Layout | None = Field(None, description="Layout of the hidden states; default replicate.")
    output_layouts: Layout | None = Field(
        None, description="The partial output is reduced to it: replicate (all-reduce, default) or shard(D) (reduce-scatter)."
    )
    use_local_output: bool = True


# The experts' hidden states are laid out, their token indices and routing weights
# handed on (rest passed); the hidden states are computed on whole, so backward sums
# their gradient (sharding/experts.py: grad_placements Partial); each rank's output is
# partial, reduced to output_layouts.
# Parameter placements depend on the module's layout and the options: each spec's
# param_placements, read by lint/facts.py.
_EXPERT_CONTRACT = tp(
    inputs=(Port(src=Option("input_layouts", _REPLICATE), dst=_REPLICATE, grad="sum"),),
    rest="passed",
    outputs=(Port(src=_PARTIAL, dst=Option("output_layouts", _REPLICATE)),),
    body="sharded",
)


# expert_parallel with dispatch all_to_all: the tokens stay sharded on their dim, sent to
# their expert's rank and back (nothing summed)
_ALL_TO_ALL = tp(
    inputs=(Port(src=Option("input_layouts", _SHARD0), dst=_SHARD0),),
    rest="passed",
    outputs=(Port(src=_SHARD0, dst=Option("output_layouts", _SHARD0)),),
    body="sharded",
)


class ExpertTPSpec(_ExpertOptions):
    """Shard every expert of an experts module (parameters with the expert dim first:
    transformers' fused `experts`, torchtitan's GroupedExperts) on its intermediate dim, the
    placements from `params` over transformers' defaults; the module's own forward runs on
    the local shards and the partial output is reduced to `output_layouts`."""

    style: Literal["expert_tp"]
    params: dict[str, Layout] | None = Field(
        None,
        description="Placement per own parameter, over the defaults: gate_up_proj packed_shard(1, 2) "
        "([E, 2I, H]; shard(2) for gpt-oss's interleaved [E, H, 2I]), down_proj shard(2) ([E, H, I]; "
        "shard(1) transposed), gate_up_proj_bias like its gate/up dim, down_proj_bias replicate. Any other "
        "layout whose parameters have the expert dim first (torchtitan's GroupedExperts: w1 [E, hidden, dim], "
        "w2 [E, dim, hidden], w3) has no defaults: name what to shard, e.g. {w1: shard(1), w2: shard(2), "
        "w3: shard(1)}; parameters not named stay replicated.",
    )
    semantics = StyleSemantics(
        torch_class="tpplan.sharding.experts:ExpertTensorParallel", contract=_EXPERT_CONTRACT, experts="each"
    )

    def param_placements(self, module):
        placed = {**expert_tp_base(module, self.style, self.params or {}), **(self.params or {})}
        check_param_dims(module, self.style, {n: p.dim if p.kind == "shard" else None for n, p in placed.items()})
        return placed


class ExpertParallelSpec(_ExpertOptions):
    """Whole experts per rank: shard(0) of the expert dim of every own parameter of an experts
    module (any layout with the expert dim first). Called as transformers' experts
    (hidden_states, top_k_index, top_k_weights) or as torchtitan's GroupedExperts
    (x sorted by expert, num_tokens_per_expert [E]; dispatch all_reduce only)."""

    style: Literal["expert_parallel"]
    dispatch: Literal["all_reduce", "all_to_all"] = Field(
        "all_reduce",
        description="all_reduce: tokens replicated, each rank runs its experts on the tokens routed "
        "to them, one all-reduce sums the ranks' outputs (transformers' (hidden_states, top_k_index, "
        "top_k_weights) call, or torchtitan's GroupedExperts(x sorted by expert, num_tokens_per_expert): each "
        "rank runs its experts' slice of x). all_to_all (transformers' call only): tokens "
        "sharded over the mesh (sequence parallelism; the experts get the rank's local [T, H] tokens): "
        "each token travels to the rank holding its expert and back, torchtitan-style "
        "(forward 3 all-to-alls: counts, tokens, results; backward 2); input_layouts and "
        "output_layouts are then shard(0), the token dim, and the output is the same local tokens.",
    )
    semantics = StyleSemantics(
        torch_class="tpplan.sharding.expert_parallel:AllReduceExpertParallel", contract=_EXPERT_CONTRACT, experts="whole"
    )
    # with all_to_all, an option may give only the layout of its port in that contract
    cross_field = tuple(
        Allowed(option.name, (option.default,), Equals("dispatch", "all_to_all"),
                "with {when}, '{field}' must be shard(0) (the token dim of the experts' [T, H] input), not {value}")
        for port in (*_ALL_TO_ALL.tp.inputs, *_ALL_TO_ALL.tp.outputs) for option in (port.src, port.dst) if isinstance(option, Option)
    )

    def torch_class(self, kind: str | None = None) -> str:
        # one class per dispatch (tpplan/sharding/expert_parallel.py)
        if self.dispatch == "all_to_all":
            return "tpplan.sharding.expert_parallel:AllToAllExpertParallel"
        return self.semantics.torch_class

    def torch_options(self):
        options = super().torch_options()
        del options["dispatch"]  # the class is the dispatch
        return options

    def param_placements(self, module):
        _experts_only(module, self.style)
        return {name: _SHARD0 for name in _own_parameters(module)}

    def contract(self, axis: str = TP):
        contract = self.semantics.contract[axis]
        if self.dispatch == "all_to_all":
            contract = _ALL_TO_ALL[axis]
        return contract.filled(lambda name: getattr(self, name, None))

    def output_follows_input(self) -> bool:
        return self.dispatch == "all_to_all"


class LocalParamsSpec(_InputOptions):
    """A module inside a sharded region that computes on local tensors: its own parameters
    laid out by `params` (default replicate, the gradient summed over the mesh, as
    transformers' replicated_with_grad_allreduce); input layouts as prepare_module_input."""

    style: Literal["local_params"]
    params: dict[str, Layout] | None = Field(
        None, description="Placement per own parameter (default replicate, gradient summed over the mesh)."
    )
    use_local_output: bool = False
    # Its module's ops are followed by the lint (body traced), on local tensors.
    semantics = StyleSemantics(torch_class="tpplan.sharding.params:LocalParams", contract=tp(inputs=INPUT_PORTS))

    def param_placements(self, module):
        given = self.params or {}
        return {key: given.get(key, _REPLICATE) for key in _own_parameters(module)}

    def local_param_placements(self):
        return dict(self.params or {})


class SumOutputGradSpec(StyleSpec):
    """A module left whole on every rank whose output (or its last `last` features) every
    rank's shard uses whole: in backward, the gradient of that part is summed over the mesh,
    as transformers' mla_kv_a_proj does for the rotary key slice of an MLA kv_a_proj_with_mqa
    (the rest goes through a colwise kv_b_proj, which sums its input's gradient itself)."""

    style: Literal["sum_output_grad"]
    last: Optional[int] = Field(
        None, ge=1, description="How many of the output's last features get their gradient summed; default all of them."
    )
    # Forward is the module's own (its parameters stay plain): the lint follows its ops. Its
    # output is used whole by every rank's shard: its gradient is summed (spmd R).
    semantics = StyleSemantics(torch_class="tpplan.sharding.grad_sum:SumOutputGrad", contract=tp(outputs=(Port(grad="sum"),)))
