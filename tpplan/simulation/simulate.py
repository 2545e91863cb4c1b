"""Simulate a tensor-parallel world of any size in one process.

Two levels, both on CPU and without `torchrun`:

- shapes and communication: `simulated_world(n)` starts torch's fake process
  group (collectives are no-ops), so a model on the meta device or under
  `FakeTensorMode` (`fake_tensors`, what the dry run uses) can be parallelized
  at any degree and its collectives counted with `count_collectives`;
- real values: `verify.check_parity` adds torch's `LocalTensorMode`, which keeps
  one real tensor per simulated rank and performs every collective on them, and
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
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.problems import ModelError
from ..core.quiet import loggers_quiet

# The op spellings torch uses (functional, c10d, DTensor's own), keyed by their
# name without underscores, mapped to the names of SPEC section 4.
_COLLECTIVE_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
}

# Not collectives: point-to-point ops, barriers, and the wait on an async result.
_COALESCED = ("allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_", "allreduce_coalesced_")
_NOT_COUNTED = ("isend", "irecv", "send", "recv", "recv_any_source", "batch_p2p_ops", "barrier", "monitored_barrier", "wait_tensor")


# Real values cost real memory: a dry run (`apply --dry-run`, the lint's TP330)
# gives them only to models up to this size.
VALUES_LIMIT_BYTES = 1 << 30


@contextlib.contextmanager
def fake_tensors(mode: Any = None) -> Iterator[Any]:
    """FakeTensorMode that lets in real tensors made elsewhere (a module constant),
    with torch's traceback log of failing fake kernels off: the caller reports the
    failure (or retries with values), so the traceback is noise. Yields the mode;
    pass it back (`mode`) to run a model built in it later (fake tensors of two
    modes do not mix). `aten::_grouped_mm` takes every dtype its real kernels take
    (hf.grouped_mm), not only the bfloat16 of torch's meta function; transformers'
    masks are those of the real run (hf.masks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..hf.grouped_mm import accept_real_dtypes
    from ..hf.masks import real_run_masks

    accept_real_dtypes()  # a float32 MoE's grouped_mm, as on the GPU
    real_run_masks()  # no causal mask the real run skips (modelref.build_model again, for a model built in the mode)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    with loggers_quiet("torch._subclasses.fake_tensor"), mode:
        yield mode


def fake_limit(exc: BaseException) -> bool:
    """Whether `exc` is a limit of fake tensors (an op that reads a value, or one with
    no fake kernel), not a failure of the model: a run with values may pass."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
        UnsupportedOperatorException,
    )

    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException,
                            UnsupportedFakeTensorException, UnsupportedOperatorException))


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[None]:
    """torch's `LocalTensorMode` over `world_size` ranks (one real value per rank), with
    DTensor's sharding-propagation caches emptied on entry and on exit. Those caches
    are keyed by global shapes but hold the local shapes of the rank that filled them:
    after a fake pass (rank 0), an uneven shard would get rank 0's local shape on every
    rank (`view` of 43 features where rank 2 holds 42), a failure torchrun never has."""
    from torch.distributed._local_tensor import LocalTensorMode

    forget_sharding_cache()
    try:
        with LocalTensorMode(world_size):
            yield
    finally:
        forget_sharding_cache()


def forget_sharding_cache() -> None:
    """Empty DTensor's sharding-propagation caches (the Python ones and the C++ fast
    path's copy). They are keyed by spec, and specs compare meshes by their layout, not
    by this rank's coordinate: a world simulated as rank 1 after one as rank 0 would get
    rank 0's cached outputs, on rank 0's mesh."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Run the body with a fake default process group of `world_size` ranks, as `rank`:
    the one fake world of tpplan (dry runs, the lint, init, checkpoint simulation).

    Reentrant for the same size and rank: inside an active simulated world of those
    it changes nothing. The group is destroyed on exit, so worlds of different sizes
    can follow each other in one process. Inside, ops whose CPU form has no DTensor
    rule but whose CUDA form has one get the CUDA rule (`device_rules.cuda_rules`):
    the world simulates the cluster, not the CPU. Every world starts and ends with
    DTensor's sharding caches emptied (`forget_sharding_cache`): a cached output spec
    holds the mesh of the world that filled it, and a later world's mesh of the same
    layout (as rank 1, or rank 0 of a world with other process groups: a dry run plans
    several degrees or ranks in one process) would get it, with groups of a world gone.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"cannot simulate rank {rank} of {world_size}: world_size must be at least 1 and rank in [0, world_size)")
    if dist.is_initialized():
        if dist.get_backend() == "fake" and (dist.get_world_size(), dist.get_rank()) == (world_size, rank):
            yield
            return
        raise RuntimeError(
            f"cannot simulate {world_size} ranks{f' (as rank {rank})' if rank else ''}: a process group ({dist.get_backend()}, "
            f"world size {dist.get_world_size()}) is already initialized; destroy it first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .device_rules import cuda_rules

    forget_sharding_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with cuda_rules():
            yield
    finally:
        dist.destroy_process_group()
        forget_sharding_cache()


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


def collective_counter(on_collective: Callable[[str, tuple, Any], None]) -> TorchDispatchMode:
    """A dispatch mode that calls `on_collective(name, args, result)` for each collective
    reaching torch's dispatcher (the ops torch's fake collectives know, named as SPEC §4
    where they have a name there).

    Not CommDebugMode: its module tracker registers a forward hook each time a module is
    called and pops its stack in each of them, so a module called twice in one forward (a
    shared dropout, a recurrent block) fails with "list index out of range"; and its global
    full backward hooks wrap every module's output in a view that the model's in-place ops
    then fail on. Neither is the model's problem, and counting needs no module tracking."""
    from torch.distributed._tools.fake_collectives import collective_ops
    from torch.distributed.tensor import DTensor

    # and the coalesced c10d ops (FSDP2's) that torch's fake collectives leave out but CommDebugMode counts
    coalesced = [getattr(torch.ops.c10d, op).default for op in _COALESCED]
    names = {op: collective_name(op._overloadpacket) for op in (*collective_ops, *coalesced)}
    names = {op: name for op, name in names.items() if name not in _NOT_COUNTED}

    class CollectiveCounter(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):  # not a collective (DTensor's rng op): run it
                return func(*args, **(kwargs or {}))
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor turn itself into local ops and collectives first
            out = func(*args, **(kwargs or {}))
            name = names.get(func)
            if name is not None:
                on_collective(name, args, out)
            return out

    return CollectiveCounter()


@contextlib.contextmanager
def _counting(into: Counter) -> Iterator[None]:
    with collective_counter(lambda name, args, out: into.update([name])):
        yield


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


class ModelOutputError(ModelError, ValueError):
    """The model's output has nothing to take a loss of."""


def scalar_loss(output: Any) -> torch.Tensor:
    """Mean of squares of every floating output: unlike a plain sum, its gradient
    depends on the output values, so a wrong output also shows in the gradients."""
    tensors = output_tensors(output)
    if not tensors:
        raise ModelOutputError(f"the model output ({type(output).__name__}) holds no floating-point tensor")
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
    """The first module with parameters of its own that takes the inputs: an Embedding or
    a Linear even with children (Inkling's embedding holds its RMSNorm), else a leaf
    (a container's own parameters, a learned position table, are not where inputs go)."""
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        if isinstance(module, (nn.Embedding, nn.Linear)) or next(module.children(), None) is None:
            return name, module
    return None


class NoDefaultInputs(ValueError):
    """The model's first module is no Embedding or Linear: the user must pass --inputs."""


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
    raise NoDefaultInputs(
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
