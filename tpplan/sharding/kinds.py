"""colwise and rowwise on the module kinds torch's styles do not shard, whose forward
is a Linear's with the weight laid out otherwise:

- transformers' `Conv1D` (GPT-2, openai-gpt): weight stored `[in, out]`, forward
  `addmm(bias, x.view(-1, in), weight).view(*x.shape[:-1], out)`;
- stacked expert Linears (JetMoE's `JetMoeParallelExperts`): weight `[num_experts,
  output_size, input_size]`, forward `cat([F.linear(x_e, weight[e]) for each expert's
  rows x_e of the input])`, called `(inputs, expert_size)`.

torch's ColwiseParallel and RowwiseParallel shard only nn.Linear and nn.Embedding
(transformers 5.25's own tensor parallelism has no Conv1D either). These are torch's
styles with those kinds added: the parameters are placed as the style table says for
the module's kind (core/style_table.py: colwise shards the output features, the
weight's dim 1 and a bias; rowwise the input features, a Conv1D's dim 0 or the experts'
dim 2, a bias replicated), and everything else, the input and output hooks and the
forward on DTensors, is torch's. The forward runs on DTensors, so a `view` to the global
`out` works: colwise's output is `Shard(-1)`, rowwise's `Partial` (a bias added once),
reduced by torch's output hook.
"""

from __future__ import annotations

import sys
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..core.style_table import ColwiseSpec, RowwiseSpec
from .placed import own_placements
from .styles import module_kind

__all__ = ["KindColwiseParallel", "KindRowwiseParallel", "is_conv1d", "is_stacked_linears"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `pytorch_utils.Conv1D` (never imported here: a model that has one imported it)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def is_stacked_linears(module: nn.Module) -> bool:
    """One Linear per expert stacked in one parameter, `weight [num_experts, output_size,
    input_size]` and nothing else (JetMoE's JetMoeParallelExperts), by its parameter and
    the attributes that name its dims."""
    own = {name: p for name, p in module._parameters.items() if p is not None}
    if set(own) != {"weight"} or own["weight"].dim() != 3:
        return False
    dims = tuple(getattr(module, name, None) for name in ("num_experts", "output_size", "input_size"))
    return dims == tuple(own["weight"].shape)


def _prepare_first(prepare, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """torch's input hook on the first positional input; the others handed on as they are
    (torch's returns the first alone: stacked Linears take expert_size second)."""
    return (prepare(module, inputs, mesh), *inputs[1:])


def _partition(spec: type, kind: str, src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    # the placements the style table's `spec` (options left out: they place no parameter) gives a module of `kind`
    placements = own_placements(spec.model_construct(), module, kind)
    for key, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements[key]], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))


def _distribute_kind(style, spec, kind: str, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """`style` (torch's colwise or rowwise) on a module of `kind`: its parameters placed as
    `spec`'s table says for that kind, its input and output hooks torch's own."""
    return distribute_module(
        module,
        device_mesh,
        partial(_partition, spec, kind, style.src_data_rank),
        partial(_prepare_first, partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts)),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class KindColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel, also on a Conv1D (weight `[in, out]` sharded on dim 1, bias
    on dim 0) and on stacked expert Linears (weight `[E, out, in]` on dim 1). Keyword
    arguments as ColwiseParallel's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = module_kind(module)
        if kind not in ColwiseSpec.semantics.kind_classes:
            return super()._apply(module, device_mesh)
        return _distribute_kind(self, ColwiseSpec, kind, module, device_mesh)


class KindRowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel, also on a Conv1D (weight `[in, out]` sharded on dim 0, bias
    replicated) and on stacked expert Linears (weight `[E, out, in]` on dim 2); the partial
    output reduced to `output_layouts`. Keyword arguments as RowwiseParallel's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = module_kind(module)
        if kind not in RowwiseSpec.semantics.kind_classes:
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as torch's for a Linear: the input's features sharded
        return _distribute_kind(self, RowwiseSpec, kind, module, device_mesh)
