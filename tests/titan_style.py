"""A decoder written as torchtitan writes its llama3 (module names, a complex
rotary table `freqs_cis` computed in `__init__` as a non-persistent buffer), in
two variants: `Decoder` re-creates its buffer in `init_weights(buffer_device=)`
as torchtitan's models do; `PlainDecoder` has no init at all, its buffer comes
from the constructor alone. Tests import it as `titan_style:tiny`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, LAYERS, VOCAB, HIDDEN, SEQ = 32, 4, 2, 64, 64, 16


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: a colwise wq leaves this rank HEADS / tp of them
        q, k, v = (w(x).view(bs, seq, -1, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM)
        self.ffn_norm = nn.RMSNorm(DIM)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class PlainDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // HEADS, SEQ * 2), persistent=False)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class Decoder(PlainDecoder):
    """torchtitan's convention: `init_weights(buffer_device=)` re-creates the buffers and
    initialises every parameter (their `Transformer.init_weights`)."""

    init_weights_calls = 0

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        type(self).init_weights_calls += 1
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = precompute_freqs_cis(DIM // HEADS, SEQ * 2)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()


def tiny() -> Decoder:
    return Decoder()


def plain() -> PlainDecoder:
    return PlainDecoder()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


PLAN = """\
version: 1
mesh: {axis: tp}
rules:
  tok_embeddings: {style: rowwise, input_layouts: replicate}
  layers.*.attention.wq: colwise
  layers.*.attention.wk: colwise
  layers.*.attention.wv: colwise
  layers.*.attention.wo: rowwise
  layers.*.feed_forward.w1: colwise
  layers.*.feed_forward.w3: colwise
  layers.*.feed_forward.w2: rowwise
  output: {style: colwise, output_layouts: replicate}
"""
