"""A Llama-style decoder with torchtitan's module names, for plans and tests.

Module paths (what plans match): `tok_embeddings`, `layers.N.attention_norm`,
`layers.N.attention.{wq,wk,wv,wo}`, `layers.N.ffn_norm`,
`layers.N.feed_forward.{w1,w2,w3}`, `norm`, `output`.

Written to run under tensor parallelism: attention computes on local tensors,
so its views infer the head count (`-1`) from the local width. Nothing here
picks a device: build under `with torch.device("meta"):` to cost no memory.
Rotary tables are computed in `forward` rather than kept in a buffer, so a
model built on meta and materialized later never holds stale tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 256
    ffn_hidden: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 128

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim ({self.dim // self.n_heads}) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")


def rotary_table(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len, head_dim // 2, 2) table of cos and sin for rotary embeddings."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of `x` (bsz, seq, heads, head_dim) by the angles in `rope`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bsz, seq, kv_heads, head_dim) -> (bsz, seq, kv_heads * n_rep, head_dim)."""
    if n_rep == 1:
        return x
    bsz, seqlen, kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bsz, seqlen, kv_heads, n_rep, head_dim).reshape(bsz, seqlen, -1, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # Global counts; under TP each rank holds n_heads / tp of them.
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the local head count, n_heads / tp when wq/wk/wv are column-sharded.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # The local ratio: under TP with replicated KV heads a rank holds n_heads / tp query
        # heads and one KV head, not n_heads / n_kv_heads of them per KV head.
        n_rep = q.shape[2] // k.shape[2]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.config.max_seq_len:
            raise ValueError(f"sequence length ({seqlen}) must not exceed max_seq_len ({self.config.max_seq_len})")
        cfg = self.config
        rope = rotary_table(seqlen, cfg.dim // cfg.n_heads, cfg.rope_theta, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


def tiny() -> Transformer:
    """2 layers, dim 128, 16 heads / 8 KV heads, vocab 256: TP 2, 4 and 8 divide every sharded dim."""
    return Transformer(LlamaConfig())


def llama3_8b() -> Transformer:
    """Llama 3 8B shapes (about 8.0e9 parameters); build it on the meta device only."""
    return Transformer(
        LlamaConfig(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            vocab_size=128256,
            ffn_hidden=14336,
            rope_theta=500000.0,
            max_seq_len=8192,
        )
    )


def llama3_70b() -> Transformer:
    """Llama 3 70B shapes (about 7.06e10 parameters; 8 KV heads, so TP 16 replicates each
    twice); build it on the meta device or fake tensors only."""
    return Transformer(
        LlamaConfig(
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            vocab_size=128256,
            ffn_hidden=28672,
            rope_theta=500000.0,
            max_seq_len=8192,
        )
    )


def llama3_405b() -> Transformer:
    """Llama 3.1 405B shapes (about 4.06e11 parameters; its 128K context); build it on the meta
    device or fake tensors only."""
    return Transformer(
        LlamaConfig(
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            vocab_size=128256,
            ffn_hidden=53248,
            rope_theta=500000.0,
            max_seq_len=131072,
        )
    )


def bench_1024() -> Transformer:
    """dim 1024, 4 layers, 16 heads / 8 KV heads, FFN 2816, vocab 32000, sequences up to 1024:
    a model whose activations matter next to its parameters (bench/bench_memory_accuracy.py)."""
    return Transformer(
        LlamaConfig(dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=32000, ffn_hidden=2816, max_seq_len=1024)
    )
