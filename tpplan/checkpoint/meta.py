"""`meta_parameters()`: build a model with its parameters on the meta device and
its buffers computed as the constructor writes them.

    with tpplan.meta_parameters():
        model = build()          # parameters: meta, no memory; buffers: real
    plan.apply(model, tp_mesh)
    load_checkpoint(model, "ckpt/")

Under `torch.device("meta")` every tensor the constructor makes is meta, so a
buffer computed in `__init__` (a rotary table, a causal mask) is lost: no
checkpoint holds a non-persistent buffer, and only a model that knows how to
recompute it (transformers' `_init_weights`, `reset_parameters()`, torchtitan's
`init_weights(buffer_device=)`) can be loaded. Here the constructor runs on
the CPU (or `buffer_device`) and torch's global parameter-registration hook
moves each parameter to meta as it is registered, as accelerate's
`init_empty_weights(include_buffers=False)` does. A parameter's values are made
on the real device first, one parameter at a time: `torch.empty` for
`nn.Linear`/`nn.Embedding` (pages never touched), the full cost only for a
constructor that fills a parameter itself (`nn.Parameter(torch.randn(...))`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


@contextlib.contextmanager
def meta_parameters(buffer_device: "torch.device | str | None" = None) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; their buffers
    (and every other tensor) are made on `buffer_device` (default: the current
    default device, normally the CPU). Parameter subclasses and their attributes
    are kept."""
    import torch
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(module: "nn.Module", name: str, param: "nn.Parameter | None") -> "nn.Parameter | None":
        if param is None or param.device.type == "meta":
            return None
        kind = type(param)
        attrs = dict(param.__dict__)
        # The parameter's own class (Parameter subclasses of quantization libraries keep state in it).
        moved = kind(param.to("meta"), requires_grad=param.requires_grad)
        moved.__dict__.update(attrs)
        return moved

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        with torch.device(buffer_device) if buffer_device is not None else contextlib.nullcontext():
            yield
    finally:
        handle.remove()
