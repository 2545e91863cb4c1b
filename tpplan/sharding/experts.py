"""Styles for fused 3-D MoE expert modules (transformers 5's `experts` modules:
`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, optional `*_bias`; gpt-oss stores
them transposed, `[E, H, 2I]` with gate and up interleaved).

- `ExpertTensorParallel`: every expert sharded on its intermediate dim (a packed
  gate/up tensor as `_StridedShard`, so each rank holds matching gate and up
  halves); the module's own forward runs on the local shards, and its partial
  output is reduced to `output_layouts` (Replicate: one all-reduce; Shard: one
  reduce-scatter).
- `ExpertParallel`: whole experts per rank (Shard(0) of the expert dim). With
  `dispatch="all_reduce"` tokens are replicated: each rank runs its experts on
  every token, weighted by that token's routing weight for the expert (zero when
  the token is not routed to it), and one all-reduce sums the ranks' shares.

Parameters stay DTensors on the module (checkpoints, optimizers and clipping see
them sharded); for the forward each is swapped for its local tensor, so any
module code that indexes and multiplies its parameters runs unchanged. Gradients
are exact: a sharded parameter's local gradient is its shard's; replicated inputs
(hidden states, routing weights) get partial gradients that are all-reduced.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from ..core import expert_styles
from .expert_dispatch import combine, dispatch

__all__ = ["ExpertTensorParallel", "ExpertParallel", "expert_tp_defaults", "is_experts_module"]

# What an experts module is and how expert TP places its parameters is the style table's
# (core/expert_styles.py); here they become torch placements.
GATE_UP, DOWN, UP = expert_styles.GATE_UP, expert_styles.DOWN, expert_styles.UP
is_experts_module = expert_styles.is_experts_module


def expert_tp_defaults(module: nn.Module) -> dict[str, Placement]:
    """The placement of each own parameter under expert TP, for transformers' layouts."""
    return {name: p.to_torch() for name, p in expert_styles.expert_tp_placements(module).items()}


def distribute_param(tensor: torch.Tensor, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None) -> DTensor:
    """distribute_tensor, with a packed `_StridedShard(d, split_factor=n)` scattered as a plain
    Shard of a reordered copy (torch 2.13's scatter path cuts strided shards wrongly)."""
    if not isinstance(placement, _StridedShard):
        return distribute_tensor(tensor, mesh, [placement], src_data_rank=src_data_rank)
    dim, blocks, ranks = placement.dim % tensor.dim(), placement.split_factor, mesh.size()
    size = tensor.shape[dim]
    if size % (blocks * ranks):
        raise ValueError(f"packed_shard({dim}, {blocks}): dim {dim} of size {size} does not split into {blocks} blocks of {ranks} shards")
    chunk = size // (blocks * ranks)
    # [.., blocks, ranks, chunk, ..] -> [.., ranks, blocks, chunk, ..]: rank r's slices of every block are contiguous
    grouped = tensor.unflatten(dim, (blocks, ranks, chunk)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    local = distribute_tensor(grouped.contiguous(), mesh, [Shard(dim)], src_data_rank=src_data_rank).to_local()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride())


def _rank_values(mesh: DeviceMesh, values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A 1-element tensor holding values[rank] on each rank, without a collective
    (each rank cuts its own element), so that it works in a simulated world too."""
    full = torch.tensor(values, dtype=like.dtype, device=like.device)
    return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()


def _tensor_inputs(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


class _LocalForward(ParallelStyle):
    """Shared machinery: distribute the module's own parameters, and around each
    forward swap them for local tensors (instance attributes shadow `_parameters`)."""

    def __init__(self, *, input_layouts: Placement | None, output_layouts: Placement | None, use_local_output: bool):
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    # -- subclasses --------------------------------------------------------------
    def _placements(self, module: nn.Module, mesh: DeviceMesh) -> dict[str, Placement]:
        raise NotImplementedError

    def _local_param(self, module: nn.Module, name: str, param: DTensor) -> torch.Tensor:
        raise NotImplementedError

    def _local_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    # -- the style ----------------------------------------------------------------
    def _partition(self, module: nn.Module, mesh: DeviceMesh) -> None:
        placements = self._placements(module, mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            placement = placements[name]
            sharded = distribute_param(param.data, mesh, placement, self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module._tpplan_mesh = mesh
        module._tpplan_first_rank = None

    def _replicated_input(self, mesh: DeviceMesh, value: Any, layout: Placement) -> Any:
        """A floating tensor input as a local replicated tensor whose gradient is partial
        (this rank's share), so that it is all-reduced on the way back."""
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, (layout,), run_check=False)
        if value.placements != (Replicate(),):
            value = value.redistribute(placements=(Replicate(),))
        return value.to_local(grad_placements=(Partial(),))

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        mesh = module._tpplan_mesh
        first = [True]

        def convert(value):
            layout = self.input_layouts if first[0] else Replicate()
            first[0] = False
            return self._replicated_input(mesh, value, layout)

        args, kwargs = _tensor_inputs(args, kwargs, convert)
        args, kwargs = self._local_inputs(module, args, kwargs)
        for name, param in module.named_parameters(recurse=False):
            module.__dict__[name] = self._local_param(module, name, param)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(self).__name__} on {type(module).__name__} expects a tensor output, got {type(output).__name__}")
        out = DTensor.from_local(output, module._tpplan_mesh, (Partial(),), run_check=False)
        out = out.redistribute(placements=(self.output_layouts,))
        return out.to_local() if self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_experts_module(module):
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False)) or "none"
            raise ValueError(
                f"{type(self).__name__} needs a module with fused 3-D expert parameters "
                f"(gate_up_proj or up_proj, and down_proj); {type(module).__name__} has: {own}"
            )
        self._partition(module, device_mesh)
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward, with_kwargs=True)
        return module

    def _first_rank(self, module: nn.Module, like: torch.Tensor) -> torch.Tensor:
        """1 on the mesh's first rank, 0 elsewhere (cached per module)."""
        if module._tpplan_first_rank is None:
            size = module._tpplan_mesh.size()
            module._tpplan_first_rank = _rank_values(module._tpplan_mesh, [1.0] + [0.0] * (size - 1), like)
        return module._tpplan_first_rank


class ExpertTensorParallel(_LocalForward):
    """Shard every expert of a fused expert module on its intermediate dim.

    Keyword Args:
        params (dict[str, Placement], optional): placement per own parameter name,
            over the defaults: `gate_up_proj` `_StridedShard(1, 2)` ([E, 2I, H],
            gate and up halves; `Shard(2)` for gpt-oss's interleaved [E, H, 2I]),
            `down_proj` `Shard(2)` ([E, H, I]; `Shard(1)` transposed), `gate_up_proj_bias`
            like the gate/up dim, `down_proj_bias` and others `Replicate()`.
        input_layouts (Placement, optional): layout of the hidden states. Default Replicate.
        output_layouts (Placement, optional): the partial output is reduced to it:
            Replicate (all-reduce, the default) or Shard(d) (reduce-scatter).
        use_local_output (bool, optional): return a local tensor. Default True.

    A replicated parameter that is added to the output (`down_proj_bias`) counts once:
    only the first rank adds its value, every rank gets its (full) gradient. Any other
    replicated parameter computes on this rank's slice: its gradient is all-reduced.
    """

    def __init__(
        self,
        *,
        params: Mapping[str, Placement] | None = None,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.params = dict(params or {})

    def _placements(self, module: nn.Module, mesh: DeviceMesh) -> dict[str, Placement]:
        placements = expert_tp_defaults(module)
        unknown = sorted(set(self.params) - set(placements))
        if unknown:
            raise ValueError(
                f"expert_tp params: {type(module).__name__} has no parameter {', '.join(map(repr, unknown))} "
                f"(its parameters: {', '.join(placements)})"
            )
        return {**placements, **self.params}

    def _local_param(self, module: nn.Module, name: str, param: DTensor) -> torch.Tensor:
        if not all(p.is_replicate() for p in param.placements):
            return param.to_local()
        if name == f"{DOWN}_bias":
            # Added to every rank's partial output: let only the first rank's value count.
            # The gradient (the same on every rank) reaches every rank through the
            # value-free second term.
            local = param.to_local()
            return local.detach() * self._first_rank(module, local) + (local - local.detach())
        return param.to_local(grad_placements=(Partial(),))

    def __repr__(self) -> str:
        return (
            f"ExpertTensorParallel(params={self.params!r}, input_layouts={self.input_layouts!r}, "
            f"output_layouts={self.output_layouts!r}, use_local_output={self.use_local_output})"
        )


# all_to_all: tokens sharded, sent to their expert's rank and back (expert_dispatch.py).
DISPATCHES = ("all_reduce", "all_to_all")


class ExpertParallel(_LocalForward):
    """Whole experts per rank: every own parameter Shard(0) on the expert dim.

    Keyword Args:
        dispatch (str): how tokens reach the experts. `"all_reduce"` (tokens
            replicated over the mesh): each rank runs its E/n experts on every
            token, weighted by the token's routing weight for that expert (zero
            when not routed to it), and one all-reduce sums the ranks' outputs.
            `"all_to_all"` (tokens sharded over the mesh, e.g. a sequence shard): each
            rank's tokens travel to the ranks holding their experts and back
            (3 all-to-alls forward, 2 backward); output: the same local tokens.
        input_layouts, output_layouts, use_local_output: as `ExpertTensorParallel`
            (all_to_all: the tokens are sharded on dim 0 of the [T, H] hidden states,
            default Shard(0); `use_local_output=False` returns a Shard(0) DTensor).

    The module is called as transformers calls its experts:
    `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`.
    """

    def __init__(
        self,
        *,
        dispatch: str = "all_reduce",
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}, not {dispatch!r}")
        self.dispatch = dispatch
        if dispatch == "all_to_all":
            for name, layout in (("input_layouts", input_layouts), ("output_layouts", output_layouts)):
                if layout is not None and layout != Shard(0):
                    raise ValueError(f"expert_parallel with dispatch all_to_all: {name} must be shard(0), the token dim, not {layout}")
            self.input_layouts = self.output_layouts = Shard(0)

    def _placements(self, module: nn.Module, mesh: DeviceMesh) -> dict[str, Placement]:
        params = dict(module.named_parameters(recurse=False))
        experts = params[DOWN].shape[0]
        if experts % mesh.size():
            raise ValueError(f"expert_parallel: {experts} experts do not divide over {mesh.size()} ranks")
        module._tpplan_experts = experts
        return {name: Shard(0) for name in params}

    def _local_param(self, module: nn.Module, name: str, param: DTensor) -> torch.Tensor:
        return param.to_local()

    @staticmethod
    def _routing_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, dict]:
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args) + [None] * (3 - len(args))
        for i, alias in enumerate((None, ("router_indices",), ("routing_weights",))):
            for key in (names[i], *(alias or ())):
                if key in kwargs:
                    values[i] = kwargs.pop(key)
        hidden, index, weights = values[:3]
        if hidden is None or index is None or weights is None:
            raise TypeError(f"expert_parallel on {type(module).__name__}: call it as experts(hidden_states, top_k_index, top_k_weights)")
        return hidden, index, weights, kwargs

    def _local_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights, kwargs = self._routing_inputs(module, args, kwargs)
        experts, mesh = module._tpplan_experts, module._tpplan_mesh
        local = experts // mesh.size()
        offset = _rank_values(mesh, [float(r * local) for r in range(mesh.size())], weights).to(index.dtype)
        # Every token to every local expert: weight = the token's weight for it, or 0.
        dense = torch.zeros(*weights.shape[:-1], experts, dtype=weights.dtype, device=weights.device)
        dense = dense.scatter(-1, index, weights)
        slots = offset + torch.arange(local, device=index.device, dtype=index.dtype)
        mine = torch.gather(dense, -1, slots.expand(*dense.shape[:-1], local))
        local_index = torch.arange(local, device=index.device, dtype=index.dtype).expand(*index.shape[:-1], local)
        module.__dict__["num_experts"] = local
        return (hidden, local_index.contiguous(), mine, *args[3:]), kwargs

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.dispatch != "all_to_all":
            return super()._pre_forward(module, args, kwargs)
        hidden, index, weights, kwargs = self._routing_inputs(module, args, kwargs)
        hidden, index, weights = (v.to_local() if isinstance(v, DTensor) else v for v in (hidden, index, weights))
        mesh = module._tpplan_mesh
        rows, expert, routed = dispatch(hidden, index, weights, mesh, module._tpplan_experts)
        module.__dict__["_tpplan_routed"] = routed
        module.__dict__["num_experts"] = module._tpplan_experts // mesh.size()
        for name, param in module.named_parameters(recurse=False):
            module.__dict__[name] = param.to_local()
        # The local experts run top-1 with weight 1; the routing weights are applied in combine.
        ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=weights.device)
        return (rows, expert.unsqueeze(-1).to(index.dtype), ones, *args[3:]), kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        module.__dict__["num_experts"] = module._tpplan_experts
        if self.dispatch != "all_to_all":
            return super()._post_forward(module, args, kwargs, output)
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"ExpertParallel on {type(module).__name__} expects a tensor output, got {type(output).__name__}")
        mesh = module._tpplan_mesh
        out = combine(output, module.__dict__.pop("_tpplan_routed"), mesh)
        return out if self.use_local_output else DTensor.from_local(out, mesh, (Shard(0),), run_check=False)

    def __repr__(self) -> str:
        return (
            f"ExpertParallel(dispatch={self.dispatch!r}, input_layouts={self.input_layouts!r}, "
            f"output_layouts={self.output_layouts!r}, use_local_output={self.use_local_output})"
        )
