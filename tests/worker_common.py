"""What the torchrun workers of the expert tests share (a2a_worker, ep_all_reduce_worker,
grouped_experts_worker): each parameter gradient against the whole module's, the
collectives a CommDebugMode saw, and the exit after DTensor collectives."""

import os
import sys

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpplan.simulation.simulate import collective_name


def grad_diffs(sharded, reference) -> dict[str, float]:
    """{"NAME grad": max |difference|} of every parameter, the sharded one gathered to full size."""
    whole = dict(reference.named_parameters())
    diffs = {}
    for name, p in sharded.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[f"{name} grad"] = (full - whole[name].grad).abs().max().item()
    return diffs


def collectives(mode) -> dict[str, int]:
    """{collective: count} of a CommDebugMode, by the report's names."""
    return {collective_name(op): n for op, n in mode.get_comm_counts().items() if n}


def finish() -> None:
    """Leave the process group and exit at once: gloo workers may abort at interpreter
    exit after DTensor collectives."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
