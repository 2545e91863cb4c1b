"""The parallel styles a plan can name: torch's six (subclasses of their base
class `ParallelStyle`), re-exported as they are, and `NoParallel`, ours; and the
resolution of the torch names in the style table (core/style_table.py)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ..core.imports import import_module
from ..core.problems import StyleInputError

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "ParallelStyle",
    "NoParallel",
    "module_kind",
    "resolve",
]


@functools.cache
def resolve(name: str):
    """The object a "module:attribute" name of the style table names."""
    module, _, attr = name.partition(":")
    return getattr(import_module(module), attr)


def module_kind(module: nn.Module) -> str | None:
    """The kind (a key of core.style_model.MODULE_KINDS) of `module`, else None."""
    from ..core.style_model import MODULE_KINDS

    for kind, entry in MODULE_KINDS.items():
        target = resolve(entry.torch_class)
        if isinstance(module, target) if isinstance(target, type) else target(module):
            return kind
    return None


class NoParallel(ParallelStyle):
    """Keep a module whole on every rank of the TP mesh, inside a DTensor program.

    Its parameters and buffers become replicated DTensors (so optimizers, gradient
    clipping and checkpoints see one kind of tensor), its first positional input is
    annotated with ``input_layout`` and redistributed to ``desired_input_layout``,
    and its output is redistributed to ``output_layout``. Use it for small modules
    such as a MoE router that every rank computes in full.

    Keyword Args:
        input_layout (Placement, optional): layout the first input arrives in
            (when it is a plain tensor). Default: ``Replicate()``.
        output_layout (Placement, optional): layout the output is redistributed
            to. Default: ``Replicate()``.
        desired_input_layout (Placement, optional): layout the module computes
            on. Default: ``Replicate()``.
        use_local_output (bool, optional): return a local tensor rather than a
            DTensor. Default: ``True``.

    Example::
        >>> parallelize_module(model, tp_mesh, {"layers.0.moe.router": NoParallel()})
    """

    def __init__(
        self,
        *,
        input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        desired_input_layout: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.desired_input_layout = desired_input_layout or Replicate()
        self.use_local_output = use_local_output

    def _replicate_params(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
        for key, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and not isinstance(buffer, DTensor):
                module._buffers[key] = distribute_tensor(buffer, mesh, [Replicate()], src_data_rank=self.src_data_rank)

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            raise StyleInputError(
                f"no_parallel on {type(module).__name__} needs a tensor as its first positional input, "
                f"got {type(inputs[0]).__name__ if inputs else 'no positional input'}",
                "put the rule on a module called with a tensor first, or on its parent",
            )
        first = inputs[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, (self.input_layout,), run_check=False)
        if first.placements != (self.desired_input_layout,):
            first = first.redistribute(placements=(self.desired_input_layout,))
        return (first, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output, mesh: DeviceMesh):
        if not isinstance(output, DTensor):
            return output  # the module already left DTensor land; nothing to lay out
        if output.placements != (self.output_layout,):
            output = output.redistribute(placements=(self.output_layout,))
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_params,
            self._prepare_input,
            self._prepare_output,
        )

    def __repr__(self) -> str:
        return (
            f"NoParallel(input_layout={self.input_layout!r}, output_layout={self.output_layout!r}, "
            f"desired_input_layout={self.desired_input_layout!r}, use_local_output={self.use_local_output})"
        )
