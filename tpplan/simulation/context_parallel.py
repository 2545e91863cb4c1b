"""A plan's context parallelism simulated as the GPU runs it: one rank (rank 0) of the
world, on fake tensors under the fake process group, with `Plan.apply` (the TP rules,
context parallelism, activation checkpointing, FSDP2 over dp_shard·cp) and CUDA's ring
attention (`device_rules.context_parallel_rules`: torch's ring, the CPU kernel's
shapes). What the ring shards and sends is torch's own code running on shapes, so the
shapes and collectives are those of a CUDA rank (fake collectives move no data; the
values are meaningless, the counts and sizes exact).

    sim = simulate_context_parallel(plan, factory, world=2, batch=2, seq=8192)
    sim.tokens          # (2, 4096): this rank's part of the batch's sequence
    sim.ring            # {"forward": {"all_gather": {"count": 2, "bytes": ...}}, "backward": {...}}
    sim.comms           # every collective of the step (TP, the ring, FSDP2), the same form
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .comm_axes import collective_bytes, counting, per_op
from .device_rules import context_parallel_rules
from .simulate import fake_tensors, scalar_loss, simulated_world

Comms = dict[str, dict[str, dict[str, int]]]  # {phase: {op: {"count": n, "bytes": b}}}


@dataclass(frozen=True)
class CPSimulation:
    world: int
    mesh: dict[str, int]  # {dim: size}
    tokens: tuple[int, ...]  # this rank's input: (batch, seq / cp)
    buffers: dict[str, tuple[int, ...]]  # each `context_parallel.buffers` entry as this rank holds it
    attention: tuple[tuple[int, ...], ...]  # the local q shape of each ring attention call, in order (forward)
    ring: Comms  # the ring attention's collectives alone
    comms: Comms  # every collective of the step


def simulate_context_parallel(plan: Any, factory: Callable[[], torch.nn.Module], world: int, batch: int, seq: int,
                              tp: int | None = None) -> CPSimulation:
    """One forward and backward (of `scalar_loss`) of rank 0 of `world` ranks with the
    plan applied, on (batch, seq) random tokens cut on the sequence (`shard_sequence`)."""
    from ..sharding.context_parallel import shard_sequence
    from .fsdp import fake_friendly_meshes

    with simulated_world(world), context_parallel_rules():
        mesh = plan.build_mesh(world, "cpu", tp)  # outside fake mode: the mesh needs real rank lists
        with fake_tensors(), fake_friendly_meshes():
            model = factory()
            plan.apply(model, mesh)
            tokens = shard_sequence(plan, mesh, [torch.randint(0, 2, (batch, seq))], [1])[0]
            phases = ("forward", "backward")
            ring = {phase: (Counter(), Counter()) for phase in phases}
            counts = {phase: (Counter(), Counter()) for phase in phases}
            attention: list[tuple[int, ...]] = []
            now = ["forward"]  # the phase the ring's collectives are filed under
            with _ring_recorded(ring, now, attention):
                with counting(*counts["forward"]):
                    output = model(tokens)
                now[0] = "backward"
                with counting(*counts["backward"]):
                    scalar_loss(output).backward()
        buffers = {name: tuple(model.get_buffer(name).shape) for name in plan.spec.context_parallel.buffers}
    return CPSimulation(world, dict(zip(mesh.mesh_dim_names, mesh.shape)), tuple(tokens.shape), buffers, tuple(attention),
                        _as_comms(ring), _as_comms(counts))


@contextlib.contextmanager
def _ring_recorded(into: dict[str, tuple[Counter, Counter]], now: list[str], attention: list[tuple[int, ...]]) -> Iterator[None]:
    """Record the collectives issued inside the ring (the DTensor handler of the CPU
    attention kernels, `device_rules`), and the local q shape of each forward call."""
    from torch.distributed.tensor import DTensor

    from .device_rules import RING_OPS
    from .simulate import collective_counter

    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers

    def recorded(handler, forward: bool):
        def run(op_call, args, kwargs):
            if forward:
                attention.append(tuple(args[0]._local_tensor.shape))
            counts, sizes = into[now[0]]

            def record(name, op_args, out):  # keyed as `counting` keys them: the ring runs over cp
                counts["cp", name] += 1
                sizes["cp", name] += collective_bytes(op_args, out)

            with collective_counter(record):
                return handler(op_call, args, kwargs)
        return run

    dispatcher._custom_op_handlers = {**handlers, **{op: recorded(handlers[op], forward) for op, forward in RING_OPS.items()}}
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = handlers


def _as_comms(found: dict[str, tuple[Counter, Counter]]) -> Comms:
    """{phase: {op: {"count", "bytes"}}}, summed over the axes the counters key by."""
    summed = {phase: (per_op(counts), per_op(sizes)) for phase, (counts, sizes) in found.items()}
    return {phase: {op: {"count": n, "bytes": sizes[op]} for op, n in counts.items()} for phase, (counts, sizes) in summed.items()}
