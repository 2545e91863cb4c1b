"""Small models for the lint rules' documented examples (and their tests), for
the cases the reference models do not have: tied weights, a parameter-free
module that mixes positions, a first module that gives no default input, and
attention that views by the global head count.

    tpplan validate plan.yaml --model tpplan.models.rule_examples:tied_lm
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TiedLM(nn.Module):
    """Embedding -> MLP -> head, the head's weight tied to the embedding's."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def tied_lm() -> TiedLM:
    return TiedLM()


class TokenShift(nn.Module):
    """Mixes each position with the previous one (RWKV's token shift): no parameters,
    but not position-wise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = F.pad(x, (0, 0, 1, -1))
        return (x + shifted) / 2


class ShiftMLP(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.shift = TokenShift()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.shift(self.norm(self.embed(tokens)))
        return h + self.down(F.gelu(self.up(h)))


def shift_mlp() -> ShiftMLP:
    return ShiftMLP()


class ConvFirst(nn.Module):
    """Starts with a Conv1d: there is no default example input for it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.conv(x).transpose(1, 2))


def conv_first() -> ConvFirst:
    return ConvFirst()


class GlobalHeadsAttention(nn.Module):
    """Attention that views q/k/v with the model's global head count: correct on one
    device, wrong under TP, where each rank holds n_heads / tp heads."""

    def __init__(self, dim: int = 32, n_heads: int = 4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = (w(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class GlobalHeadsLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attention = GlobalHeadsAttention(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attention(h)
        return h + self.down(F.gelu(self.up(h)))


def global_heads_lm() -> GlobalHeadsLM:
    return GlobalHeadsLM()


class PrefixMLP(nn.Module):
    """An MLP whose hidden features are averaged over the positions so far (a running
    mean, `cumsum` over the sequence) before the down projection: per feature, so a
    feature shard passes through it, but the layout flow does not model `cumsum`."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        hidden = F.gelu(self.up(h))
        steps = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=hidden.dtype)
        h = h + self.down(hidden.cumsum(dim=1) / steps[:, None])
        return self.head(h)


def prefix_mlp() -> PrefixMLP:
    return PrefixMLP()


class GatedMLP(nn.Module):
    """An MLP whose hidden features are scaled by a learned per-position gate: the gate
    Linear's whole output meets each rank's slice of the hidden features."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)) * self.gate(x))


def gated_mlp() -> GatedMLP:
    return GatedMLP()
