"""Styles for MoE expert modules whose parameters have the expert dim first: transformers
5's `experts` modules (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, optional `*_bias`;
gpt-oss stores them transposed, `[E, H, 2I]` with gate and up interleaved), for which
expert TP has defaults, and any other layout with its placements given in `params`
(torchtitan's GroupedExperts: `w1 [E, hidden, dim]`, `w2 [E, dim, hidden]`, `w3`).

- `ExpertTensorParallel`: every expert sharded on its intermediate dim (a packed
  gate/up tensor as `_StridedShard`, so each rank holds matching gate and up
  halves); the module's own forward runs on the local shards, and its partial
  output is reduced to `output_layouts` (Replicate: one all-reduce; Shard: one
  reduce-scatter).
- whole experts per rank (Shard(0) of the expert dim), one class per dispatch:
  expert_parallel.py.

Parameters stay DTensors on the module (checkpoints, optimizers and clipping see
them sharded); for the forward each is swapped for its local tensor, so any
module code that indexes and multiplies its parameters runs unchanged. Gradients
are exact: a sharded parameter's local gradient is its shard's; replicated inputs
(hidden states, routing weights) get partial gradients that are all-reduced.

What a style keeps between its hooks (the mesh, a cached rank mask, a call's routing)
lives on the style object, one per module (`compile_style` makes a fresh one); the
module gets only its DTensor parameters and the hooks.
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
from ..core.expert_styles import not_experts
from ..core.problems import StyleInputError
from .expert_dispatch import rank_values
from .placed import own_placements, plan_placements

__all__ = ["ExpertTensorParallel", "LocalForward", "expert_tp_defaults", "is_experts_module"]

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
        raise StyleInputError(
            f"packed_shard({dim}, {blocks}): dim {dim} of size {size} does not split into {blocks} blocks of {ranks} shards",
            f"use a TP degree that divides {size // blocks}" if size % blocks == 0 else f"the dim must hold {blocks} equal blocks",
        )
    chunk = size // (blocks * ranks)
    # [.., blocks, ranks, chunk, ..] -> [.., ranks, blocks, chunk, ..]: rank r's slices of every block are contiguous
    grouped = tensor.unflatten(dim, (blocks, ranks, chunk)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    local = distribute_tensor(grouped.contiguous(), mesh, [Shard(dim)], src_data_rank=src_data_rank).to_local()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride())




def tensor_inputs(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


class LocalForward(ParallelStyle):
    """Shared machinery of the expert styles: distribute the module's own parameters,
    and around each forward swap them for local tensors. State between the hooks
    (the mesh, the first-rank mask) is on the style object: one per module."""

    name = ""  # the style's name in a plan, for messages

    def __init__(self, *, input_layouts: Placement | None, output_layouts: Placement | None, use_local_output: bool):
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output
        self.mesh: DeviceMesh | None = None  # set by _apply
        self._first_rank_mask: torch.Tensor | None = None

    # -- subclasses --------------------------------------------------------------
    def _placements(self, module: nn.Module, mesh: DeviceMesh) -> dict[str, Placement]:
        raise NotImplementedError

    def _local_param(self, name: str, param: DTensor) -> torch.Tensor:
        raise NotImplementedError

    def _local_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def _local_output(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return output

    # -- the style ----------------------------------------------------------------
    def _partition(self, module: nn.Module, mesh: DeviceMesh) -> None:
        placements = self._placements(module, mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            placement = placements[name]
            sharded = distribute_param(param.data, mesh, placement, self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _replicated_input(self, value: Any, layout: Placement) -> Any:
        """A floating tensor input as a local replicated tensor whose gradient is partial
        (this rank's share), so that it is all-reduced on the way back."""
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, self.mesh, (layout,), run_check=False)
        if value.placements != (Replicate(),):
            value = value.redistribute(placements=(Replicate(),))
        return value.to_local(grad_placements=(Partial(),))

    def _swap_in(self, module: nn.Module) -> None:
        # The module's own forward indexes and multiplies its parameters: for it they must
        # be this rank's local tensors. Instance attributes shadow `_parameters`
        # (nn.Module.__getattr__ is asked only for names the instance lacks); the DTensor
        # parameters stay registered, for optimizers, clipping and checkpoints.
        for name, param in module.named_parameters(recurse=False):
            module.__dict__[name] = self._local_param(name, param)

    @staticmethod
    def _swap_out(module: nn.Module) -> None:
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        first = [True]

        def convert(value):
            layout = self.input_layouts if first[0] else Replicate()
            first[0] = False
            return self._replicated_input(value, layout)

        args, kwargs = tensor_inputs(args, kwargs, convert)
        args, kwargs = self._local_inputs(module, args, kwargs)
        self._swap_in(module)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        self._swap_out(module)
        self._check_output(module, output)
        out = DTensor.from_local(self._local_output(module, output), self.mesh, (Partial(),), run_check=False)
        out = out.redistribute(placements=(self.output_layouts,))
        return out.to_local() if self.use_local_output else out

    def _check_output(self, module: nn.Module, output: Any) -> None:
        if not isinstance(output, torch.Tensor):
            raise StyleInputError(
                f"{self.name} on {type(module).__name__} needs its forward to return one tensor, the experts' output; "
                f"it returned {type(output).__name__}",
                "put the rule on the module that computes the experts (transformers: mlp.experts)",
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_experts_module(module):
            raise not_experts(self.name, module)
        if self.mesh is not None and self.mesh is not device_mesh:
            raise StyleInputError(
                f"this {type(self).__name__} object was applied over another mesh already",
                "make one style object per mesh (a plan's rules get one per module)",
            )
        self.mesh = device_mesh
        self._partition(module, device_mesh)
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward, with_kwargs=True)
        return module

    def _first_rank(self, like: torch.Tensor) -> torch.Tensor:
        """1 on the mesh's first rank, 0 elsewhere (made once per style)."""
        mask = self._first_rank_mask
        if mask is None or mask.dtype != like.dtype or mask.device != like.device:
            size = self.mesh.size()
            mask = self._first_rank_mask = rank_values(self.mesh, [1.0] + [0.0] * (size - 1), like)
        return mask


class ExpertTensorParallel(LocalForward):
    """Shard every expert of a fused expert module on its intermediate dim.

    Keyword Args:
        params (dict[str, Placement], optional): placement per own parameter name,
            over the defaults: `gate_up_proj` `_StridedShard(1, 2)` ([E, 2I, H],
            gate and up halves; `Shard(2)` for gpt-oss's interleaved [E, H, 2I]),
            `down_proj` `Shard(2)` ([E, H, I]; `Shard(1)` transposed), `gate_up_proj_bias`
            like the gate/up dim, `down_proj_bias` and others `Replicate()`. Any other
            layout with the expert dim first (torchtitan's GroupedExperts) has no
            defaults: every parameter not named is `Replicate()`, so name what to shard
            (`{"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}`).
        input_layouts (Placement, optional): layout of the hidden states. Default Replicate.
        output_layouts (Placement, optional): the partial output is reduced to it:
            Replicate (all-reduce, the default) or Shard(d) (reduce-scatter).
        use_local_output (bool, optional): return a local tensor. Default True.

    A replicated parameter that is added to the output (`down_proj_bias`) counts once:
    only the first rank adds its value, every rank gets its (full) gradient. Any other
    replicated parameter computes on this rank's slice: its gradient is all-reduced.
    """

    name = "expert_tp"

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
        spec = expert_styles.ExpertTPSpec.model_construct(style=self.name, params=plan_placements(self.params))
        return own_placements(spec, module)

    def _local_param(self, name: str, param: DTensor) -> torch.Tensor:
        if not all(p.is_replicate() for p in param.placements):
            return param.to_local()
        if name == f"{DOWN}_bias":
            # Added to every rank's partial output: let only the first rank's value count.
            # The gradient (the same on every rank) reaches every rank through the
            # value-free second term.
            local = param.to_local()
            return local.detach() * self._first_rank(local) + (local - local.detach())
        return param.to_local(grad_placements=(Partial(),))

    def __repr__(self) -> str:
        return (
            f"ExpertTensorParallel(params={self.params!r}, input_layouts={self.input_layouts!r}, "
            f"output_layouts={self.output_layouts!r}, use_local_output={self.use_local_output})"
        )
