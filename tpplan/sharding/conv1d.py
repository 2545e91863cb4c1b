"""colwise and rowwise on transformers' `Conv1D` (GPT-2, openai-gpt): a Linear whose
weight is stored transposed, `[in, out]`, and whose forward is
`addmm(bias, x.view(-1, in), weight).view(*x.shape[:-1], out)`.

torch's ColwiseParallel and RowwiseParallel shard only nn.Linear and nn.Embedding
(transformers 5.25's own tensor parallelism has no Conv1D either). These are torch's
styles with one more module kind: the parameters are placed as the style table says
for a Conv1D (core/style_table.py: colwise shards the weight's dim 1 and the bias,
rowwise the weight's dim 0 and replicates the bias), and everything else, the input
and output hooks and the forward on DTensors, is torch's. The forward's `view` to the
global `out` works because the module computes on DTensors: colwise's output is
`Shard(-1)`, rowwise's `Partial` (its bias added once), reduced by torch's output hook.
"""

from __future__ import annotations

import sys
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..core.style_table import ColwiseSpec, RowwiseSpec

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `pytorch_utils.Conv1D` (never imported here: a model that has one imported it)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def _table_placements(spec: type) -> dict:
    """{parameter name or "*": torch placement} the style table's `spec` gives a Conv1D."""
    return {name: placement.to_torch() for name, placement in spec.semantics.params["Conv1D"].items()}


def _partition(placements: dict, src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements.get(key, placements["*"])], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))


class Conv1DColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel, also on transformers' Conv1D (weight `[in, out]` sharded on
    dim 1, bias on dim 0). Keyword arguments as ColwiseParallel's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, _table_placements(ColwiseSpec), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel, also on transformers' Conv1D (weight `[in, out]` sharded on
    dim 0, bias replicated; the partial output reduced to `output_layouts`). Keyword
    arguments as RowwiseParallel's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as torch's for a Linear: the input's features sharded
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, _table_placements(RowwiseSpec), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
