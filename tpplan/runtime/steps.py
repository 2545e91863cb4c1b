"""`--steps`: a few SGD steps of the parallelized model, timed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .report import StepsResult
from .devices import synchronize
from .verify import full_tensor

if TYPE_CHECKING:
    import torch
    from torch import nn


def sgd_steps(model: "nn.Module", inputs: tuple, steps: int, device: "torch.device", seed: int) -> StepsResult:
    """`steps` SGD steps towards fixed random targets (mean squared error)."""
    import torch

    from .simulate import output_tensors

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed + 2)
    targets = None
    losses, times = [], []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        outputs = [full_tensor(t) for t in output_tensors(model(*inputs))]
        if targets is None:  # drawn on CPU, identical on every rank
            targets = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in outputs]
        loss = sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(outputs, targets))
        loss.backward()
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().item()))
    return StepsResult(losses=losses, step_times_s=times)
