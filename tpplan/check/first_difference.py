"""Where a failing `--check` starts to differ: the first module (in forward order)
whose output differs from the single-device run, and the rule to blame for it
(the rule that shards that module or its closest ancestor; for a module no rule
reaches, the last planned module that ran before it, which produced its input).

Every module's output is recorded on both sides while they run; recording holds
references only, and the sharded side's DTensors are gathered after the run, so
the collectives a check counts are not changed. A sharded output held as a local
shard (a colwise Linear's `use_local_output`) has another shape than the
reference's and is not comparable; it is skipped, and the next comparable
tensor downstream names the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class Difference:
    what: str  # "the output of 'model.layers.0.mlp'" or "the gradient of 'model.norm.weight'"
    module: str  # the module whose output (or parameter) differs
    rank: int
    diff: float
    allowed: float
    index: int = 0  # its place among the module calls (or gradients) compared: across ranks the first wins

    def describe(self) -> str:
        return f"{self.what} is the first tensor that differs (rank {self.rank}: by up to {self.diff:.3g}, allowed {self.allowed:.3g})"


@contextlib.contextmanager
def recording(model: nn.Module, tensors: bool = True, inputs: list | None = None) -> Iterator[list[tuple[str, Any]]]:
    """(module path, first tensor of its output) for each module call, in call order;
    `tensors=False`: (module path, None), the call order alone, holding nothing.
    `inputs`: a list that gets each recorded call's (args, kwargs), detached, in the same order."""
    records: list[tuple[str, Any]] = []
    handles = []
    pending: dict[str, list] = {}  # module -> the inputs of its calls running (before any style's hook)
    for name, module in model.named_modules():
        def before(_module, args, kwargs, name=name):
            pending.setdefault(name, []).append((_detached(args), {k: _detached(v) for k, v in kwargs.items()}))

        def hook(_module, _args, output, name=name):
            given = pending[name].pop() if inputs is not None else None
            tensor = _first_tensor(output)
            if tensor is not None:
                records.append((name, tensor.detach() if tensors else None))
                if inputs is not None:
                    inputs.append(given)
        if inputs is not None:
            handles.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value) if type(value) in (tuple, list) else value
    return value


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in map(_first_tensor, output) if t is not None), None)
    if isinstance(output, dict) or hasattr(output, "values"):
        try:
            values = list(output.values())
        except TypeError:
            return None
        return next((t for t in map(_first_tensor, values) if t is not None), None)
    return None


def first_output_difference(got: list[tuple[str, Any]], want: list[tuple[str, Any]], rank_values, allowed) -> Difference | None:
    """The first module call whose output differs beyond tolerance, matching calls by
    (module, n-th call of it); `rank_values(t)` gives each rank's full value."""
    seen: dict[str, int] = {}
    sharded = {}
    for name, tensor in got:
        sharded[(name, seen.get(name, 0))] = tensor
        seen[name] = seen.get(name, 0) + 1
    seen.clear()
    for index, (name, reference) in enumerate(want):
        key = (name, seen.get(name, 0))
        seen[name] = key[1] + 1
        tensor = sharded.get(key)
        if tensor is None or not reference.is_floating_point():
            continue
        limit = allowed(reference)
        for rank, value in enumerate(rank_values(tensor)):
            if value.shape != reference.shape:
                break  # a local shard: not comparable
            diff = (value.to(reference.dtype) - reference).abs().max().item() if reference.numel() else 0.0
            if not diff <= limit:
                return Difference(f"the output of '{name}'" if name else "the model's output", name, rank, math.inf if math.isnan(diff) else diff, limit, index)
    return None


def first_gradient_difference(grads: dict[str, Any], reference: nn.Module, rank_values, allowed, exhaustive: bool = False) -> Difference | None:
    """The first parameter gradient (in the reference's order) beyond tolerance; `grads`:
    {name: gradient} of the sharded run. `exhaustive`: look at every gradient even after
    a difference, so that ranks gathering each one (collectives) all make the same calls."""
    first = None
    for index, (name, ref_param) in enumerate(reference.named_parameters()):
        grad = grads.get(name)
        if ref_param.grad is None or grad is None or (first is not None and not exhaustive):
            continue
        limit = allowed(ref_param.grad)
        for rank, value in enumerate(rank_values(grad)):
            if first is not None or value.shape != ref_param.grad.shape:
                continue
            diff = (value.to(ref_param.grad.dtype) - ref_param.grad).abs().max().item()
            if not diff <= limit:
                first = Difference(f"the gradient of '{name}'", name.rpartition(".")[0], rank, math.inf if math.isnan(diff) else diff, limit, index)
    return first


def owning_rule(claimed: dict[str, Any], module: str, call_order: list[str]) -> tuple[Any, str] | tuple[None, None]:
    """(rule, how it relates to `module`) for the rule that shards `module` or its closest
    ancestor; else the first planned module inside it; else the last planned module
    called before it."""
    parts = module.split(".") if module else []
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        if path in claimed:
            return claimed[path], "its rule" if depth == len(parts) else f"the rule of its closest planned ancestor '{path}'"
    inside = [name for name in call_order if name in claimed and name.startswith(module + ".")] if module else []
    if inside:  # a container's own parameter computes on what its planned children give it
        return claimed[inside[0]], f"the rule of '{inside[0]}', the first planned module inside '{module}'"
    if module in call_order:
        for name in reversed(call_order[: call_order.index(module)]):
            if name in claimed:
                return claimed[name], f"the rule of '{name}', the last planned module that ran before it"
    return None, None


@dataclass(frozen=True)
class Located:
    """Where a failed check starts: the first differing tensor, and the plan rule to blame."""

    first: Difference
    rule: Any = None  # core.plan.Rule, or None when no rule reaches the module
    relation: str | None = None  # how the rule relates to the module ("its rule", ...)
    claimed: Any = None  # {module path: Rule} of the plan on the model
    call_order: tuple = ()  # module paths in the order their forwards finished


def locate(plan: Any, model: nn.Module, reference: nn.Module, got, want, rank_values, allowed) -> Located | None:
    """The first differing tensor of a failed check (a module output in forward order; when
    every comparable output agrees, the first parameter gradient) and the rule to blame."""
    first = first_output_difference(got, want, rank_values, allowed)
    if first is None:
        grads = {name: param.grad for name, param in model.named_parameters()}
        first = first_gradient_difference(grads, reference, rank_values, allowed)
    if first is None:
        return None
    return blame(first, plan, model, want)


def claims(plan: Any, model: nn.Module, want) -> tuple[dict, tuple]:
    """({module path: Rule} of a tpplan plan on `model`, module paths in forward order)."""
    return (plan.match(model) if hasattr(plan, "match") else {}), tuple(dict.fromkeys(name for name, _ in want))


def blame(first: Difference, plan: Any, model: nn.Module, want) -> Located:
    claimed, call_order = claims(plan, model, want)
    rule, relation = owning_rule(claimed, first.module, list(call_order))
    return Located(first, rule, relation, claimed, call_order)


@dataclass(frozen=True)
class Recorded:
    """One more forward of both sides under torchrun: each module call's output (the
    sharded side's gathered to full size) and inputs, as `recording` gives them."""

    got: list
    got_inputs: list
    want: list
    want_inputs: list


def full_size(t: Any) -> Any:
    """A sharded tensor gathered to full size (a collective), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def default_allowed(want: torch.Tensor) -> float:
    from ..simulation.simulate import allowed_diff, tolerance

    return allowed_diff(want, *tolerance(want.dtype))


def record_across_ranks(model: nn.Module, reference: nn.Module, inputs: tuple) -> Recorded:
    """Both sides run once more recording each module's output and inputs; every rank
    gathers every sharded output to full size (the same collectives in the same order)."""
    got_inputs: list = []
    want_inputs: list = []
    with torch.no_grad():
        with recording(model, inputs=got_inputs) as got:
            model(*inputs)
        got = [(name, full_size(t)) for name, t in got]
        with recording(reference, inputs=want_inputs) as want:
            reference(*inputs)
    return Recorded(got, got_inputs, want, want_inputs)


def locate_across_ranks(plan: Any, model: nn.Module, reference: nn.Module, recorded: Recorded, grads: dict[str, Any], gather,
                        rank: int) -> Located | None:
    """Under torchrun, where a failed check starts: every rank compares the `recorded`
    outputs, and the ranks' first differences are gathered (`gather(obj)`: every rank's
    obj): the earliest wins, so every rank returns the same. When no output differs,
    the gradients (`grads` of the sharded run) are compared the same way."""

    def earliest(found: Difference | None) -> Difference | None:
        everyone = [d for d in gather(found and dataclasses.replace(found, rank=rank)) if d is not None]
        return min(everyone, key=lambda d: (d.index, d.rank), default=None)

    first = earliest(first_output_difference(recorded.got, recorded.want, lambda t: [t], default_allowed))
    if first is None:  # decided alike on every rank: each then gathers every gradient
        first = earliest(first_gradient_difference(grads, reference, lambda t: [full_size(t)], default_allowed, exhaustive=True))
    return None if first is None else blame(first, plan, model, recorded.want)
