"""A small language model whose attention adds a learned per-head bias, shape (heads,), to
its scores (`build`), or appends it as one more column of logits that softmax sees and the
values do not (`build_concat`, as transformers' gpt-oss does with its attention sinks):
under colwise q/k/v each rank holds some heads, so the parameter must be sharded with them."""

import torch
from torch import nn


class SinkAttention(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, concat: bool = False):
        super().__init__()
        self.concat = concat
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(n_heads))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) / self.head_dim ** 0.5
        if self.concat:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
            weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores + self.sinks.view(1, -1, 1, 1), dim=-1)
        out = weights @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SinkLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, concat: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SinkAttention(dim, concat=concat) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build():
    return SinkLM()


def build_concat():
    return SinkLM(concat=True)
