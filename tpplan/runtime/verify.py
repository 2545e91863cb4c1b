"""The one verification engine: a tensor-parallel run against its single-device
reference, for `apply --check` (torchrun and dry run) and the tests.

`compare` takes named (got, want) tensor pairs in order (the outputs, then every
parameter gradient) and returns a `CheckResult` whose problems list the
differences in that order, the first difference first. `got` may be a DTensor
(gathered to full size) and, under `LocalTensorMode`, holds one value per
simulated rank: each is compared and a difference names its rank.

Tensor parallelism reorders float reductions, so results match to rounding, not
bit for bit: a tensor passes when max|got - want| <= atol + rtol * max|want|,
relative to the tensor's scale (`simulate.tolerance`: by dtype).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .report import CheckResult
from .simulate import (
    allowed_diff,
    default_inputs,
    forward_backward,
    max_abs_diff,
    output_tensors,
    scalar_loss,
    simulated_world,
    tolerance,
    tp_mesh,
)


class Pair(NamedTuple):
    """One compared tensor: its name in messages, the TP run's value and the reference's."""

    name: str
    got: torch.Tensor | None
    want: torch.Tensor | None


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank_values(t: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    """(rank, value) of a TP result at full size: one per simulated rank under
    LocalTensorMode, else this process's value (rank None)."""
    from torch.distributed._local_tensor import LocalTensor

    t = full_tensor(t)
    if isinstance(t, LocalTensor):
        return [(rank, t._local_tensors[rank]) for rank in sorted(t._local_tensors)]
    return [(None, t)]


def _compare_one(pair: Pair, rtol: float | None, atol: float | None, problems: list[str]) -> float:
    """Max abs diff of `pair` (inf for a shape mismatch); its problems appended."""
    got, want = pair.got, pair.want
    assert got is not None and want is not None
    default_rtol, default_atol = tolerance(want.dtype)
    limit = allowed_diff(want, default_rtol if rtol is None else rtol, default_atol if atol is None else atol)
    worst = 0.0
    for rank, value in _rank_values(got):
        on = "" if rank is None else f": rank {rank}"
        if value.shape != want.shape:
            shape = "shape" if rank is None else "has shape"
            problems.append(f"{pair.name}{on or ':'} {shape} {tuple(value.shape)}, single device {tuple(want.shape)}")
            return math.inf
        diff = max_abs_diff(value, want)
        if not diff <= limit:  # also catches NaN
            problems.append(f"{pair.name}{on} differs by up to {diff:.3g} (allowed {limit:.3g})")
        worst = math.inf if math.isnan(diff) else max(worst, diff)
    return worst


def compare(pairs: Iterable[Pair], *, rtol: float | None = None, atol: float | None = None) -> CheckResult:
    """Compare each pair in order (tolerances by the reference's dtype unless given);
    a tensor missing on one side only is a difference, on both sides nothing to compare."""
    problems: list[str] = []
    diffs: dict[str, float] = {}
    for pair in pairs:
        if pair.got is None or pair.want is None:
            if (pair.got is None) != (pair.want is None):
                problems.append(f"{pair.name} is {'missing' if pair.got is None else 'unexpected'}")
            continue
        diff = _compare_one(pair, rtol, atol, problems)
        diffs[pair.name] = max(diffs.get(pair.name, 0.0), diff)  # the outputs of a dry run share one name
    return CheckResult(passed=not problems, max_abs_diff=max(diffs.values(), default=0.0), problems=problems, diffs=diffs)


def run_pairs(output: Any, ref_output: Any, grads: Mapping[str, torch.Tensor | None], reference: nn.Module, *, output_name: Callable[[int], str]) -> tuple[list[str], list[Pair]]:
    """The pairs of a run: its floating outputs, then each reference parameter's
    gradient (`grads`: {fqn: grad} of the TP run); and a problem when the two
    runs have different numbers of outputs."""
    got, want = output_tensors(output), output_tensors(ref_output)
    problems = [f"the output has {len(got)} tensors, the single-device one {len(want)}"] if len(got) != len(want) else []
    pairs = [Pair(output_name(i), g, w) for i, (g, w) in enumerate(zip(got, want))]
    pairs += [Pair(f"{name} grad", grads.get(name), param.grad) for name, param in reference.named_parameters()]
    return problems, pairs


def _with_problems(first: list[str], result: CheckResult) -> CheckResult:
    if not first:
        return result
    return CheckResult(False, result.max_abs_diff, first + result.problems, result.diffs, result.comms)


def compare_with_reference(model: nn.Module, reference: nn.Module, inputs: tuple, output: Any, grads: dict, copy_weights: bool = True) -> CheckResult:
    """This rank's outputs and gradients (`grads`: {name: grad} of the sharded run)
    against a single-device run of `reference` loaded with the sharded model's
    weights gathered to full tensors (or, `copy_weights=False`, with its own: the
    same checkpoint loaded on one device)."""
    with torch.no_grad():
        for name, param in model.named_parameters() if copy_weights else ():
            reference.get_parameter(name).copy_(full_tensor(param))
        for name, buffer in model.named_buffers() if copy_weights else ():
            reference.get_buffer(name).copy_(full_tensor(buffer))
    ref_output = reference(*inputs)
    scalar_loss(ref_output).backward()
    problems, pairs = run_pairs(output, ref_output, grads, reference, output_name=lambda i: f"output {i}")
    return _with_problems(problems, compare(pairs))


def merge_ranks(results: list[CheckResult], at_most: int = 10) -> CheckResult:
    """One verdict from every rank's result (its problems prefixed with the rank)."""
    problems = [f"rank {rank}: {text}" for rank, result in enumerate(results) for text in result.problems]
    shown = problems[:at_most] + ([f"and {len(problems) - at_most} more"] if len(problems) > at_most else [])
    return CheckResult(
        passed=all(r.passed for r in results),
        max_abs_diff=max(r.max_abs_diff for r in results),
        problems=shown,
        diffs={name: max(r.diffs.get(name, 0.0) for r in results) for name in results[0].diffs} if results else {},
    )


def _apply(plan: Any, model: nn.Module, mesh: Any) -> None:
    if hasattr(plan, "apply"):
        plan.apply(model, mesh)
    elif isinstance(plan, Mapping):
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, dict(plan))
    else:
        plan(model, mesh)


def check_parity(
    build_model: Callable[[], nn.Module],
    plan: Any,
    tp: int,
    inputs: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckResult:
    """Run `plan` at TP degree `tp` with real per-rank values (`LocalTensorMode`,
    under the fake process group) and compare with one device.

    `plan` is a tpplan plan (anything with `.apply(model, mesh)`), a torch
    `{fqn: ParallelStyle}` dict, or a callable `(model, mesh)`. The reference
    is built with `seed` and copied before sharding, so both models start from
    the same weights. Both run one forward and backward of `scalar_loss` on the
    same `inputs` (default: `default_inputs`); the outputs and every parameter
    gradient, gathered to full size on every rank, must be within
    `atol + rtol * max|reference|` of the reference (defaults by `dtype`).
    The result's `comms` are the TP run's collectives.
    """
    default_rtol, default_atol = tolerance(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol

    with torch.random.fork_rng(devices=[]):  # seed the build without touching the caller's RNG
        torch.manual_seed(seed)
        reference = build_model().to(dtype)
    model = copy.deepcopy(reference)
    if inputs is None:
        inputs = default_inputs(reference, generator=torch.Generator().manual_seed(seed))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    ref_out = reference(*inputs)
    scalar_loss(ref_out).backward()

    from torch.distributed._local_tensor import LocalTensorMode

    with simulated_world(tp), LocalTensorMode(tp):
        _apply(plan, model, tp_mesh(tp, getattr(plan, "mesh_axis", None) or "tp"))
        out, comms = forward_backward(model, inputs)
        grads = {name: p.grad for name, p in model.named_parameters()}
        problems, pairs = run_pairs(out, ref_out, grads, reference, output_name=lambda i: "output")
        result = _with_problems(problems, compare(pairs, rtol=rtol, atol=atol))
    result.comms = comms
    return result
