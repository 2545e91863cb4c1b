"""Small models with no tensor-parallel plan anywhere, for `tpplan init` to infer one.

Their module names are deliberately unlike any known family's (`mix.together`,
`fan_out`, `squeeze`, ...), so a tool that recognises layers by name learns nothing
and only the traced data flow says which Linear feeds which. Each factory is
`--model zoo:NAME`; nothing here picks a device (build under
`with torch.device("meta"):` to cost no memory), and a forward + backward of the
default sizes takes milliseconds on a CPU. Parameters come from torch's global
generator, so `torch.manual_seed(s)` before a factory gives the same model.

- `vit`: a ViT-style encoder, floats [batch, patches, patch_dim] in, one fused
  qkv Linear per block, SDPA, a classifier on the mean-pooled tokens.
- `mamba`: a Mamba-style stack, token ids in: in_proj split into x and z, a
  depthwise causal Conv1d, a selective scan with recurrent state, silu(z) gating.
- `mlp_stack`: pre-norm Linear -> GELU -> Linear residual blocks, floats in.
- `custom_attention`: a decoder whose attention makes heads with
  `unflatten`/`movedim` and a hand-written causal softmax; a SwiGLU MLP.
- `custom_attention_strided`: the same decoder with head_dim-major heads
  (`view(b, s, head_dim, heads)`): one head's features are strided through the
  projection's output, so contiguous column shards split every head and give
  wrong values without any shape error.
- `convnet`: Conv1d layers only (no Linear, no norm): nothing to shard. Its first
  module is a Conv1d, so it has no default inputs: `--inputs
  zoo:convnet_inputs`.

Attention views infer the local head count (`-1`) from the width they receive, as
the other reference models do, so a sharded projection that keeps whole heads runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# --- vit -----------------------------------------------------------------------------


class PatchMixer(nn.Module):
    """Self-attention with one fused projection `together` = [q | k | v]."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.together = nn.Linear(dim, 3 * dim)
        self.back = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # (b, n, 3, heads, head_dim) -> (3, b, heads, n, head_dim), as timm's ViT
        q, k, v = self.together(x).reshape(b, n, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.back(out.transpose(1, 2).reshape(b, n, -1))


class Widen(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.rise = nn.Linear(dim, hidden)
        self.bend = nn.GELU()
        self.fall = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fall(self.bend(self.rise(x)))


class EncoderCell(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.pre = nn.LayerNorm(dim)
        self.mix = PatchMixer(dim, heads)
        self.post = nn.LayerNorm(dim)
        self.ff = Widen(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.pre(x))
        return x + self.ff(self.post(x))


class ViT(nn.Module):
    """Module paths: `embed_patches`, `cells.N.{pre,mix.together,mix.back,post,ff.rise,ff.fall}`,
    `final_norm`, `classify`; a learned position table `where` (up to `max_patches`)."""

    def __init__(self, patch_dim: int = 48, dim: int = 64, heads: int = 8, hidden: int = 128, depth: int = 2,
                 num_classes: int = 16, max_patches: int = 64):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        self.embed_patches = nn.Linear(patch_dim, dim)
        self.where = nn.Parameter(torch.randn(max_patches, dim) * 0.02)
        self.cells = nn.ModuleList(EncoderCell(dim, heads, hidden) for _ in range(depth))
        self.final_norm = nn.LayerNorm(dim)
        self.classify = nn.Linear(dim, num_classes)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embed_patches(patches) + self.where[: patches.shape[1]]
        for cell in self.cells:
            x = cell(x)
        return self.classify(self.final_norm(x).mean(dim=1))


def vit() -> ViT:
    """2 blocks, dim 64, 8 heads of 8, MLP 128, 16 classes; patches of 48 floats."""
    return ViT()


# --- mamba ---------------------------------------------------------------------------


class Selective(nn.Module):
    """A Mamba mixer: `split_in` -> (x, z); x through the causal depthwise `smear` and a
    selective scan (`select` gives dt, B, C per position; `step_size` widens dt);
    gated by silu(z); `merge_out` back to the model width."""

    def __init__(self, dim: int, inner: int, state: int, kernel: int, dt_rank: int):
        super().__init__()
        self.inner, self.state, self.dt_rank = inner, state, dt_rank
        self.split_in = nn.Linear(dim, 2 * inner, bias=False)
        self.smear = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.select = nn.Linear(inner, dt_rank + 2 * state, bias=False)
        self.step_size = nn.Linear(dt_rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.merge_out = nn.Linear(inner, dim, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        x, z = self.split_in(hidden).chunk(2, dim=-1)
        x = F.silu(self.smear(x.transpose(1, 2))[..., :seq].transpose(1, 2))  # causal: drop the look-ahead
        dt, B, C = self.select(x).split([self.dt_rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.step_size(dt))  # (b, s, inner)
        A = -torch.exp(self.A_log)  # (inner, state)
        h = x.new_zeros(x.shape[0], x.shape[2], self.state)  # the recurrent state (b, inner, state)
        ys = []
        for t in range(seq):
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
            ys.append((h * C[:, t, None, :]).sum(-1) + self.D * x[:, t])
        y = torch.stack(ys, dim=1)
        return self.merge_out(y * F.silu(z))


class ScanCell(nn.Module):
    def __init__(self, dim: int, inner: int, state: int, kernel: int, dt_rank: int):
        super().__init__()
        self.level = nn.RMSNorm(dim)
        self.scan = Selective(dim, inner, state, kernel, dt_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scan(self.level(x))


class Mamba(nn.Module):
    """Module paths: `tokens`, `cells.N.level`, `cells.N.scan.{split_in,smear,select,step_size,merge_out}`
    (and its `A_log`, `D`), `level_f`, `unembed`."""

    def __init__(self, vocab: int = 256, dim: int = 32, inner: int = 64, state: int = 8, kernel: int = 4,
                 dt_rank: int = 4, depth: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.cells = nn.ModuleList(ScanCell(dim, inner, state, kernel, dt_rank) for _ in range(depth))
        self.level_f = nn.RMSNorm(dim)
        self.unembed = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        for cell in self.cells:
            x = cell(x)
        return self.unembed(self.level_f(x))


def mamba() -> Mamba:
    """2 blocks, dim 32, inner 64, state 8, conv kernel 4, dt rank 4; vocab 256."""
    return Mamba()


# --- mlp_stack -----------------------------------------------------------------------


class Row(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fan_out = nn.Linear(dim, hidden)
        self.squash = nn.GELU()
        self.fan_in = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fan_in(self.squash(self.fan_out(self.ln(x))))


class MLPStack(nn.Module):
    """Module paths: `intake`, `rows.N.{ln,fan_out,squash,fan_in}`, `ln_last`, `readout`."""

    def __init__(self, in_features: int = 24, dim: int = 32, hidden: int = 128, depth: int = 3, out_features: int = 16):
        super().__init__()
        self.intake = nn.Linear(in_features, dim)
        self.rows = nn.ModuleList(Row(dim, hidden) for _ in range(depth))
        self.ln_last = nn.LayerNorm(dim)
        self.readout = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.intake(x)
        for row in self.rows:
            x = row(x)
        return self.readout(self.ln_last(x))


def mlp_stack() -> MLPStack:
    """3 pre-norm blocks of 32 -> 128 -> 32; 24 floats in, 16 out."""
    return MLPStack()


# --- custom_attention ----------------------------------------------------------------


class Lookup(nn.Module):
    """Causal self-attention with its own head layout and a hand-written softmax.

    `strided=False`: heads first, `unflatten(-1, (heads, head_dim)).movedim(2, 1)`, so a
    head's features are contiguous in `ask`/`key`/`val`'s output. `strided=True`:
    `view(b, s, head_dim, heads)`, so feature f belongs to head f % heads."""

    def __init__(self, dim: int, heads: int, strided: bool):
        super().__init__()
        self.heads, self.head_dim, self.strided = heads, dim // heads, strided
        self.ask = nn.Linear(dim, dim, bias=False)
        self.key = nn.Linear(dim, dim, bias=False)
        self.val = nn.Linear(dim, dim, bias=False)
        self.tell = nn.Linear(dim, dim, bias=False)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """(b, s, width) -> (b, heads, s, head_dim)."""
        b, s, _ = t.shape
        if self.strided:
            return t.view(b, s, self.head_dim, -1).permute(0, 3, 1, 2)
        return t.unflatten(-1, (-1, self.head_dim)).movedim(2, 1)

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """(b, heads, s, head_dim) -> (b, s, width), the inverse of `split`."""
        if self.strided:
            return t.permute(0, 2, 3, 1).flatten(2)
        return t.movedim(1, 2).flatten(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.ask(x)), self.split(self.key(x)), self.split(self.val(x))
        seq = x.shape[1]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.tell(self.merge(weights @ v))


class Gatekeeper(nn.Module):
    """SwiGLU: squeeze(silu(gate(x)) * fan_out(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.fan_out = nn.Linear(dim, hidden, bias=False)
        self.squeeze = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.squeeze(F.silu(self.gate(x)) * self.fan_out(x))


class Turn(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, strided: bool):
        super().__init__()
        self.calm = nn.RMSNorm(dim)
        self.look = Lookup(dim, heads, strided)
        self.settle = nn.RMSNorm(dim)
        self.think = Gatekeeper(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.look(self.calm(x))
        return x + self.think(self.settle(x))


class CustomDecoder(nn.Module):
    """Module paths: `words`, `turns.N.calm`, `turns.N.look.{ask,key,val,tell}`, `turns.N.settle`,
    `turns.N.think.{gate,fan_out,squeeze}`, `calm_f`, `speak`."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 8, hidden: int = 128, depth: int = 2,
                 strided: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        self.words = nn.Embedding(vocab, dim)
        self.turns = nn.ModuleList(Turn(dim, heads, hidden, strided) for _ in range(depth))
        self.calm_f = nn.RMSNorm(dim)
        self.speak = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.words(ids)
        for turn in self.turns:
            x = turn(x)
        return self.speak(self.calm_f(x))


def custom_attention() -> CustomDecoder:
    """2 blocks, dim 64, 8 heads of 8 (heads first), SwiGLU 128; vocab 256."""
    return CustomDecoder()


def custom_attention_strided() -> CustomDecoder:
    """`custom_attention` with head_dim-major heads: no contiguous column shard holds whole heads."""
    return CustomDecoder(strided=True)


# --- convnet -------------------------------------------------------------------------


class ConvNet(nn.Module):
    """Module paths: `stem`, `body.N` (Conv1d, GELU in between), `score` (a 1x1 Conv1d);
    logits are the per-position scores averaged over the length: [batch, classes]."""

    def __init__(self, channels: int = 4, width: int = 16, depth: int = 3, classes: int = 8):
        super().__init__()
        self.stem = nn.Conv1d(channels, width, kernel_size=3, padding=1)
        self.body = nn.ModuleList(nn.Conv1d(width, width, kernel_size=3, padding=2 ** i, dilation=2 ** i) for i in range(depth))
        self.score = nn.Conv1d(width, classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.stem(x))
        for conv in self.body:
            x = x + F.gelu(conv(x))
        return self.score(x).mean(dim=-1)


CONVNET_CHANNELS, CONVNET_LENGTH = 4, 16


def convnet() -> ConvNet:
    """A stem, 3 dilated residual Conv1d of 16 channels, a 1x1 scoring conv to 8 classes."""
    return ConvNet(channels=CONVNET_CHANNELS)


def convnet_inputs() -> torch.Tensor:
    """[2, 4, 16] floats (batch, channels, length) for `convnet`, on the current device."""
    return torch.randn(2, CONVNET_CHANNELS, CONVNET_LENGTH)
