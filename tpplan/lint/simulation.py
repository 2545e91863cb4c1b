"""How the lint runs a model it never materializes: on the meta device, on fake
tensors, or (small models only) on real values.

Meta tensors are the cheapest, but code that inspects values cannot run on
them: transformers' mask helpers call `.item()` unless they see a fake tensor
(`is_tracing`). Fake tensors cover that, but some fake kernels are stricter
than the real ones (grouped_mm wants bfloat16 in MoE experts). A model that
runs neither way is copied to the CPU with random values, if it is small; the
values are meaningless, the shapes and control flow are real. The trace and
the dry run use the first of these that works, in this order.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

MODES = ("meta", "fake", "values")


def model_bytes(model: "nn.Module") -> int:
    seen, total = set(), 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def available(model: "nn.Module") -> tuple[str, ...]:
    from ..runtime.simulate import VALUES_LIMIT_BYTES

    return MODES if model_bytes(model) <= VALUES_LIMIT_BYTES else MODES[:2]


@contextlib.contextmanager
def running(mode: str, model: "nn.Module") -> Iterator[None]:
    """The context a model prepared for `mode` runs in."""
    import torch

    if mode == "fake":
        from ..runtime.simulate import fake_tensors

        with fake_tensors():
            yield
    elif mode == "meta" and any(p.device.type == "meta" for p in model.parameters()):
        with torch.device("meta"):  # tensors the forward makes without a device stay on meta too
            yield
    else:
        yield


def prepared(model: "nn.Module", mode: str, *, owned: bool = False) -> "nn.Module":
    """The model to run in `mode`: itself (meta, fake), or a CPU copy with random
    values (values). `owned`: the caller's own copy, which may be changed in place."""
    import torch

    if mode != "values" or not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        return model
    target = model if owned else copy.deepcopy(model)
    target.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in (*target.parameters(), *target.buffers()):
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
    return target
