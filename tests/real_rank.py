"""What the torchrun workers that measure a real rank against the dry run share: the
rank's start (the gloo group, the plan, its mesh, the model built as the dry run
builds it) and its end (every rank's figures printed by rank 0 as one JSON line)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def planned_rank(plan_path: str, model_ref: str) -> tuple[Any, Any, Any]:
    """(the plan, its mesh over this torchrun world, the model) on a gloo rank."""
    import torch
    import torch.distributed as dist

    from tpplan import load_plan
    from tpplan.simulation.modelref import build_model, load_callable

    dist.init_process_group("gloo")
    plan = load_plan(plan_path)
    mesh = plan.build_mesh(dist.get_world_size())
    torch.manual_seed(0)
    return plan, mesh, build_model(model_ref, "cpu", load_callable(model_ref, "--model"))


def print_every_rank(mine: dict) -> None:
    """Rank 0 prints every rank's `mine` as one JSON list; the process ends here."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps(everyone), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo may abort at interpreter exit after DTensor collectives
