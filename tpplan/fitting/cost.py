"""The stated cost model `tpplan fit` ranks layouts by (SPEC §9): an estimate, not a
measurement, every figure of it printed with the ranking (`assumptions`).

- compute: FLOPs / (peak × efficiency), one efficiency for the whole step;
- collectives: the α–β ring model on each mesh axis's group, at the node's link
  (NVLink, Infinity Fabric) when the group lies inside one node, else the network's;
- the step: TP, CP, EP and PP collectives wait on the critical path (added:
  EP's all_to_all carries the tokens to their experts and back, the experts
  wait on it); FSDP's and HSDP's (dp_shard, dp_replicate, and efsdp, the
  experts' FSDP axis) overlap with compute, only what exceeds the compute time
  shows; the pipeline's bubble idles its share of the step.

No torch: the figures come from fit's flops and the dry run's `comms_by_axis`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.axes_spec import DP_AXES, WORLD_AXES

GiB = 1 << 30
# The axes whose collectives FSDP2 (HSDP) prefetches behind compute: the data axes, and
# efsdp, over which FSDP2 shards the experts (the dry run's name for the ranks ep leaves
# of dp_shard·cp·tp: sharding/expert_mesh.py)
HIDDEN_AXES = (*DP_AXES, "efsdp")


@dataclass(frozen=True)
class GPU:
    """One accelerator as the model sees it. Bandwidths are bytes/s per GPU in one
    direction; latencies (α) seconds per message."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: int  # HBM
    intra_bandwidth: float  # inside a node (NVLink, Infinity Fabric)
    inter_bandwidth: float  # across nodes (the GPU's network card)
    intra_latency: float = 5e-6  # α inside a node: a few µs per NCCL step on NVLink
    inter_latency: float = 10e-6  # α across nodes: about twice that over InfiniBand/RoCE
    efficiency: float = 0.4  # the share of peak a training step reaches (MFU)


# Vendors' published figures: dense bf16 (no sparsity), one direction of the links.
GPUS = {
    "h100": GPU("H100 SXM", 989e12, 80 * GiB, 450e9, 50e9),  # NVLink 4: 900 GB/s both ways; 400 Gb/s NIC
    "h200": GPU("H200 SXM", 989e12, 141_000_000_000, 450e9, 50e9),  # H100's compute and links, 141 GB HBM3e
    "a100": GPU("A100 SXM 80GB", 312e12, 80 * GiB, 300e9, 25e9),  # NVLink 3: 600 GB/s both ways; 200 Gb/s NIC
    "mi300x": GPU("MI300X", 1307e12, 192_000_000_000, 448e9, 50e9),  # Infinity Fabric: 7 links x 64 GB/s; 400 Gb/s NIC
}


def gpu_with(preset: str, **overrides: float | int | str) -> GPU:
    """A preset with some figures replaced (`--efficiency 0.5`, a faster network); an
    unknown preset or field is a ValueError naming the known ones."""
    if preset not in GPUS:
        raise ValueError(f"unknown GPU {preset!r}: one of {', '.join(GPUS)}")
    fields = {f.name for f in dataclasses.fields(GPU)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPU figure(s) {', '.join(unknown)}: one of {', '.join(sorted(fields))}")
    return dataclasses.replace(GPUS[preset], **overrides)


def assumptions(gpu: GPU, gpus_per_node: int) -> dict:
    """The model's figures as the report prints them (JSON-able)."""
    return {**dataclasses.asdict(gpu), "gpus_per_node": gpus_per_node,
            "collectives": "ring α–β: all_gather, reduce_scatter, all_to_all (n−1)·α + (n−1)/n·bytes/β per call; "
                           "all_reduce twice that; send/recv α + bytes/β",
            "overlap": "tp, cp, ep, pp collectives exposed; dp_shard, dp_replicate, efsdp (the experts' FSDP) hidden behind "
                       "compute up to its time",
            "bubble": "(compute + exposed comm) × bubble / (1 − bubble)"}


def axis_in_node(axis: str, sizes: dict[str, int], gpus_per_node: int) -> bool:
    """Whether `axis`'s groups each lie inside one node. The mesh is outermost first
    (WORLD_AXES: pp, dp_replicate, dp_shard, cp, tp), ranks numbered node by node, so an
    axis's ranks are spaced by the product of the axes inside it: its group spans
    stride × size consecutive ranks. `ep` borrows its ranks from the innermost
    dp_shard·cp·tp (torch's expert view is (dp_replicate, efsdp, ep), ep innermost):
    stride 1, in one node when ep ≤ gpus_per_node; efsdp is spaced by ep over those
    dp_shard·cp·tp consecutive ranks."""
    if axis == "ep":
        return sizes.get("ep", 1) <= gpus_per_node
    if axis == "efsdp":
        return sizes.get("dp_shard", 1) * sizes.get("cp", 1) * sizes.get("tp", 1) <= gpus_per_node
    if sizes.get(axis, 1) == 1 and axis in WORLD_AXES:
        return True  # a group of one rank talks to no one
    inner = WORLD_AXES[WORLD_AXES.index(axis) + 1:]  # ValueError for a name that is no axis
    stride = 1
    for name in inner:
        stride *= sizes.get(name, 1)
    return stride * sizes.get(axis, 1) <= gpus_per_node


def group_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """The size of each axis's groups: the mesh's, and efsdp = dp_shard·cp·tp / ep."""
    borrowed = sizes.get("dp_shard", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    return {**sizes, "efsdp": borrowed // sizes.get("ep", 1)}


# Ring algorithms on n ranks, for the dry run's bytes (the larger of a call's input and
# output, summed over the calls): (steps per call, share of the bytes on the wire).
_RING = {
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: n - 1, lambda n: (n - 1) / n),  # as all_gather (a pipelined ring)
    "all_to_all": (lambda n: n - 1, lambda n: (n - 1) / n),  # each rank keeps its own 1/n
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),  # reduce_scatter then all_gather
    "send": (lambda n: 1, lambda n: 1.0),  # point to point: one message, every byte
    "recv": (lambda n: 1, lambda n: 1.0),
}


def collective_seconds(op: str, count: int, bytes: int, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of `count` calls of `op` moving `bytes` in all on a group of `n` ranks.
    An op name the dry run should not report is a ValueError (a tpplan bug, not 0 s)."""
    if op not in _RING:
        raise ValueError(f"no cost model for collective {op!r} (known: {', '.join(_RING)}): a tpplan bug")
    if n <= 1 and op not in ("send", "recv"):
        return 0.0  # a group of one moves nothing
    steps, share = _RING[op]
    return count * steps(n) * latency + share(n) * bytes / bandwidth


def comm_seconds(comms_by_axis: dict[str, dict[str, dict[str, dict[str, int]]]], sizes: dict[str, int],
                 gpu: GPU, gpus_per_node: int) -> dict[str, float]:
    """{axis: seconds} of one step's collectives (the dry run's `comms_by_axis`: {axis:
    {forward|backward: {op: {count, bytes}}}}), each on its axis's group at its link. An
    all_to_all is EP's token dispatch (FSDP2 issues none), so it counts as ep's, exposed,
    also where the dry run files it under the mesh dim whose group ep's is (ep = dp_shard
    with tp and cp 1: the dp_shard group)."""
    out, sizes = {}, group_sizes(sizes)
    for axis, passes in comms_by_axis.items():
        inside = axis_in_node(axis, sizes, gpus_per_node)
        bandwidth, latency = (gpu.intra_bandwidth, gpu.intra_latency) if inside else (gpu.inter_bandwidth, gpu.inter_latency)
        out.setdefault(axis, 0.0)
        for ops in passes.values():
            for op, c in ops.items():
                seconds = collective_seconds(op, c["count"], c["bytes"], sizes.get(axis, 1), bandwidth, latency)
                owner = "ep" if op == "all_to_all" and axis in HIDDEN_AXES else axis
                out[owner] = out.get(owner, 0.0) + seconds
    return out


def compute_seconds(flops: float, gpu: GPU) -> float:
    return flops / (gpu.peak_flops * gpu.efficiency)


@dataclass(frozen=True)
class StepTime:
    compute: float
    comm: float  # exposed: what compute does not hide
    bubble: float
    total: float


def step_time(compute: float, comm_by_axis: dict[str, float], bubble: float) -> StepTime:
    """The stated rule (module doc): data-parallel collectives (HIDDEN_AXES) hidden behind
    compute up to its length, the others added; `bubble` the idle share of a pipelined step
    (memory.pipeline_memory's; 0 without a pipeline), so the busy time is 1 − bubble of it."""
    if not 0 <= bubble < 1:
        raise ValueError(f"the bubble is the idle share of the step, in [0, 1), not {bubble}")
    exposed = sum(s for axis, s in comm_by_axis.items() if axis not in HIDDEN_AXES)
    exposed += max(0.0, sum(s for axis, s in comm_by_axis.items() if axis in HIDDEN_AXES) - compute)
    idle = (compute + exposed) * bubble / (1 - bubble)
    return StepTime(compute, exposed, idle, compute + exposed + idle)
