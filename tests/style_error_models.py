"""Small models that run on one device but give a style input it cannot take, for
tests/test_style_errors.py (`--model style_error_models:NAME`)."""

from __future__ import annotations

import torch
from torch import nn


class Experts(nn.Module):
    """Fused 3-D experts as transformers stores them ([E, 2I, H], [E, H, I]), its forward
    as theirs (every expert its routed tokens); without routing, every expert on every token."""

    def __init__(self, experts: int = 4, hidden: int = 8, inter: int = 4, returns_tuple: bool = False):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        if top_k_index is None:
            top_k_index = torch.arange(self.num_experts).expand(hidden_states.shape[0], -1)
            top_k_weights = torch.full(top_k_index.shape, 1.0 / self.num_experts)
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            rows = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, rows * top_k_weights[token, slot, None])
        return (out, None) if self.returns_tuple else out


class MoE(nn.Module):
    """A router (top 2 of the experts) and the experts; `routed=False` calls the experts
    with the hidden states only."""

    def __init__(self, experts: int = 4, routed: bool = True, returns_tuple: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.router = nn.Linear(8, experts)
        self.experts = Experts(experts, returns_tuple=returns_tuple)
        self.routed = routed

    def forward(self, x):
        h = self.inp(x).reshape(-1, 8)
        if self.routed:
            weights, index = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
            out = self.experts(h, index, weights)
        else:
            out = self.experts(h)
        return (out[0] if isinstance(out, tuple) else out).view(x.shape)


class Attention(nn.Module):
    """transformers-style GQA attention that repeats KV heads by `num_key_value_groups`
    (2 KV heads of size 2); `n_heads` says its query-head count, when given."""

    def __init__(self, n_heads: int | None = 8, kwargs_call: bool = False):
        super().__init__()
        query = n_heads or 8
        self.num_key_value_groups = query // 2
        if n_heads is not None:
            self.n_heads = n_heads
        self.head_dim = 2
        self.q_proj = nn.Linear(8, query * 2)
        self.k_proj = nn.Linear(8, 4)
        self.kwargs_call = kwargs_call

    def forward(self, x):
        q = self.q_proj(x).unflatten(-1, (-1, 2))
        k = self.k_proj(input=x) if self.kwargs_call else self.k_proj(x)
        k = k.unflatten(-1, (-1, 2)).repeat_interleave(self.num_key_value_groups, dim=-2)
        return (q * k).flatten(-2).sum(-1, keepdim=True).expand(*x.shape)


class KwargsNorm(nn.Module):
    """A LayerNorm called with its input as a keyword."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(input=self.inp(x))


def moe_3_experts():
    return MoE(experts=3)


def moe_unrouted():
    return MoE(routed=False)


def moe_tuple_experts():
    return MoE(returns_tuple=True)


def moe():
    return MoE()


def attention_without_head_count():
    return Attention(n_heads=None)


def attention_6_heads():
    return Attention(n_heads=6)


def attention_kwargs_call():
    return Attention(kwargs_call=True)


def kwargs_norm():
    return KwargsNorm()
