"""Which module's own computation goes wrong in a failed `--check` (simulated ranks).

The first module whose output differs is often not the one to blame: a fused qkv
Linear sharded plain colwise computes its local slice right, the attention around
it splits that slice into q, k and v as if it were whole, and the first output
that differs is the next rule's (`attn.proj`). So, starting at that module and
going outward through the modules that enclose it, each is run again on the
single-device run's own inputs for that call, laid out as the sharded run had them
(whole, or each rank's chunk of the dim its rule declares sharded). A module whose
output then matches computes right (the wrong values came in); the first one whose
output still differs is where the local computation goes wrong.

One engine for both runs: `Ranks` says how this process sees the sharded side's
ranks. Simulated (`simulated`), a sharded input is every rank's chunk in one
LocalTensor and each rank's value is compared here. Under torchrun (`real`), this
process runs its own chunk, and the ranks agree on each module's verdict (a gather)
before going on, so that every rank reruns the same modules in the same order and
makes the same collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from .first_difference import Located, _first_tensor, owning_rule

_UNTESTABLE = (RuntimeError, ValueError, TypeError, IndexError)  # the inputs do not fit the module as laid out


def _one_process(verdict: bool | None) -> bool | None:
    return verdict


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The sharded side's ranks as this process sees them."""

    tp: int
    values: Callable  # a module's output -> each rank's full value seen here
    chunk: Callable  # a reference input's chunks, one per TP rank -> the input as this process runs it
    agree: Callable = _one_process  # this process's verdict -> every rank's one (a gather under torchrun)


def simulated(tp: int, rank_values: Callable) -> Ranks:
    """All `tp` ranks in this process (LocalTensorMode): `rank_values(t)` gives each one's full value."""
    from torch.distributed._local_tensor import LocalTensor

    return Ranks(tp, rank_values, lambda chunks: LocalTensor({rank: chunk.clone() for rank, chunk in enumerate(chunks)}))


def real(tp: int, tp_rank: int, full: Callable, gather: Callable) -> Ranks:
    """This process is TP rank `tp_rank` of real ranks: `full(t)` gathers a sharded output
    to full size (the same collective on every rank), `gather(obj)` gives every rank's obj."""
    return Ranks(tp, lambda t: [full(t)], lambda chunks: chunks[tp_rank].clone(), lambda verdict: agreed(gather(verdict)))


def agreed(verdicts: list) -> bool | None:
    """The ranks' verdicts as one: untestable (None) where any rank could not run the
    module, else wrong (False) where any rank's output differs."""
    if any(v is None for v in verdicts):
        return None
    return all(verdicts)


def refine(located: Located, model: nn.Module, want: list, want_inputs: list, got: list, got_inputs: list,
           ranks: Ranks, allowed: Callable) -> Located:
    """`located` (a failed check's first difference), blaming instead the rule of the module
    whose own computation goes wrong, when that is not the first module whose output differs.
    `want_inputs` / `got_inputs`: each recorded call's inputs (`recording(inputs=...)`).
    Under torchrun every rank calls it with the same `located` (gathered)."""
    if not located.first.what.startswith(("the output", "the model")):
        return located
    found = culprit(model, located.claimed, located.first.index, want, want_inputs, got, got_inputs, ranks, allowed)
    if found is None or found[0] == located.first.module:
        return located
    module, cleared = found
    rule, relation = owning_rule({k: v for k, v in located.claimed.items() if k not in cleared}, module, list(located.call_order))
    if rule is None:
        return located
    right = f", '{', '.join(sorted(cleared))}' right ones" if cleared else ""
    return dataclasses.replace(located, rule=rule, relation=(
        f"{relation}; given the single-device run's own inputs, '{module or '<root>'}' still computes wrong values{right}"
    ))


def culprit(model: nn.Module, claimed: dict, index: int, want: list, want_inputs: list, got: list, got_inputs: list,
            ranks: Ranks, allowed: Callable) -> tuple[str, set[str]] | None:
    """(module whose computation on the reference's inputs differs, modules cleared on
    the way) for the difference first seen at reference call `index`; None when no
    module on the way can be run on the reference's inputs."""
    got_at = _calls(got)
    cleared: set[str] = set()
    for j in _outward(want, index):
        name = want[j][0]
        key = (name, sum(1 for n, _ in want[:j] if n == name))
        if key not in got_at or want[j][1] is None:
            continue
        verdict = _rerun(model.get_submodule(name), claimed.get(name), want[j][1], want_inputs[j], got_inputs[got_at[key]],
                         ranks, allowed)
        if verdict is True:
            cleared.add(name)
        elif verdict is False:
            return name, cleared
    return None


def _calls(records: list) -> dict[tuple[str, int], int]:
    """(module, n-th call of it) -> index in `records`."""
    seen: dict[str, int] = {}
    out = {}
    for i, (name, _) in enumerate(records):
        out[(name, seen.get(name, 0))] = i
        seen[name] = seen.get(name, 0) + 1
    return out


def _outward(want: list, index: int) -> list[int]:
    """The call at `index`, then the calls of its enclosing modules that finish after it, innermost first."""
    name = want[index][0]
    parts = name.split(".") if name else []
    chain = [index]
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        after = next((k for k in range(index + 1, len(want)) if want[k][0] == path), None)
        if after is not None:
            chain.append(after)
    return chain


def _rerun(module: nn.Module, rule: Any, reference_out: torch.Tensor, reference_in: tuple, sharded_in: tuple,
           ranks: Ranks, allowed: Callable) -> bool | None:
    """Whether `module` (sharded) reproduces `reference_out` from the reference's inputs
    on every rank; None: untestable. The ranks agree on whether to run it, then on the verdict."""
    if not reference_out.is_floating_point():
        return None
    (ref_args, ref_kwargs), (args, kwargs) = reference_in, sharded_in
    shard = _declared_shard(rule)
    laid_args = [_lay(r, g, ranks, shard if i == 0 else None) for i, (r, g) in enumerate(zip(ref_args, args))]
    laid_kwargs = {k: _lay(v, kwargs.get(k), ranks, None) for k, v in ref_kwargs.items()}
    runnable = len(ref_args) == len(args) and all(v is not _NO for v in (*laid_args, *laid_kwargs.values()))
    if not ranks.agree(True if runnable else None):
        return None
    return ranks.agree(_compare(module, laid_args, laid_kwargs, reference_out, ranks, allowed))


def _compare(module: nn.Module, args: list, kwargs: dict, reference_out: torch.Tensor, ranks: Ranks, allowed: Callable) -> bool | None:
    with torch.no_grad():
        try:
            out = _first_tensor(module(*args, **kwargs))
        except _UNTESTABLE:
            return None
        if out is None:
            return None
        values = ranks.values(out)
    if any(v.shape != reference_out.shape for v in values):
        return None  # a local shard: not comparable
    limit = allowed(reference_out)
    return all((v.to(reference_out.dtype) - reference_out).abs().max().item() <= limit for v in values)


_NO = object()  # an input that cannot be laid out as the sharded run had it


def _declared_shard(rule: Any) -> int | None:
    """The dim a rule's style declares its (plain) first input sharded on, if any."""
    declared = rule.spec.declared_input() if rule is not None else None
    placement = declared[0] if declared else None
    return placement.dim if placement is not None and placement.kind == "shard" else None


def _lay(reference: Any, sharded: Any, ranks: Ranks, shard_dim: int | None) -> Any:
    """The reference's input laid out as the sharded run had it: whole (same shape), or
    each rank's chunk of `shard_dim`; _NO when neither (a DTensor, another layout)."""
    from torch.distributed.tensor import DTensor

    tp = ranks.tp
    if isinstance(reference, torch.Tensor):
        if not isinstance(sharded, torch.Tensor) or isinstance(sharded, DTensor):
            return _NO
        if sharded.shape == reference.shape:
            return reference.clone()
        if shard_dim is not None and reference.dim() and reference.shape[shard_dim] % tp == 0:
            chunks = reference.chunk(tp, dim=shard_dim)
            if chunks[0].shape == sharded.shape:
                return ranks.chunk(chunks)
        return _NO
    if isinstance(reference, (tuple, list)) and isinstance(sharded, (tuple, list)) and len(reference) == len(sharded):
        laid = [_lay(r, g, ranks, None) for r, g in zip(reference, sharded)]
        return _NO if any(v is _NO for v in laid) else type(reference)(laid)
    return reference
