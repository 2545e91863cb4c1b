"""`expert_parallel`: whole experts per rank (Shard(0) of the expert dim of every
own parameter of an experts module, any layout with the expert dim first), one class per way tokens reach them
(the plan's `dispatch`; the style table picks the class):

- `AllReduceExpertParallel` (`dispatch: all_reduce`): tokens replicated over the
  mesh; each rank computes only the (token, expert) pairs routed to its E/n experts
  (expert_dispatch.route_local) and one all-reduce sums the ranks' shares.
- `AllToAllExpertParallel` (`dispatch: all_to_all`): tokens sharded over the mesh;
  each rank's tokens travel to the ranks holding their experts and back
  (expert_dispatch.dispatch / combine).

The module is called as transformers calls its experts:
`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`, or (all_reduce
only) as torchtitan calls its GroupedExperts: `experts(x [N, D] sorted by expert,
num_tokens_per_expert [E])` (told by that 1-D integer second argument; each rank runs its
experts' slice of x, expert_dispatch.route_sorted). Its own forward runs on the rows each
rank computes. As torchtitan's ExpertParallel, what
one call needs between the hooks (the routing) is kept on the style object.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from ..core.degrees import divisors_text
from ..core.problems import StyleInputError
from .expert_dispatch import Routed, combine, combine_local, combine_sorted, counts_argument, dispatch, route_local, route_sorted
from ..core.expert_styles import ExpertParallelSpec, expert_count
from .experts import LocalForward
from .placed import own_placements

__all__ = ["ExpertParallel", "AllReduceExpertParallel", "AllToAllExpertParallel"]

_ROUTING = ("hidden_states", "top_k_index", "top_k_weights")
_ALIASES = ((), ("router_indices",), ("routing_weights",))  # gpt-oss's names


def _experts(module: nn.Module) -> int:
    """The module's expert count (its parameters' global shape: they stay DTensors)."""
    return expert_count(module)


def _count_experts(module: nn.Module, count: int) -> None:
    # transformers' experts forward counts the experts it holds from `self.num_experts`
    # (one_hot classes, histc bins, the loop over the experts hit): during the forward it
    # must be this rank's E/n, after it the model's E again. The style sets it: the
    # module's own forward cannot run on local experts otherwise.
    if isinstance(getattr(module, "num_experts", None), int):
        module.num_experts = count


class ExpertParallel(LocalForward):
    """Whole experts per rank: every own parameter Shard(0) on the expert dim. A base
    class: make an `AllReduceExpertParallel` or an `AllToAllExpertParallel`.

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as `ExpertTensorParallel`.
    """

    name = "expert_parallel"

    @property
    @abstractmethod
    def dispatch(self) -> str:
        """How tokens reach the experts: the plan's `dispatch`."""

    def _placements(self, module: nn.Module, mesh: DeviceMesh) -> dict[str, Placement]:
        experts, degree = _experts(module), mesh.size()
        if experts % degree:
            axis = "ep" if mesh.mesh_dim_names == ("ep",) else "TP"  # a version 2 plan's experts rules: over ep
            raise StyleInputError(
                f"{experts} experts of {type(module).__name__} do not divide over {axis} degree {degree}",
                f"degrees that work: {divisors_text(experts)}, or expert_tp (shards each expert instead)",
            )
        return own_placements(ExpertParallelSpec.model_construct(style=self.name), module)

    def _local_param(self, name: str, param: DTensor) -> torch.Tensor:
        return param.to_local()

    def _routing_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, dict]:
        values = list(args[:3]) + [None] * (3 - len(args[:3]))
        for i, names in enumerate(zip(_ROUTING, _ALIASES)):
            for key in (names[0], *names[1]):
                if key in kwargs:
                    values[i] = kwargs.pop(key)
        hidden, index, weights = values
        if hidden is None or index is None or weights is None:
            raise StyleInputError(
                f"{self.name} on {type(module).__name__} needs the routing: it is called as "
                f"experts(hidden_states, top_k_index, top_k_weights), not with {len(args)} positional "
                f"input(s){' and ' + ', '.join(kwargs) if kwargs else ''}",
                "put the rule on the experts module that the MoE block calls with the router's indices and weights "
                "(transformers: mlp.experts)",
            )
        return hidden, index, weights, kwargs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts!r}, "
            f"output_layouts={self.output_layouts!r}, use_local_output={self.use_local_output})"
        )


class AllReduceExpertParallel(ExpertParallel):
    """expert_parallel with tokens replicated over the mesh: each rank runs its E/n
    experts on the tokens routed to them (each row weighted by its routing weight,
    by the module's own forward) and one all-reduce sums the ranks' outputs."""

    dispatch = "all_reduce"

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._routed: tuple[torch.Tensor, torch.Tensor] | None = None  # (token per row, hidden states) of the call
        self._sorted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, mask, x): torchtitan's call

    def _local_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        experts = _experts(module)
        if counts_argument(args, kwargs, experts):  # torchtitan's GroupedExperts(x, num_tokens_per_expert)
            counts = kwargs.pop("num_tokens_per_expert", None)
            x, counts, rest = args[0], (args[1] if counts is None else counts), args[2:]
            rows, local_counts, row, valid = route_sorted(x, counts, self.mesh, experts)
            self._sorted = (row, valid, x)
            _count_experts(module, experts // self.mesh.size())
            return (rows, local_counts, *rest), kwargs
        hidden, index, weights, kwargs = self._routing_inputs(module, args, kwargs)
        rows, expert, weight, token = route_local(hidden, index, weights, self.mesh, experts)
        self._routed = (token, hidden)
        _count_experts(module, experts // self.mesh.size())
        return (rows, expert, weight, *args[3:]), kwargs

    def _local_output(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        if self._sorted is not None:
            (row, valid, x), self._sorted = self._sorted, None
            return combine_sorted(output, row, valid, x)
        token, hidden = self._routed
        self._routed = None
        return combine_local(output, token, hidden)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        _count_experts(module, _experts(module))
        return super()._post_forward(module, args, kwargs, output)


class AllToAllExpertParallel(ExpertParallel):
    """expert_parallel with tokens sharded over the mesh (dim 0 of the [T, H] hidden
    states, e.g. a sequence shard): each rank's tokens travel to the ranks holding
    their experts and back (3 all-to-alls forward, 2 backward); the output is the
    same local tokens (`use_local_output=False`: a Shard(0) DTensor)."""

    dispatch = "all_to_all"

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None, use_local_output: bool = True):
        for name, layout in (("input_layouts", input_layouts), ("output_layouts", output_layouts)):
            if layout is not None and layout != Shard(0):
                raise StyleInputError(
                    f"expert_parallel with dispatch all_to_all: {name} is {layout}, but the tokens it moves are sharded on dim 0",
                    f"give {name}: shard(0) (the token dim of the experts' [T, H] input), or dispatch: all_reduce",
                )
        super().__init__(input_layouts=Shard(0), output_layouts=Shard(0), use_local_output=use_local_output)
        self._routed: Routed | None = None

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if counts_argument(args, kwargs, _experts(module)):
            raise StyleInputError(
                f"expert_parallel with dispatch all_to_all on {type(module).__name__}: it is called as torchtitan's "
                "GroupedExperts(x, num_tokens_per_expert), tokens already sorted by expert, which this dispatch "
                "does not take (it routes each rank's tokens itself from top_k_index)",
                "use dispatch: all_reduce (every rank runs its experts' slice of x)",
            )
        hidden, index, weights, kwargs = self._routing_inputs(module, args, kwargs)
        hidden, index, weights = (v.to_local() if isinstance(v, DTensor) else v for v in (hidden, index, weights))
        experts = _experts(module)
        rows, expert, self._routed = dispatch(hidden, index, weights, self.mesh, experts)
        _count_experts(module, experts // self.mesh.size())
        self._swap_in(module)
        # The local experts run top-1 with weight 1; the routing weights are applied in combine.
        ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=weights.device)
        return (rows, expert.unsqueeze(-1).to(index.dtype), ones, *args[3:]), kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        _count_experts(module, _experts(module))
        self._swap_out(module)
        self._check_output(module, output)
        routed, self._routed = self._routed, None
        out = combine(output, routed, self.mesh)
        return out if self.use_local_output else DTensor.from_local(out, self.mesh, (Shard(0),), run_check=False)
