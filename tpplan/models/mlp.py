"""A residual MLP stack, the smallest model worth a tensor-parallel plan.

Module paths: `blocks.N.in_proj`, `blocks.N.act`, `blocks.N.out_proj`. The
first module is a Linear, so default example inputs are random floats of
`in_features`. No device is picked here (build under `torch.device("meta")`
to cost no memory).
"""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(self.act(self.in_proj(x)))


class MLP(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 128, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def tiny() -> MLP:
    """2 blocks of 32 -> 128 -> 32: TP 2, 4 and 8 divide the hidden width."""
    return MLP()
