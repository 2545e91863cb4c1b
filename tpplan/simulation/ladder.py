"""The one fallback ladder: how a model that tpplan never materializes is run, for
the dry run (`apply --dry-run`) and the lint's shape run (its trace and TP330).

Three rungs, cheapest first: the meta device, fake tensors, real values.
Meta tensors cost nothing, but code that inspects values cannot run on them:
transformers' mask helpers call `.item()` unless they see a fake tensor
(`is_tracing`). Fake tensors cover that, but some constructors cannot run on
them. (torch's meta function of grouped_mm, which MoE experts call, wants
bfloat16 where the real kernels take float32 too: `running` gives both rungs
one that agrees with the real kernels, hf.grouped_mm, so a float32 MoE of any
size runs on them.) A model that runs neither way gets real
values, only if it is small (`simulate.VALUES_LIMIT_BYTES`): the values are
the factory's own (the dry run builds it again with its seed) or random (the
lint, which holds only a meta model); the shapes and control flow are real.
Each caller starts at the rung it built its model on and climbs while a rung fails.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

MODES = ("meta", "fake", "values")


def _tensors(model: "nn.Module") -> list:
    """The model's parameters and buffers, a tied tensor once."""
    return list({id(t): t for t in (*model.parameters(), *model.buffers())}.values())


def model_bytes(model: "nn.Module") -> int:
    """Bytes of the model's parameters and buffers, a tied tensor once."""
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def values_allowed(model: "nn.Module") -> bool:
    """Whether the model is small enough to be given real values (the last rung)."""
    from . import simulate  # read at call time: tests lower the limit

    return model_bytes(model) <= simulate.VALUES_LIMIT_BYTES


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def values_short_of_memory(model: "nn.Module") -> str | None:
    """Why a `--check` with real values cannot run here (None when it can, or when the
    free memory is unknown): the sharded copy and the one-device reference each hold the
    parameters and their gradients, in float32."""
    from ..core.units import human_bytes

    needed = 4 * 4 * sum(t.numel() for t in _tensors(model))
    free = available_memory()
    if free is None or needed <= free:
        return None
    return (f"real values would need about {human_bytes(needed)} (the sharded model and the one-device reference, "
            f"parameters and gradients in float32), and {human_bytes(free)} is available")


def available(model: "nn.Module", start: str = "meta") -> tuple[str, ...]:
    """The rungs from `start` up that `model` may use: values only when it is small."""
    modes = MODES[MODES.index(start):]
    return modes if values_allowed(model) else tuple(m for m in modes if m != "values")


@contextlib.contextmanager
def running(mode: str, model: "nn.Module", fake_mode=None) -> Iterator[None]:
    """The context a model prepared for `mode` runs in (`fake_mode`: the FakeTensorMode
    its fake tensors were made in, when it was built on them)."""
    import torch

    from ..hf.grouped_mm import accept_real_dtypes

    accept_real_dtypes()  # meta and fake tensors run a float32 MoE's grouped_mm, as the GPU does
    if mode == "fake":
        from .simulate import fake_tensors

        with fake_tensors(fake_mode):
            yield
    elif mode == "meta" and any(p.device.type == "meta" for p in model.parameters()):
        with torch.device("meta"):  # tensors the forward makes without a device stay on meta too
            yield
    else:
        yield


def prepared(model: "nn.Module", mode: str, *, owned: bool = False) -> "nn.Module":
    """The model to run in `mode`: itself (meta, fake), or a CPU copy of a meta model
    with random values (values). `owned`: the caller's own copy, which may be changed
    in place."""
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
