"""Replica consistency (TP506): every parameter replicated over the TP mesh, and its
gradient, must hold the same values on every rank after backward and after each
optimizer step. A replicated parameter that computes on sharded activations
without its gradient being reduced (a learnable scale between a colwise and a
rowwise Linear, a norm weight in a misconfigured sequence-parallel region) gets
a different gradient on each rank; after one step the replicas disagree and
training silently diverges, although one forward may still match a single device.

In the dry run every rank's values are there (LocalTensorMode); `differences`
reads them. Under torchrun each rank holds its own: `differences_across_ranks`
gathers a digest of every replica's bytes from all ranks and, for a digest that
differs, the values themselves. TP506 is documented in lint/codes.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

@dataclass(frozen=True)
class ReplicaDifference:
    parameter: str
    kind: str  # "value" or "gradient"
    when: str  # "after backward", "after step 2"
    rank: int  # the first rank that differs from `base`
    diff: float
    base: int = 0  # the first rank of its TP group

    def describe(self) -> str:
        what = "its gradient differs" if self.kind == "gradient" else "its value differs"
        return (
            f"replicated parameter '{self.parameter}': {what} between ranks {self.when} "
            f"(rank {self.rank} from rank {self.base} by up to {self.diff:.3g})"
        )


def _is_replicated(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(param, DTensor):
        return all(isinstance(p, Replicate) for p in param.placements)
    return True  # a plain tensor is (meant to be) the same on every rank


def _per_rank(local: torch.Tensor) -> list[torch.Tensor]:
    """Each simulated rank's value of a local tensor (LocalTensorMode), else this one."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(local, LocalTensor):
        return [local._local_tensors[r] for r in sorted(local._local_tensors)]
    return [local]


def differences(model: nn.Module, when: str) -> list[ReplicaDifference]:
    """The replicated parameters of `model` (run under LocalTensorMode) whose value or
    gradient is not identical on every rank."""
    found = []
    for name, kind, local in _replicas(model):
        values = _per_rank(local)
        for rank, value in enumerate(values[1:], start=1):
            if not torch.equal(value, values[0]):
                diff = (value.double() - values[0].double()).abs().max().item()
                found.append(ReplicaDifference(name, kind, when, rank, math.inf if math.isnan(diff) else diff))
                break
    return found


def _replicas(model: nn.Module, grads: dict[str, Any] | None = None):
    """(parameter, "value" | "gradient", this rank's tensor) of each replicated parameter;
    `grads`: {name: gradient} to use instead of the parameters' own."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not _is_replicated(param):
            continue
        grad = param.grad if grads is None else grads.get(name)
        for kind, tensor in (("value", param), ("gradient", grad)):
            if tensor is None or (isinstance(tensor, DTensor) and not _is_replicated(tensor)):
                continue  # a partial gradient is not a replica of one value
            yield name, kind, (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _digest(t: torch.Tensor) -> str:
    """A digest of the tensor's bytes: equal replicas have equal digests."""
    return hashlib.blake2b(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()


def differences_across_ranks(model: nn.Module, when: str, gather: Callable[[Any], list], tp: int,
                             grads: dict[str, Any] | None = None, at_most: int = 10) -> list[ReplicaDifference]:
    """Under torchrun: the replicated parameters whose value or gradient is not identical
    on every rank of a TP group (ranks g*tp .. g*tp+tp-1: the mesh is row-major, tp fastest).
    `gather(obj)` returns every rank's obj (an all-gather over all ranks); every rank makes
    the same calls and returns the same list, at most `at_most` entries."""
    mine = list(_replicas(model, grads))
    everyone = gather([(name, kind, _digest(t)) for name, kind, t in mine])
    found = []
    for base in range(0, len(everyone), tp):
        group = [dict(((name, kind), d) for name, kind, d in digests) for digests in everyone[base:base + tp]]
        for key, digest in group[0].items():
            rank = next((base + i for i, other in enumerate(group) if other.get(key) != digest), None)
            if rank is not None and len(found) < at_most:
                found.append(ReplicaDifference(key[0], key[1], when, rank, math.nan, base))
    if not found:
        return []
    tensors = {(name, kind): t.cpu() for name, kind, t in mine}
    for i, item in enumerate(found):  # the values of the differing replicas, to say by how much
        values = gather(tensors.get((item.parameter, item.kind)))
        got, want = values[item.rank], values[item.base]
        diff = math.inf if got is None or want is None else (got.double() - want.double()).abs().max().item()
        found[i] = dataclasses.replace(item, diff=math.inf if math.isnan(diff) else diff)
    return found


def add_to(result, found: list[ReplicaDifference], plan: Any, model: nn.Module, records):
    """`result` (a CheckResult) with the replica differences `found`, each with the rule
    to blame (`records`: the module calls of a run, for their order); a result that
    passed fails on the first of them."""
    from .first_difference import claims, owning_rule

    if not found:
        return result
    claimed, call_order = claims(plan, model, records)
    located = [(item, *owning_rule(claimed, item.parameter.rpartition(".")[0], list(call_order))) for item in found]
    problems = result.problems if not result.passed else [found[0].describe()]
    return dataclasses.replace(result, passed=False, problems=problems, replicas=list(result.replicas) + located)

