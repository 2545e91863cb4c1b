"""Context parallelism from a version 2 plan's `context_parallel` section (SPEC §7),
applied after the TP rules and before activation checkpointing and FSDP2, in
torchtitan's order, over the mesh's `cp` dim.

torch's own context parallelism (torch.distributed.tensor.experimental, 2.13), by
the plan:

- `modules`: while a module the globs match runs, each
  `F.scaled_dot_product_attention` call inside it (its own or a submodule's: the
  call TP128 looks for) takes its q/k/v as this rank's shard of the sequence: torch's
  `_ContextParallel` style's SDPA input and output functions make them DTensors
  sharded on the sequence (dim 2) of the cp mesh and the output local again, and
  DTensor's context-parallel dispatcher (`_enable_context_parallel_dispatcher`) runs
  torch's ring attention on them, forward and backward. torch's style hooks a module
  whose forward *is* SDPA(q, k, v) (torchtitan's `inner_attention`); a plan names
  attention blocks (`layers.*.attention`, whose forward takes hidden states), so the
  style's functions are applied at the SDPA call, scoped to the module's forward.
- `rotate`: torch's `set_rotate_method` (all-gather the KV shards once, or pass them
  round the ring with all-to-all).
- `load_balance: headtail`: torch's `_HeadTailLoadBalancer` (rank r holds chunks r and
  2·cp−1−r of 2·cp, so causal work is even) and its ring schedule
  (`_cp_options.enable_load_balance`); `none`: contiguous chunks.
- `buffers` ({name: seq dim}): each named model buffer is replaced by this rank's
  shard (torch's `_context_parallel_shard`, with the same rearrangement), once, at
  apply. torch's `context_parallel` context manager resizes them in place instead,
  so they cannot require grad.
- each batch: the caller shards its inputs and labels with `shard_sequence` (the same
  rearrangement) and gathers outputs back with `unshard_sequence`.

torch 2.13 runs it on CUDA only: the sequence rules and the ring exist for SDPA's
flash, efficient and cuDNN CUDA kernels. A mesh on another device is refused before
anything is applied (TP131), except inside `simulation.device_rules.context_parallel_rules()`,
where the CPU kernel runs in torch's ring (the dry run and the numerics tests).
torch's options are process-wide (one rotate method, one load-balance flag): one
plan's context parallelism per process.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from ..core.problems import PlanError, Problem, error
from ..core.sections import claim_section

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

CP_DIM = "cp"
SEQ_DIM = 2  # the sequence dim of q/k/v (batch, heads, seq, head_dim) that context parallelism shards

_simulated_on_cpu = False


@contextlib.contextmanager
def simulated_on_cpu() -> Iterator[None]:
    """Inside the body a CPU mesh is not refused (TP131): CPU attention runs context
    parallelism's ring there (`simulation.device_rules.context_parallel_rules` enters it)."""
    global _simulated_on_cpu
    was, _simulated_on_cpu = _simulated_on_cpu, True
    try:
        yield
    finally:
        _simulated_on_cpu = was


def section(plan: Any) -> Any:
    """The plan's `context_parallel` section where it splits anything (cp above 1), else None."""
    if plan.version != 2 or plan.spec.context_parallel is None or plan.mesh.sizes["cp"] == 1:
        return None
    return plan.spec.context_parallel


def refuse_device(plan: Any, device_type: str) -> None:
    """TP131 where the plan asks for context parallelism on a device torch 2.13 cannot
    run it on (anything but CUDA), unless the CPU simulates CUDA's ring here."""
    if section(plan) is None or device_type == "cuda" or _simulated_on_cpu:
        return
    raise PlanError([error("TP131", (
        f"context_parallel: context parallelism needs CUDA in torch 2.13, and this mesh is on {device_type}: torch's "
        "ring attention shards the sequence through SDPA's flash, efficient and cuDNN CUDA kernels only (the CPU "
        "kernel _scaled_dot_product_flash_attention_for_cpu has no context-parallel rule); run it on CUDA GPUs "
        "(Plan.apply on a cuda mesh), simulate it here with `tpplan apply --dry-run`, or set mesh.cp to 1 and remove "
        "this section to run the other axes here"),
        plan.file, *plan.source.locate(("context_parallel",), key=True))])


def cp_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    names = mesh.mesh_dim_names or ()
    if CP_DIM not in names:
        raise ValueError(f"the plan has context parallelism but the mesh has dims {tuple(names)}: build it with "
                         "plan.build_mesh(world), or name a dim cp")
    return mesh[CP_DIM]


def apply_context_parallel(plan: Any, model: "nn.Module", mesh: "DeviceMesh") -> list[str]:
    """Context parallelism on the modules `context_parallel.modules` matches (a glob
    matching none is TP200, a module two globs match TP201, at the glob); its buffers
    sharded (TP132 at a buffer that cannot be). Returns the modules' fqns, none
    without the section (or at cp 1). TP131 off CUDA (see the module's docstring)."""
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    spec = section(plan)
    if spec is None:
        return []
    cp = cp_mesh(mesh)
    refuse_device(plan, cp.device_type)
    tree, under = plan.module_tree(model)
    claimed, problems = claim_section(plan, tree, under, "context_parallel.modules")
    buffers, found = _buffers(plan, model, cp.size())
    if problems or found:
        raise PlanError(problems + found)
    set_rotate_method(spec.rotate)
    _cp_options.enable_load_balance = spec.load_balance == "headtail"
    _enable_dispatcher()
    for fqn in claimed:
        _shard_attention(model.get_submodule(fqn) if fqn else model, cp)
    for (owner, leaf), dim in buffers.items():
        owner._buffers[leaf] = shard_sequence(plan, mesh, [owner._buffers[leaf]], [dim])[0]
    return list(claimed)


def _enable_dispatcher() -> None:
    """torch's `_enable_context_parallel_dispatcher` (its DTensor handlers of the CUDA
    attention kernels, and their sequence rules), added to the handlers DTensor has now:
    torch's own resets the table to the one it saw when it was imported, which would
    drop any handler registered since (the simulation's, device_rules)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import register_cp_sharding_rules

    dispatcher = DTensor._op_dispatcher
    dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, **custom_ops}
    register_cp_sharding_rules()


def shard_sequence(plan: Any, mesh: "DeviceMesh", tensors: list["torch.Tensor"], seq_dims: list[int]) -> list["torch.Tensor"]:
    """This rank's shards of `tensors` (a batch's inputs, labels, a positional table)
    on their sequence dims, rearranged as the plan's load balance and the ring
    expect (torch's `_context_parallel_shard`). Every tensor has the same sequence
    length there (the first's is used); ValueError where 2·cp (headtail) or cp does
    not divide it."""
    from torch.distributed.tensor.experimental._context_parallel import _context_parallel_shard

    cp = cp_mesh(mesh)
    seq = tensors[0].shape[seq_dims[0]]
    return _context_parallel_shard(cp, list(tensors), list(seq_dims), _balancer(section(plan), seq, cp))


def unshard_sequence(plan: Any, mesh: "DeviceMesh", tensors: list["torch.Tensor"], seq_dims: list[int]) -> list["torch.Tensor"]:
    """The whole sequence back from every rank's shards (an output, a gradient),
    in the original order (torch's `context_parallel_unshard`); dim 0 is the batch."""
    from torch.distributed.tensor.experimental._context_parallel import context_parallel_unshard

    cp = cp_mesh(mesh)
    seq = tensors[0].shape[seq_dims[0]] * cp.size()
    return context_parallel_unshard(cp, list(tensors), list(seq_dims), _balancer(section(plan), seq, cp))


def _balancer(spec: Any, seq: int, cp: "DeviceMesh"):
    """torch's head-tail load balancer for `seq` tokens over the cp ranks, or None."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    headtail = spec is not None and spec.load_balance == "headtail"
    chunks = 2 * cp.size() if headtail else cp.size()
    if seq % chunks:
        raise ValueError(f"a sequence of {seq} tokens does not split into {chunks} equal chunks over cp {cp.size()}"
                         + (" (load_balance: headtail gives each rank a head and a tail chunk)" if headtail else ""))
    return _HeadTailLoadBalancer(seq, cp.size(), cp.device_type) if headtail else None


def _buffers(plan: Any, model: "nn.Module", cp: int) -> tuple[dict[tuple[Any, str], int], list[Problem]]:
    """{(owning module, buffer name): seq dim} of `context_parallel.buffers`, and TP132 at
    each name that is no buffer of the model, a dim it does not have, or a length the
    cp ranks cannot split (or that is not `training.seq`: the buffer must hold the
    whole sequence, as the batch does, to be cut the same way)."""
    spec, found, problems = plan.spec.context_parallel, {}, []
    chunks = 2 * cp if spec.load_balance == "headtail" else cp
    seq = plan.spec.training.seq if plan.spec.training is not None else None
    for name, dim in spec.buffers.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = _submodule(model, owner_name)
        buffer = owner._buffers.get(leaf) if owner is not None else None
        why = None
        if buffer is None:
            known = [n for n, _ in itertools.islice(model.named_buffers(), 6)]
            why = f"names no buffer of the model ({'its buffers: ' + ', '.join(known) if known else 'it has none'})"
        elif dim >= buffer.ndim:
            why = f"has {buffer.ndim} dims {tuple(buffer.shape)}, so no dim {dim}"
        elif buffer.shape[dim] % chunks:
            why = (f"holds {buffer.shape[dim]} positions on dim {dim}, not a multiple of {chunks}"
                   f" ({'2·cp: headtail gives each rank a head and a tail chunk' if chunks != cp else 'cp'})")
        elif seq is not None and buffer.shape[dim] != seq:
            why = (f"holds {buffer.shape[dim]} positions on dim {dim}, not training.seq = {seq}: it is cut as the "
                   "sequence is, so it must hold the whole sequence")
        if why is None:
            found[(owner, leaf)] = dim
        else:
            problems.append(error("TP132", f"context_parallel.buffers: '{name}' {why}", plan.file,
                                  *plan.source.locate(("context_parallel", "buffers", name), key=True)))
    return found, problems


def _submodule(model: "nn.Module", fqn: str) -> "nn.Module | None":
    try:
        return model.get_submodule(fqn) if fqn else model
    except AttributeError:
        return None


def _shard_attention(module: "nn.Module", cp: "DeviceMesh") -> None:
    """While `module` runs, its SDPA calls take this rank's sequence shard (torch's
    style functions at the call, see the module's docstring); the mode is popped even
    when the forward raises."""
    running: list[Any] = []

    def enter(_module, _args):
        mode = _SequenceShardedAttention(cp)
        mode.__enter__()
        running.append(mode)

    def leave(_module, _args, _output):
        running.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


class _SequenceShardedAttention(TorchFunctionMode):
    """F.scaled_dot_product_attention through torch's `_ContextParallel` SDPA input and
    output functions: q/k/v (every tensor argument) become DTensors sharded on the
    sequence of the cp mesh, and the output comes back local."""

    def __init__(self, mesh: "DeviceMesh"):
        from torch.distributed.tensor.experimental._attention import _ContextParallel

        super().__init__()
        self.mesh = mesh
        self.style = _ContextParallel(seq_dim=SEQ_DIM, attention_type=_ContextParallel.AttentionType.SDPA)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch._C._nn.scaled_dot_product_attention:  # F.scaled_dot_product_attention itself
            return func(*args, **kwargs)
        args, kwargs = self.style.sdpa_input_fn(None, args, kwargs, self.mesh)
        return self.style.sdpa_output_fn(None, None, func(*args, **kwargs), self.mesh)
