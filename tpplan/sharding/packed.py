"""`PackedColwiseParallel` (a plan's `{style: colwise, packed: N}` or `packed: [a, b, c]`):
a column-parallel Linear whose output packs several kinds side by side, split
after the Linear (a fused qkv `[q | k | v]` viewed as `(3, heads, head_dim)` or
split, a fused `[gate | up]` chunked in two). Plain colwise gives rank r a
contiguous run of output features: a mix of kinds (rank 0 of 2 holds q and half
of k), wrong values without a crash. Here rank r holds its slice of every block,
so its local output is `[q_r | k_r | v_r]`, and the model's split of the local
output gives each rank whole heads of q, k and v.

- N equal blocks: weight and bias are `packed_shard(0, N)` DTensors (torch's
  `_StridedShard(0, split_factor=N)`), sharded memory, checkpoints read and
  written by tpplan.checkpoint as any packed shard.
- unequal blocks (a GQA `[q | k | v]`, q wider than k and v): no DTensor placement
  says "rank r holds slice r of blocks of different sizes", so weight and bias stay
  replicated DTensors (as in the checkpoint) and each rank computes only its rows of
  every block: the compute is split, the parameter memory is not. Their gradients
  are summed over the mesh (each rank's are its rows').

The input is replicated first (as torch's colwise); the input's gradient is
all-reduced. The output is local (`use_local_output`, default) or a DTensor
whose placement is the packed shard of its last dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from ..core.problems import ModelError
from .experts import distribute_param

__all__ = ["PackedColwiseParallel", "PackedInputError", "block_sizes", "local_rows"]


class PackedInputError(ModelError, ValueError):
    """`packed` does not fit the module (not a Linear, blocks that do not add up or divide): the plan's error."""


def block_sizes(packed: int | tuple[int, ...], features: int) -> tuple[int, ...]:
    """The blocks' sizes: `packed` itself, or `features` split into `packed` equal blocks."""
    if isinstance(packed, int):
        if features % packed:
            raise PackedInputError(f"colwise packed {packed}: {features} output features are not {packed} equal blocks")
        return (features // packed,) * packed
    if sum(packed) != features:
        raise PackedInputError(f"colwise packed {list(packed)}: the blocks add up to {sum(packed)}, not the {features} output features")
    return tuple(packed)


def local_rows(sizes: tuple[int, ...], rank: int, degree: int) -> torch.Tensor:
    """The output features rank `rank` of `degree` holds: its slice of every block, in order."""
    bad = [size for size in sizes if size % degree]
    if bad:
        raise PackedInputError(f"colwise packed: blocks of {', '.join(map(str, bad))} features do not split over TP degree {degree}")
    rows, start = [], 0
    for size in sizes:
        chunk = size // degree
        rows.append(torch.arange(start + rank * chunk, start + (rank + 1) * chunk))
        start += size
    return torch.cat(rows)


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel over packed blocks: each rank holds its slice of every block.

    Keyword Args:
        packed (int | tuple[int, ...]): N equal blocks, or the blocks' sizes in output features.
        input_layouts (Placement, optional): layout of the input. Default Replicate.
        use_local_output (bool, optional): return the local output (default True), else a
            DTensor laid out as `_StridedShard(-1, N)` (equal blocks only).
    """

    def __init__(self, *, packed: int | tuple[int, ...], input_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__()
        self.packed = packed
        self.input_layouts = input_layouts or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise PackedInputError(f"colwise with packed shards an nn.Linear, not {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise PackedInputError(f"colwise with packed needs a 1-D TP mesh, not {device_mesh.ndim}-D")
        sizes = block_sizes(self.packed, module.out_features)
        degree = device_mesh.size()
        local_rows(sizes, 0, degree)  # every block splits over the degree
        self._equal = len(set(sizes)) == 1
        if not self._equal and not self.use_local_output:
            raise PackedInputError("colwise packed with unequal blocks returns a local output: use_local_output must stay true")
        placement = _StridedShard(0, split_factor=len(sizes)) if self._equal else Replicate()
        for name, param in list(module.named_parameters(recurse=False)):
            value = distribute_param(param.data, device_mesh, placement, self.src_data_rank)
            module.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        if not self._equal:
            self._rows = local_rows(sizes, device_mesh.get_local_rank(), degree)
        self._mesh = device_mesh
        self._blocks = len(sizes)
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        return module

    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise PackedInputError(f"colwise with packed on {type(module).__name__} expects a tensor as the first positional input")
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self._mesh, (self.input_layouts,), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        for name, param in module.named_parameters(recurse=False):
            if self._equal:
                module.__dict__[name] = param.to_local()  # rank's slice of every block, in block order
            else:  # replicated: this rank's rows; the others' gradients are zero here, summed over the mesh
                module.__dict__[name] = param.to_local(grad_placements=(Partial(),)).index_select(0, self._rows.to(param.device))
        return (x.to_local(grad_placements=(Partial(),)), *args[1:])

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)
        if self.use_local_output:
            return output
        shape = (*output.shape[:-1], output.shape[-1] * self._mesh.size())
        placement = _StridedShard(output.dim() - 1, split_factor=self._blocks)
        return DTensor.from_local(output, self._mesh, (placement,), run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(packed={self.packed!r}, input_layouts={self.input_layouts!r}, use_local_output={self.use_local_output})"
