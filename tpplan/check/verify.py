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

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint.meta import meta_parameters
from .result import CheckResult
from ..simulation.training import param_groups
from ..simulation.simulate import (
    allowed_diff,
    default_inputs,
    forward_backward,
    local_ranks,
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
    steps: int = 0,
    checkpoint: str | None = None,
    allow_missing: Iterable[str] = (),
    shard: Callable[[nn.Module, Any], None] | None = None,
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

    Both sides run in eval mode (dropout off: `dropout.for_check`, said in the result's
    notes). A failed check is `located` at its first differing tensor and the rule to
    blame (`first_difference`). Every replicated parameter and its gradient must be
    identical on all ranks (`replicas`, TP506). `steps`: then that many AdamW steps,
    each followed by a forward and backward compared the same way.

    `checkpoint`: both sides load it instead (`build_model` then builds on the meta
    device): the reference on one device, and each simulated rank its own slices
    (`simulation.simulated_load.load_ranks`); `dtype=None` keeps the checkpoint's.
    `shard(model, mesh)` applies the plan instead of `plan.apply` (the dry run's,
    which also fills its report from the sharded model).
    """
    from .dropout import for_check
    from .first_difference import locate, recording
    from .local_culprit import refine, simulated
    from .replicas import add_to, differences

    if dtype is not None:
        default_rtol, default_atol = tolerance(dtype)
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol

    with torch.random.fork_rng(devices=[]):  # seed the build without touching the caller's RNG
        torch.manual_seed(seed)
        with meta_parameters() if checkpoint else contextlib.nullcontext():  # buffers as the constructor computes them
            built = build_model()
        # floats only: Module.to(dtype) casts complex tensors too, and a complex rotary
        # table (torchtitan's freqs_cis) cast to float32 loses its imaginary part
        reference = built if dtype is None else built._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    dropout_note = for_check(reference)  # eval mode on both sides: the copy below inherits it
    model = copy.deepcopy(reference)  # before the reference is loaded: the TP side loads its own slices
    if checkpoint:
        from ..checkpoint.load import load_checkpoint

        load_checkpoint(reference, checkpoint, dtype=dtype, allow_missing=tuple(allow_missing), device="cpu")
    if inputs is None:
        inputs = default_inputs(reference, generator=torch.Generator().manual_seed(seed))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    inputs = tuple(x.to(dtype) if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    want_inputs: list = []
    with recording(reference, inputs=want_inputs) as want_records:
        ref_out = reference(*inputs)
    scalar_loss(ref_out).backward()
    reference_steps = _adamw_steps(_with_grads(reference), inputs, steps) if steps else []

    def values(t):
        return [value for _, value in _rank_values(t)]

    with simulated_world(tp), local_ranks(tp):
        (shard or functools.partial(_apply, plan))(model, tp_mesh(tp, getattr(plan, "mesh_axis", None) or "tp"))
        if checkpoint:
            from ..simulation.simulated_load import load_ranks

            load_ranks(model, checkpoint, tp, dtype=dtype, allow_missing=allow_missing)
        got_inputs: list = []
        with recording(model, inputs=got_inputs) as got_records:
            out, comms = forward_backward(model, inputs)
        grads = {name: p.grad for name, p in model.named_parameters()}
        problems, pairs = run_pairs(out, ref_out, grads, reference, output_name=lambda i: "output")
        result = _with_problems(problems, compare(pairs, rtol=rtol, atol=atol))
        if not result.passed:
            result.located = locate(plan, model, reference, got_records, want_records, values,
                                    lambda want: allowed_diff(want, *_tolerances(want, rtol, atol)))
            if result.located is not None:  # blame the module whose own computation goes wrong
                result.located = refine(result.located, model, want_records, want_inputs, got_records, got_inputs, simulated(tp, values),
                                        lambda want: allowed_diff(want, *_tolerances(want, rtol, atol)))
        replicas = differences(model, "after backward")
        if reference_steps:
            _one_copy_per_rank(model, tp)
            optimizer = torch.optim.AdamW(param_groups(model), lr=_STEP_LR)
            for step, (want_outputs, want_grads) in enumerate(reference_steps, start=1):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                out = model(*inputs)
                scalar_loss(out).backward()
                pairs = [Pair(f"after step {step}: output", g, w) for g, w in zip(output_tensors(out), want_outputs)]
                pairs += [Pair(f"after step {step}: {name} grad", p.grad, want_grads.get(name)) for name, p in model.named_parameters()]
                stepped = compare(pairs, rtol=rtol, atol=atol)
                result = CheckResult(result.passed and stepped.passed, max(result.max_abs_diff, stepped.max_abs_diff),
                                     result.problems + stepped.problems, {**result.diffs, **stepped.diffs}, located=result.located)
                replicas += differences(model, f"after step {step}")
        result = add_to(result, replicas, plan, model, want_records)
    result.comms = comms
    result.notes = [dropout_note] if dropout_note else []
    return result


def _tolerances(want: torch.Tensor, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default_rtol, default_atol = tolerance(want.dtype)
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def _one_copy_per_rank(model: nn.Module, tp: int) -> None:
    """Give each replicated parameter one storage per simulated rank. A replicated
    DTensor's local value (and a plain parameter) is one tensor that LocalTensorMode
    shares between the ranks, so an optimizer's in-place update would be applied once
    per rank to it; real ranks each hold their own copy."""
    from torch.distributed._local_tensor import LocalTensor

    replaced: dict[int, nn.Parameter] = {}  # a tied parameter is replaced once, everywhere
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    if not isinstance(param._local_tensor, LocalTensor):
                        param._local_tensor = LocalTensor({rank: param._local_tensor.clone() for rank in range(tp)})
                elif not isinstance(param, LocalTensor):
                    if id(param) not in replaced:
                        twin = nn.Parameter(LocalTensor({rank: param.detach().clone() for rank in range(tp)}), param.requires_grad)
                        twin.grad = param.grad
                        replaced[id(param)] = twin
                    setattr(module, name, replaced[id(param)])


def _with_grads(module: nn.Module) -> nn.Module:
    """A deep copy of `module` with its parameters' gradients (deepcopy drops them)."""
    twin = copy.deepcopy(module)
    for (_, param), (_, copied) in zip(module.named_parameters(), twin.named_parameters()):
        copied.grad = None if param.grad is None else param.grad.detach().clone()
    return twin


_STEP_LR = 1e-3  # AdamW's first steps move each weight by about lr, whatever its gradient's size


def _adamw_steps(reference: nn.Module, inputs: tuple, steps: int) -> list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """The single-device side of `steps` AdamW steps: (outputs, {name: grad}) of the
    forward and backward after each step."""
    optimizer = torch.optim.AdamW(reference.parameters(), lr=_STEP_LR)
    results = []
    for _ in range(steps):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out = reference(*inputs)
        scalar_loss(out).backward()
        grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters() if p.grad is not None}
        results.append(([t.detach().clone() for t in output_tensors(out)], grads))
    return results
