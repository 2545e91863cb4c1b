"""A ViT-like encoder with fused projections: one `qkv` Linear whose output is split
into q, k and v after the Linear (as GPT-2's c_attn, Phi-3's qkv_proj, timm's ViT),
and one `gate_up` Linear chunked into gate and up (Phi-3's gate_up_proj).

Module paths: `patch`, `blocks.N.norm1`, `blocks.N.attn.qkv`, `blocks.N.attn.proj`,
`blocks.N.norm2`, `blocks.N.mlp.gate_up`, `blocks.N.mlp.down`, `norm`, `head`. The
first module is a Linear, so default example inputs are random floats of
`patch_dim` (a sequence of flattened patches).

The attention splits its local qkv without global sizes (`view(..., 3, -1, hd)`
for equal blocks, a split in proportion to the blocks for GQA), so a packed
colwise (`{style: colwise, packed: 3}`) gives each rank whole heads of q, k and v;
plain colwise gives it a mix of kinds, and wrong values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.blocks = (n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        self.qkv = nn.Linear(dim, sum(self.blocks))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        qkv = self.qkv(x)
        if self.n_kv_heads == self.n_heads:  # timm's ViT: (3, batch, heads, seq, head_dim)
            q, k, v = qkv.view(bsz, seq, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:  # [q | k | v], split in proportion: the local output holds each block's slice
            width, total = qkv.shape[-1], sum(self.blocks)
            q, k, v = (t.view(bsz, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.split([b * width // total for b in self.blocks], dim=-1))
            groups = q.shape[1] // k.shape[1]  # the local ratio, from the shapes
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, n_heads, n_kv_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FusedViT(nn.Module):
    def __init__(self, patch_dim: int = 24, dim: int = 32, n_heads: int = 4, n_kv_heads: int | None = None,
                 hidden: int = 64, n_blocks: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny() -> FusedViT:
    """2 blocks, dim 32, 4 heads of 8, fused qkv [q | k | v] of 3 equal blocks: TP 2 and 4 divide the heads."""
    return FusedViT()


def tiny_gqa() -> FusedViT:
    """As `tiny` with 8 query heads and 4 KV heads of 4: qkv is [q 32 | k 16 | v 16], unequal blocks."""
    return FusedViT(n_heads=8, n_kv_heads=4)
