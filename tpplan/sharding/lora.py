"""LoRA adapters follow their base layer: a rule that matches a peft LoRA-wrapped
Linear (`peft.tuners.lora.Linear`: `base_layer`, `lora_A[name]`, `lora_B[name]`)
shards `base_layer` by the rule and derives each adapter's style, so a plan
written for the model works after `get_peft_model` too:

- colwise base (weight shard(0)): `lora_A` replicated (no_parallel, its input
  arriving as the base's does), `lora_B` colwise with the base's output options
  (and heads) on a replicated input: both outputs are the same shard, and
  `lora_B`'s input gradient is all-reduced as the base's is;
- rowwise base (weight shard(1)): `lora_A` rowwise on the base's input, output
  replicated (an all-reduce of `r` features), `lora_B` replicated with the
  base's output layout.

Dropout and scaling are untouched (peft's forward applies them to local
tensors). peft is not imported: the wrapper is recognised by its class's
`LoraLayer` base and its parts, so a model without peft pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ..core.placements import PlacementSpec
from ..core.style_model import StyleSpec

_REPLICATE = PlacementSpec("replicate")
_COLUMNS, _ROWS = PlacementSpec("shard", 0), PlacementSpec("shard", 1)  # a Linear weight [out, in]


def is_lora_linear(module: nn.Module) -> bool:
    """A peft LoRA layer around an nn.Linear."""
    return (
        any(cls.__name__ == "LoraLayer" for cls in type(module).__mro__)
        and isinstance(getattr(module, "base_layer", None), nn.Linear)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def is_linear(module: nn.Module) -> bool:
    """The style table's `Linear` kind: an nn.Linear, or a LoRA-wrapped one (sharded as its base)."""
    return isinstance(module, nn.Linear) or is_lora_linear(module)


def adapter_specs(spec: StyleSpec) -> tuple[StyleSpec, StyleSpec] | None:
    """(lora_A's spec, lora_B's spec) for a rule whose style shards a Linear's weight,
    from the style table's placement of it; None for a style that shards none
    (no_parallel, sequence_parallel replicate every parameter, adapters too)."""
    from ..core.style_table import ColwiseSpec, NoParallelSpec, RowwiseSpec

    placement = spec.semantics.contract.tp.placement("Linear", "weight")
    if placement not in (_COLUMNS, _ROWS):
        return None
    # The adapters take the base's input as it arrives and hand on its output as the base
    # does: the rule's contract, its options or torch's defaults.
    contract = spec.contract()
    arrives, leaves = contract.inputs[0].src, contract.outputs[0].dst
    use_local = getattr(spec, "use_local_output", True)
    if placement == _COLUMNS:
        replicated_a = NoParallelSpec.model_construct(
            style="no_parallel", input_layout=arrives, desired_input_layout=_REPLICATE, output_layout=_REPLICATE, use_local_output=True,
        )
        colwise_b = ColwiseSpec.model_construct(
            style="colwise", input_layouts=_REPLICATE, output_layouts=leaves,
            use_local_output=use_local, heads=getattr(spec, "heads", None),
        )
        return replicated_a, colwise_b
    rowwise_a = RowwiseSpec.model_construct(
        style="rowwise", input_layouts=arrives, output_layouts=_REPLICATE, use_local_output=True,
    )
    replicated_b = NoParallelSpec.model_construct(
        style="no_parallel", input_layout=_REPLICATE, desired_input_layout=_REPLICATE, output_layout=leaves, use_local_output=use_local,
    )
    return rowwise_a, replicated_b


class LoraParallel(ParallelStyle):
    """The rule's style on `base_layer`, the derived styles on every adapter's
    `lora_A` and `lora_B` (see the module docstring)."""

    def __init__(
        self, base: ParallelStyle, spec: StyleSpec, adapters: tuple[StyleSpec, StyleSpec], compile: Callable[[StyleSpec], ParallelStyle]
    ):
        super().__init__()
        self.base, self.spec = base, spec
        self.adapters = adapters
        self.compile = compile  # sharding.compile's, a fresh style object per adapter
        self._parent: nn.Module | None = None

    def bind_parent(self, parent: nn.Module) -> None:
        """The module holding the wrapper (colwise with heads reads its head_dim)."""
        self._parent = parent

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts: list[tuple[nn.Module, Any, StyleSpec]] = [(module.base_layer, self.base, self.spec)]
        for name in module.lora_A:
            parts.append((module.lora_A[name], self.compile(self.adapters[0]), self.adapters[0]))
            parts.append((module.lora_B[name], self.compile(self.adapters[1]), self.adapters[1]))
        for part, style, spec in parts:
            if spec.needs_parent() and self._parent is not None:  # the table says which styles bind (colwise with heads)
                style.bind_parent(self._parent)
            parallelize_module(part, device_mesh, style, src_data_rank=self.src_data_rank)
        return module

    def __repr__(self) -> str:
        return f"LoraParallel(base={self.base!r}, lora_A={self.adapters[0].style}, lora_B={self.adapters[1].style})"


def for_module(
    style: ParallelStyle, spec: StyleSpec, module: nn.Module, compile: Callable[[StyleSpec], ParallelStyle]
) -> ParallelStyle:
    """`style`, or for a LoRA-wrapped Linear under a style that shards its weight,
    the style that shards its base layer and derives its adapters."""
    if not is_lora_linear(module):
        return style
    adapters = adapter_specs(spec)
    if adapters is None:
        return style
    wrapped = LoraParallel(style, spec, adapters, compile)
    wrapped.src_data_rank = style.src_data_rank
    return wrapped
