"""Context parallelism against one device, on each cp rank: the one check that the
CPU tests (cp ranks as threads, CUDA's ring simulated) and `bench/cp_cuda_check.py`
(torchrun on CUDA GPUs) both run.

- `ring_parity`: torch's ring attention, as a plan applies it, against one full
  causal SDPA: the output and the gradients of q, k and v (each rank sharded them
  from the same whole tensors, and gathers the results back in order), and the ring's
  collectives on this rank ({(name, bytes of its input): count}).
- `model_parity`: a model with `Plan.apply`'s context parallelism (FSDP2 over the cp
  ranks) against its unsharded copy: the loss and every parameter gradient, after one
  forward and backward of a mean cross-entropy, each rank on its shard of the batch.

Both return the max |difference| per tensor, and the max |one device's value| (the
scale a low-precision difference is read against). Inputs must be the same on every rank.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..sharding.context_parallel import SEQ_DIM, shard_sequence, unshard_sequence
from ..simulation.simulate import collective_counter


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class RingAttention(nn.Module):
    """q, k, v in, causal SDPA out, as `attention`: the module a plan's
    `context_parallel.modules: attention` names, with no weights of its own."""

    def __init__(self):
        super().__init__()
        self.attention = _Attention()

    def forward(self, q, k, v):
        return self.attention(q, k, v)


def ring_parity(plan: Any, mesh: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                grad: torch.Tensor) -> tuple[dict[str, float], dict[str, float], Counter]:
    """({"out"|"grad_q"|"grad_k"|"grad_v": max |ring - full|}, {the same: max |full|}
    (the scale a low-precision difference is read against), the ring's collectives on this rank)."""
    full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(grad)

    model = RingAttention()
    plan.apply(model, mesh)
    local = [t.detach().requires_grad_() for t in shard_sequence(plan, mesh, [q, k, v], [SEQ_DIM] * 3)]
    found: Counter = Counter()

    def record(name, args, out):
        found[name, args[0].numel() * args[0].element_size()] += 1

    with collective_counter(record):
        out = model(*local)
        out.backward(shard_sequence(plan, mesh, [grad], [SEQ_DIM])[0])
    got = unshard_sequence(plan, mesh, [out.detach(), *(t.grad for t in local)], [SEQ_DIM] * 4)
    names, wanted = ("out", "grad_q", "grad_k", "grad_v"), [want.detach(), *(t.grad for t in full)]
    diffs = {name: _diff(a, b) for name, a, b in zip(names, got, wanted)}
    return diffs, {name: b.abs().max().item() for name, b in zip(names, wanted)}, found


def model_parity(plan: Any, mesh: Any, reference: nn.Module, tokens: torch.Tensor,
                 labels: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """({"loss"|parameter name: max |context parallel - one device|}, {the same: max
    |one device|}); `reference` is left as it was but for its gradients (of the whole
    batch), `tokens`/`labels` (batch, seq)."""
    model = copy.deepcopy(reference)
    reference.zero_grad(set_to_none=True)
    want = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
    want.backward()
    plan.apply(model, mesh)
    local_tokens, local_labels = shard_sequence(plan, mesh, [tokens, labels], [1, 1])
    # each rank's mean over its tokens; FSDP2 averages the gradients over the cp ranks
    loss = F.cross_entropy(model(local_tokens).flatten(0, 1), local_labels.flatten())
    loss.backward()
    cp = mesh["cp"]
    losses = [torch.zeros_like(loss) for _ in range(cp.size())]
    torch.distributed.all_gather(losses, loss.detach(), group=cp.get_group())
    diffs = {"loss": abs(sum(x.item() for x in losses) / cp.size() - want.item())}
    scales = {"loss": abs(want.item())}
    grads = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        got = grads[name].grad
        diffs[name] = _diff(got.full_tensor() if hasattr(got, "full_tensor") else got, p.grad)
        scales[name] = p.grad.abs().max().item()
    return diffs, scales


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()
