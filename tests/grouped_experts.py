"""A torchtitan-shaped experts module (GroupedExperts of torchtitan 0.2.2's
models/moe/moe.py: w1 [E, hidden, dim], w2 [E, dim, hidden], w3 [E, hidden, dim];
forward(x sorted by expert, num_tokens_per_expert [E]) running a per-expert loop over
the sorted token slices, as its _run_experts_for_loop), and a one-layer model around it
for the CLI, so the tests need no torchtitan."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E, DIM, HIDDEN = 4, 16, 32


class GroupedExperts(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, experts: int = E):
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.tolist()
        out = []
        for e, rows in enumerate(torch.split(x[: sum(counts)], counts, dim=0)):
            h = F.silu(rows @ self.w1[e].transpose(-2, -1)) * (rows @ self.w3[e].transpose(-2, -1))
            out.append(h @ self.w2[e].transpose(-2, -1))
        return torch.cat(out, dim=0)


class NoExpertDim(nn.Module):
    """Parameters without a common first dim: no expert style applies."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ self.w1.T) @ self.w2.T


class TinyMoE(nn.Module):
    """Embedding, a fixed round-robin routing (token t to expert t % E), the experts, a head:
    the MoE block sorts tokens by expert and counts them as torchtitan's MoE does."""

    def __init__(self, experts: nn.Module | None = None, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.experts = experts if experts is not None else GroupedExperts()
        self.head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).reshape(-1, DIM)
        expert = torch.arange(h.shape[0], device=h.device) % E
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=E)
        out = torch.empty_like(h).index_copy(0, order, self.experts(h[order], counts))
        return self.head(h + out).view(*ids.shape, -1)


def tiny_moe() -> TinyMoE:
    return TinyMoE()


def tiny_no_expert_dim() -> TinyMoE:
    return TinyMoE(NoExpertDim())
