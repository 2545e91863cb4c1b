"""Attention that names its head counts with other spellings than torchtitan's and
transformers' usual ones (`num_heads`, `num_kv_heads`, `head_size`), for
tests/test_head_counts.py (`--model head_count_models:NAME`)."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    """GQA: 4 query heads and 2 KV heads of size 4, KV heads repeated by
    `num_key_value_groups` (as transformers' attention does, so `heads: auto` sets it)."""

    def __init__(self, hidden: int = 16, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = heads, kv_heads, hidden // heads
        self.num_key_value_groups = heads // kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_size)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_size)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_size)
        self.o_proj = nn.Linear(heads * self.head_size, hidden)

    def forward(self, x):
        def split(t):  # [batch, seq, features] -> [batch, heads, seq, head_size]
            return t.unflatten(-1, (-1, self.head_size)).transpose(1, 2)

        q = split(self.q_proj(x))
        k = split(self.k_proj(x)).repeat_interleave(self.num_key_value_groups, dim=1)
        v = split(self.v_proj(x)).repeat_interleave(self.num_key_value_groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.attn = Attention()

    def forward(self, tokens):
        return self.attn(self.embed(tokens))


def model():
    return Model()

