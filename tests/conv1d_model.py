"""A small language model built of transformers' `Conv1D` (GPT-2's Linear, weight stored
`[in, out]`): token embedding (of the input viewed, as GPT-2's), blocks of LayerNorm + Conv1D c_fc -> GELU -> Conv1D c_proj
with a residual add, and a Linear head; for colwise/rowwise on Conv1D and init's pairs."""

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


class Block(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.c_fc, self.c_proj = Conv1D(inner, dim), Conv1D(dim, inner)
        for conv in (self.c_fc, self.c_proj):
            nn.init.normal_(conv.bias, std=0.2)  # Conv1D starts its bias at 0: a wrong bias placement would not show

    def forward(self, x):
        return x + self.c_proj(torch.nn.functional.gelu(self.c_fc(self.norm(x))))


class Conv1DModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, inner: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, inner) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens.view(-1, tokens.shape[-1]))  # as GPT-2 views its input_ids
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> nn.Module:
    return Conv1DModel()
