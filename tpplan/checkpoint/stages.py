"""A pipeline rank's part of the model as one module, for checkpoints (SPEC §8: stages
keep the model's parameter names, so DCP checkpoints reshard across PP degrees).

`save_checkpoint` and `load_checkpoint` take a model, or the stage modules of this
rank (`plan.pipeline_stages(...)`: one, or several for interleaved and V schedules),
as torchtitan's checkpointer takes its model parts. Several stages become one module
that holds their tensors themselves (not copies) under their own names, so that
saving reads and loading writes the stages'. Each stage says which units it dropped
(`core.stages.OTHER_STAGES`): every rank saves its own keys, and a load leaves the
other stages' keys of the checkpoint to the ranks that hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.stages import OTHER_STAGES

if TYPE_CHECKING:
    from torch import nn


def as_one(model: "nn.Module | Sequence[nn.Module]") -> "nn.Module":
    """`model` itself, or this rank's stages as one module (module docstring)."""
    from torch import nn

    if isinstance(model, nn.Module):
        return model
    parts = list(model) if isinstance(model, Sequence) else []
    if not parts or not all(isinstance(part, nn.Module) for part in parts):
        raise TypeError(f"expected a model or a list of its pipeline stages (nn.Module), not {type(model).__name__}")
    if len(parts) == 1:
        return parts[0]
    one = nn.Module()
    for part in parts:
        for path, module in part.named_modules():
            for key, param in module._parameters.items():
                if param is not None:
                    _holder(one, path).register_parameter(key, param)
            for key, buffer in module._buffers.items():
                holder = _holder(one, path)
                if buffer is not None and key not in holder._buffers:  # a table every stage holds: one copy
                    holder.register_buffer(key, buffer, persistent=key not in module._non_persistent_buffers_set)
    held = [set(getattr(part, OTHER_STAGES, ())) for part in parts]
    setattr(one, OTHER_STAGES, tuple(sorted(set.intersection(*held))))  # dropped by every stage here
    ignored = {pattern for part in parts for pattern in getattr(part, "_keys_to_ignore_on_load_unexpected", None) or ()}
    one._keys_to_ignore_on_load_unexpected = sorted(ignored)
    return one


def is_stage(model: "nn.Module") -> bool:
    """Whether `model` is part of a pipeline: other ranks hold the rest of its keys."""
    return bool(getattr(model, OTHER_STAGES, ()))


def others_prefixes(model: "nn.Module") -> list[str]:
    """The key prefixes of the units other stages hold (`layers.3.`)."""
    return [f"{unit}." for unit in getattr(model, OTHER_STAGES, ())]


def _holder(root: "nn.Module", path: str) -> "nn.Module":
    from torch import nn

    module = root
    for name in path.split(".") if path else []:
        if name not in module._modules:
            module._modules[name] = nn.Module()
        module = module._modules[name]
    return module
