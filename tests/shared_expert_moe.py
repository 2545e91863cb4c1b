"""A small language model of MoE blocks whose routed experts run before their shared expert
(as transformers' Qwen3-Next and Lara mini write it): the router, the experts and the shared
expert's gate and up projections all read the block's input. Under expert_tp and colwise,
the experts and both projections each sum that input's gradient; the router must get it
plain, so only the shared expert can take it as one DTensor (TP340's fix goes there)."""

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, EXPERTS = 16, 32, 4


class DenseExperts(nn.Module):
    """Every expert on every token, weighted by the router's scores: w1 [E, dim, hidden], w2 [E, hidden, dim]."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.1)

    def forward(self, x, scores):
        hidden = F.silu(torch.einsum("btd,edh->bteh", x, self.w1))
        return (torch.einsum("bteh,ehd->bted", hidden, self.w2) * scores[..., None]).sum(-2)


class SharedExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts, self.shared_expert = nn.Linear(DIM, EXPERTS, bias=False), DenseExperts(), SharedExpert()

    def forward(self, x):
        routed = self.experts(x, self.router(x).softmax(-1))  # the experts first, as Qwen3-Next
        return routed + self.shared_expert(x)


class MoELM(nn.Module):
    def __init__(self, vocab: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(layers))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return h


def build():
    return MoELM()
