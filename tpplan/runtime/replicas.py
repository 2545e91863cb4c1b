"""Replica consistency (TP506): every parameter replicated over the TP mesh, and its
gradient, must hold the same values on every rank after backward and after each
optimizer step. A replicated parameter that computes on sharded activations
without its gradient being reduced (a learnable scale between a colwise and a
rowwise Linear, a norm weight in a misconfigured sequence-parallel region) gets
a different gradient on each rank; after one step the replicas disagree and
training silently diverges, although one forward may still match a single device.

In the dry run every rank's values are there (LocalTensorMode); `differences`
reads them. TP506 is documented in lint/codes.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

@dataclass(frozen=True)
class ReplicaDifference:
    parameter: str
    kind: str  # "value" or "gradient"
    when: str  # "after backward", "after step 2"
    rank: int  # the first rank that differs from rank 0
    diff: float

    def describe(self) -> str:
        what = "its gradient differs" if self.kind == "gradient" else "its value differs"
        return (
            f"replicated parameter '{self.parameter}': {what} between ranks {self.when} "
            f"(rank {self.rank} from rank 0 by up to {self.diff:.3g})"
        )


def _is_replicated(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(param, DTensor):
        return all(isinstance(p, Replicate) for p in param.placements)
    return True  # a plain tensor is (meant to be) the same on every rank


def _per_rank(t: torch.Tensor) -> list[torch.Tensor]:
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if not all(isinstance(p, Replicate) for p in t.placements):
            return []  # partial or sharded: not a replica of one value
        t = t.to_local()
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in sorted(t._local_tensors)]
    return [t]


def differences(model: nn.Module, when: str) -> list[ReplicaDifference]:
    """The replicated parameters of `model` (run under LocalTensorMode) whose value or
    gradient is not identical on every rank."""
    found = []
    for name, param in model.named_parameters():
        if not _is_replicated(param):
            continue
        for kind, tensor in (("value", param), ("gradient", param.grad)):
            if tensor is None:
                continue
            values = [v.detach() for v in _per_rank(tensor)]
            for rank, value in enumerate(values[1:], start=1):
                if not torch.equal(value, values[0]):
                    diff = (value.double() - values[0].double()).abs().max().item()
                    found.append(ReplicaDifference(name, kind, when, rank, math.inf if math.isnan(diff) else diff))
                    break
    return found
