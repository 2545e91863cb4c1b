"""`sgd_steps`: a few SGD steps of the parallelized model, timed (the library's
call; `apply --steps` trains through `training.train_steps` with the optimizer
it is given)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .devices import synchronize
from .report import StepsResult

if TYPE_CHECKING:
    import torch
    from torch import nn


def sgd_steps(model: "nn.Module", inputs: tuple, steps: int, device: "torch.device", seed: int) -> StepsResult:
    """`steps` SGD steps (lr 1e-2) towards fixed random targets (`training.train_steps`)."""
    from ..simulation.training import train_steps

    losses, times = train_steps(model, inputs, steps, "sgd", seed=seed, synchronize=lambda: synchronize(device), lr=1e-2)
    return StepsResult(losses=losses, step_times_s=times)
