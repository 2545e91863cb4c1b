"""Simulate a tensor-parallel world of any size in one process.

Two levels, both on CPU and without `torchrun`:

- shapes and communication: `simulated_world(n)` starts torch's fake process
  group (collectives are no-ops), so a model on the meta device or under
  `FakeTensorMode` can be parallelized at any degree and its collectives
  counted with `count_collectives`;
- real values: `check_parity` adds torch's `LocalTensorMode`, which keeps one
  real tensor per simulated rank and performs every collective on them, and
  compares outputs and gradients with a single-device reference.

    with simulated_world(8):
        mesh = tp_mesh(8)
        with torch.device("meta"):
            model = llama3_8b()
            plan.apply(model, mesh)
            comms = count_collectives(model, default_inputs(model))
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

# The op spellings torch uses (functional, c10d, DTensor's own), keyed by their
# name without underscores, mapped to the names of SPEC section 4.
_COLLECTIVE_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
}

# CommDebugMode's module tracker hooks every module's backward, and torch warns for
# each module whose inputs need no grad (an Embedding fed token ids) and each whose
# output is not a tensor (transformers' ModelOutput): noise from the counting itself.
_TRACKER_WARNINGS = (
    "Full backward hook is firing when gradients are computed with respect to module outputs",
    "For backward hooks to be called",
)


# Real values cost real memory: a dry run (`apply --dry-run`, the lint's TP330)
# gives them only to models up to this size.
VALUES_LIMIT_BYTES = 1 << 30


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """FakeTensorMode that lets in real tensors made elsewhere (a module constant),
    with torch's traceback log of failing fake kernels off: the caller reports the
    failure (or retries with values), so the traceback is noise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def simulated_world(world_size: int) -> Iterator[None]:
    """Run the body with a fake default process group of `world_size` ranks (as rank 0).

    Reentrant for the same size: inside an active simulated world of that size
    it changes nothing. The group is destroyed on exit, so worlds of different
    sizes can follow each other in one process.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be at least 1")
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            yield
            return
        raise RuntimeError(
            f"cannot simulate {world_size} ranks: a process group ({dist.get_backend()}, "
            f"world size {dist.get_world_size()}) is already initialized; destroy it first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tp_mesh(world_size: int, axis: str = "tp") -> DeviceMesh:
    """A 1-D CPU mesh over all simulated ranks, its one dim named `axis`."""
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=(axis,))


def collective_name(op: object) -> str:
    """`c10d_functional.all_gather_into_tensor` -> `all_gather`; unknown ops keep their own name."""
    name = str(op).rsplit(".", 1)[-1]
    squashed = name.replace("_", "")
    for key, spec_name in _COLLECTIVE_NAMES.items():
        if key in squashed:
            return spec_name
    return name.strip("_")


@contextlib.contextmanager
def _counting(into: Counter) -> Iterator[None]:
    with warnings.catch_warnings():
        for message in _TRACKER_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        with CommDebugMode() as mode:
            yield
    for op, n in mode.get_comm_counts().items():  # functional and c10d ops can share a name: add them up
        if n:
            into[collective_name(op)] += n


def _as_args(inputs: Any) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output: a tensor, tuple/list, dict, or
    an object with `.logits` / `.last_hidden_state`."""
    for attr in ("logits", "last_hidden_state"):
        if not isinstance(output, (torch.Tensor, Mapping)) and hasattr(output, attr):
            return output_tensors(getattr(output, attr))
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in output_tensors(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in output_tensors(v)]
    return []


def scalar_loss(output: Any) -> torch.Tensor:
    """Mean of squares of every floating output: unlike a plain sum, its gradient
    depends on the output values, so a wrong output also shows in the gradients."""
    tensors = output_tensors(output)
    if not tensors:
        raise ValueError(f"the model output ({type(output).__name__}) holds no floating-point tensor")
    return sum(t.float().pow(2).mean() for t in tensors)


def forward_backward(model: nn.Module, inputs: Any) -> tuple[Any, dict[str, dict[str, int]]]:
    """One forward and backward (of `scalar_loss`); returns the output and the
    collectives of each pass as {"forward": {op: n}, "backward": {op: n}}."""
    forward, backward = Counter(), Counter()
    with _counting(forward):
        output = model(*_as_args(inputs))
    with _counting(backward):
        scalar_loss(output).backward()
    return output, {"forward": dict(sorted(forward.items())), "backward": dict(sorted(backward.items()))}


def count_collectives(model: nn.Module, inputs: Any) -> dict[str, dict[str, int]]:
    """Collectives of one forward and backward, e.g.
    {"forward": {"all_reduce": 5, "all_gather": 1}, "backward": {"all_reduce": 5}}.

    Works on real, meta or fake tensors; needs a process group (`simulated_world`)
    when the model is parallelized.
    """
    return forward_backward(model, inputs)[1]


def _first_leaf(model: nn.Module) -> tuple[str, nn.Module] | None:
    for name, module in model.named_modules():
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
            return name, module
    return None


def default_inputs(model: nn.Module, batch: int = 2, seq: int = 8, generator: torch.Generator | None = None) -> torch.Tensor:
    """Example inputs from the model's first module with parameters: token ids below
    `num_embeddings` for an Embedding, random floats of `in_features` for a Linear.
    On the model's device and (for floats) dtype, so meta models get meta inputs."""
    first = _first_leaf(model)
    if first is not None:
        _, module = first
        weight = module.weight
        on_meta = weight.device.type == "meta"
        gen = None if on_meta else generator
        if isinstance(module, nn.Embedding):
            return torch.randint(0, module.num_embeddings, (batch, seq), generator=gen, device=weight.device)
        if isinstance(module, nn.Linear):
            return torch.randn(batch, seq, module.in_features, generator=gen, device=weight.device, dtype=weight.dtype)
    found = f"{first[0]!r} is a {type(first[1]).__name__}" if first else "it has no parameters"
    raise ValueError(
        f"cannot make default inputs: the first module of {type(model).__name__} must be an Embedding "
        f"or a Linear, but {found}; pass the inputs explicitly (--inputs MOD:FN)"
    )


# Tensor parallelism reorders float reductions, so results match to rounding,
# not bit for bit. A tensor passes when max|got - want| <= atol + rtol * max|want|:
# relative to the tensor's scale, not element by element, so that elements near
# zero (where reordering dominates) cannot fail a correct plan. (rtol, atol) by dtype.
_TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.bfloat16: (2e-2, 1e-3),
    torch.float16: (2e-3, 1e-4),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a TP result of `dtype` with its single-device reference."""
    return _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])


def allowed_diff(want: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest max|got - want| that passes: atol + rtol * max|want|."""
    return atol + rtol * (want.abs().max().item() if want.numel() else 0.0)


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| in `want`'s dtype (NaN when either holds one; 0 when empty)."""
    return (got.detach().to(want.dtype) - want).abs().max().item() if want.numel() else 0.0


@dataclass
class ParityResult:
    """How a tensor-parallel run compares with the single-device reference."""

    passed: bool
    max_abs_diff: float  # over the outputs and every parameter gradient
    out_diff: float
    grad_diffs: dict[str, float]  # parameter fqn -> max abs diff over ranks
    comms_fwd: dict[str, int]
    comms_bwd: dict[str, int]
    problems: list[str] = field(default_factory=list)  # why it did not pass
    notes: list[str] = field(default_factory=list)  # what the check did to make the runs comparable (dropout off)
    first_difference: Any = None  # first_difference.Difference of a failed check
    rule: Any = None  # the plan rule that shards the first differing module (or its closest ancestor)
    rule_relation: str | None = None  # how that rule relates to the module ("its rule", ...)
    replicas: list = field(default_factory=list)  # replicas.ReplicaDifference: replicated values that differ by rank
    claimed: dict = field(default_factory=dict)  # module path -> the plan's Rule (a tpplan plan only)
    call_order: list = field(default_factory=list)  # module paths in the order their forwards finished

    @property
    def comms(self) -> dict[str, dict[str, int]]:
        return {"forward": self.comms_fwd, "backward": self.comms_bwd}


def _rank_values(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor of the simulated run as one plain tensor per rank (full size for DTensors)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in sorted(t._local_tensors)]
    return [t]


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, problems: list[str]) -> float:
    """Max abs diff of `got` (every rank's value) from `want`; records a problem when out of tolerance."""
    worst = 0.0
    limit = allowed_diff(want, rtol, atol)
    for rank, value in enumerate(_rank_values(got)):
        if value.shape != want.shape:
            problems.append(f"{what}: rank {rank} has shape {tuple(value.shape)}, single device {tuple(want.shape)}")
            return math.inf
        diff = max_abs_diff(value, want)
        if not diff <= limit:  # also catches NaN
            problems.append(f"{what}: rank {rank} differs by up to {diff:.3g} (allowed {limit:.3g})")
        worst = max(worst, diff) if not math.isnan(diff) else math.inf
    return worst


def _apply(plan: Any, model: nn.Module, mesh: DeviceMesh) -> None:
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
) -> ParityResult:
    """Run `plan` at TP degree `tp` with real per-rank values and compare with one device.

    `plan` is a tpplan plan (anything with `.apply(model, mesh)`), a torch
    `{fqn: ParallelStyle}` dict, or a callable `(model, mesh)`. The reference
    is built with `seed` and copied before sharding, so both models start from
    the same weights. Both run one forward and backward of `scalar_loss` on the
    same `inputs` (default: `default_inputs`); the outputs and every parameter
    gradient, gathered to full size on every rank, must be within
    `atol + rtol * max|reference|` of the reference (defaults by `dtype`).
    Both run in eval mode (dropout off: `dropout.for_check`). Every replicated
    parameter and its gradient must be identical on all ranks (`replicas`).
    `steps`: then that many AdamW steps, each followed by a forward and backward
    compared the same way.
    """
    default_rtol, default_atol = tolerance(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol

    with torch.random.fork_rng(devices=[]):  # seed the build without touching the caller's RNG
        torch.manual_seed(seed)
        reference = build_model().to(dtype)
    from .dropout import for_check
    from .first_difference import recording

    dropout_note = for_check(reference)  # eval mode on both sides (the copy below inherits it)
    model = copy.deepcopy(reference)
    if inputs is None:
        inputs = default_inputs(reference, generator=torch.Generator().manual_seed(seed))
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in _as_args(inputs))
    with recording(reference) as want_records:
        ref_out = reference(*inputs)
    scalar_loss(ref_out).backward()
    reference_steps = _adamw_steps(_with_grads(reference), inputs, steps) if steps else []

    from torch.distributed._local_tensor import LocalTensorMode

    from .replicas import differences

    problems: list[str] = []
    with simulated_world(tp), LocalTensorMode(tp):
        _apply(plan, model, tp_mesh(tp, getattr(plan, "mesh_axis", None) or "tp"))
        with recording(model) as got_records:
            out, comms = forward_backward(model, inputs)
        got, want = output_tensors(out), output_tensors(ref_out)
        if len(got) != len(want):
            problems.append(f"output: {len(got)} tensors, single device {len(want)}")
        out_diff = max((_compare("output", g, w, rtol, atol, problems) for g, w in zip(got, want)), default=0.0)
        grad_diffs = {}
        params = dict(model.named_parameters())
        for name, ref_param in reference.named_parameters():
            grad = params[name].grad
            if ref_param.grad is None or grad is None:
                if (ref_param.grad is None) != (grad is None):
                    problems.append(f"{name}: gradient is {'missing' if grad is None else 'unexpected'}")
                continue
            grad_diffs[name] = _compare(f"{name} grad", grad, ref_param.grad, rtol, atol, problems)
        first = rule = relation = None
        if problems:
            first, rule, relation = _locate_difference(plan, model, reference, got_records, want_records, rtol, atol)
        replicas = differences(model, "after backward")
        claimed = plan.match(model) if hasattr(plan, "match") else {}
        if reference_steps:
            _one_copy_per_rank(model, tp)
            optimizer = torch.optim.AdamW(model.parameters(), lr=_STEP_LR)
            for step, (want_outputs, want_grads) in enumerate(reference_steps, start=1):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                out = model(*inputs)
                scalar_loss(out).backward()
                got = output_tensors(out)
                for g, w in zip(got, want_outputs):
                    out_diff = max(out_diff, _compare(f"after step {step}: output", g, w, rtol, atol, problems))
                for name, param in model.named_parameters():
                    if param.grad is not None and want_grads.get(name) is not None:
                        diff = _compare(f"after step {step}: {name} grad", param.grad, want_grads[name], rtol, atol, problems)
                        grad_diffs[name] = max(grad_diffs.get(name, 0.0), diff)
                replicas += differences(model, f"after step {step}")
        if replicas and not problems:
            problems.append(replicas[0].describe())

    return ParityResult(
        passed=not problems,
        max_abs_diff=max([out_diff, *grad_diffs.values()]),
        out_diff=out_diff,
        grad_diffs=grad_diffs,
        comms_fwd=comms["forward"],
        comms_bwd=comms["backward"],
        problems=problems,
        notes=[dropout_note] if dropout_note else [],
        first_difference=first,
        rule=rule,
        rule_relation=relation,
        replicas=replicas,
        claimed=claimed,
        call_order=list(dict.fromkeys(name for name, _ in want_records)),
    )


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


def _locate_difference(plan, model, reference, got_records, want_records, rtol, atol):
    """(the first differing tensor, the rule to blame, how that rule relates to it), in a failed check."""
    from .first_difference import Difference, first_output_difference, owning_rule

    first = first_output_difference(got_records, want_records, _rank_values, lambda want: allowed_diff(want, rtol, atol))
    if first is None:  # the forward agrees where comparable: the first parameter whose gradient differs
        params = dict(model.named_parameters())
        for name, ref_param in reference.named_parameters():
            grad = params[name].grad
            if ref_param.grad is None or grad is None:
                continue
            limit = allowed_diff(ref_param.grad, rtol, atol)
            values = _rank_values(grad)
            bad = [(r, max_abs_diff(v, ref_param.grad)) for r, v in enumerate(values) if v.shape == ref_param.grad.shape]
            bad = [(r, d) for r, d in bad if not d <= limit]
            if bad:
                first = Difference(f"the gradient of '{name}'", name.rpartition(".")[0], bad[0][0], bad[0][1], limit)
                break
    if first is None or not hasattr(plan, "match"):
        return first, None, None
    call_order = list(dict.fromkeys(name for name, _ in want_records))
    rule, relation = owning_rule(plan.match(model), first.module, call_order)
    return first, rule, relation
