"""A small causal transformer whose positions are a buffer of the whole sequence,
read as `positions[:seq]` (torchtitan's `freqs_cis`): the shape context parallelism
needs, where the positional table is cut on the sequence as the batch is
(`context_parallel.buffers: {positions: 0}`). tpplan's Llama computes its rotary
table from the local sequence length instead, so on a cp rank it would number
its shard's tokens from 0.

Module paths: `embed`, `layers.N.norm`, `layers.N.attention.{wq,wk,wv,wo}`, `output`;
`layers.N.attention` calls `F.scaled_dot_product_attention` (causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        q, k, v = (w(x + positions).view(bsz, seq, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, seq, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.norm(x), positions)


class PositionalTransformer(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, vocab: int = 64, layers: int = 2, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("positions", torch.randn(seq, dim))  # learned-free, random: any table is cut the same way

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, positions = self.embed(tokens), self.positions[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, positions)
        return self.output(h)


def tiny() -> PositionalTransformer:
    """dim 64, 4 heads of 16 (CUDA's flash and efficient kernels take it), 2 layers, vocab
    64, a sequence of 32 (2·cp divides it up to cp 16)."""
    return PositionalTransformer()
