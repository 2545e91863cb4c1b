"""The `--steps --check` comparison: the sharded model trained N steps against its
one-device reference trained as many, step by step and parameter by parameter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..simulation.training import LEARNING_RATE, train_steps
from .result import CheckResult

if TYPE_CHECKING:
    import torch
    from torch import nn


def compare_training(
    model: "nn.Module | Mapping[str, torch.Tensor]",
    reference: "nn.Module",
    inputs: tuple,
    losses: list[float],
    optimizer_name: str,
    seed: int = 0,
    lr: float = LEARNING_RATE,
) -> CheckResult:
    """Train `reference` (one device, the sharded model's initial weights) for as many
    steps as `losses` holds and compare: every step's loss, then every final
    parameter (gathered to full size) against the reference's. A CheckResult;
    tolerances by dtype as everywhere (`simulate.tolerance`). `model` may be the
    parameters a pipeline rank's stages hold, by name: the reference's others are not
    compared here (another rank holds them)."""
    import math

    import torch

    from ..simulation.simulate import allowed_diff, max_abs_diff, tolerance

    reference.zero_grad(set_to_none=True)
    want_losses, _ = train_steps(reference, inputs, len(losses), optimizer_name, loss_parallel=False, seed=seed, lr=lr)
    problems: list[str] = []
    worst = 0.0
    for step, (got, want) in enumerate(zip(losses, want_losses), 1):
        rtol, atol = tolerance(torch.float32)
        diff = abs(got - want)
        if not diff <= atol + rtol * abs(want):
            problems.append(f"step {step}: loss {got:.7g}, single device {want:.7g}")
        worst = math.inf if math.isnan(diff) else max(worst, diff)
    # AdamW moves every element by up to lr per step whatever its gradient's size, so
    # an element whose gradient is rounding noise (TP reorders reductions) may move
    # either way: after N steps parameters may differ by up to lr x N on top of the
    # usual tolerance (seen: 1.9e-4 after 2 steps at lr 1e-3 on transformers' Llama).
    # The losses, compared strictly, carry the rest: a wrong plan changes them.
    moved = lr * len(losses) if optimizer_name == "adamw" else 0.0
    held = isinstance(model, Mapping)  # a pipeline stage's parameters: those it holds are compared
    params = dict(model) if held else dict(model.named_parameters())
    for name, want in reference.named_parameters():
        if held and name not in params:
            continue
        got = params[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        diff, limit = max_abs_diff(got, want.detach()), allowed_diff(want.detach(), *tolerance(want.dtype)) + moved
        if not diff <= limit:
            problems.append(f"{name} after {len(losses)} steps differs by up to {diff:.3g} (allowed {limit:.3g})")
        worst = math.inf if math.isnan(diff) else max(worst, diff)
    return CheckResult(passed=not problems, max_abs_diff=worst, problems=problems[:10])
