"""A torchrun job (4 gloo ranks) that saves a tiny Llama under one layout and loads it
under others (tests/test_checkpoint_layouts.py): version 2 plans from PLANS (a
directory of `NAME.yaml`), the first one the layout it is saved under.

Under the first plan: 2 AdamW steps, `save_checkpoint(..., optimizer=, plan=)` into
ROOT/ckpt, then a third step (the reference). Under each other plan: a fresh model of
other random values and a fresh AdamW, `load_checkpoint(..., optimizer=)`, then the
same third step. Every comparison is of full tensors (DTensors gathered), key by key:
the model's parameters and AdamW's exp_avg, exp_avg_sq and step. Rank 0 prints one
JSON line: per target plan the largest |difference| after the load and after the
step, the loss difference of the step, the keys compared, the layout the load
reports, the loaded parameters' placements, and per rank the bytes the load read
and the bytes of its local shards.

    torchrun --nproc-per-node 4 tests/ckpt_layout_worker.py ROOT SOURCE TARGET...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from tpplan import load_checkpoint, load_plan, save_checkpoint
from tpplan.models.llama import tiny
from worker_common import finish

BATCHES = [torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


def laid_out(plan, seed: int):
    """A tiny Llama of seed `seed` under `plan` on the 4 ranks, and its AdamW."""
    torch.manual_seed(seed)
    model = tiny()
    plan.apply(model, plan.build_mesh(dist.get_world_size()))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def step(model, optimizer, batch: torch.Tensor) -> float:
    """One AdamW step on the whole batch (every rank the same: the data-parallel
    gradients are averaged over equal batches, so each layout computes the same step)."""
    logits = model(batch[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def full(value, prefix: str = "") -> dict:
    """{dotted key: the full tensor (a DTensor gathered) or plain value} of a nested state."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in full(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in full(item, f"{prefix}{i}.").items()}
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return {prefix[:-1]: value.detach().clone() if isinstance(value, torch.Tensor) else value}


def state(model, optimizer) -> dict:
    optim = get_optimizer_state_dict(model, optimizer)
    return {**full(get_model_state_dict(model), "model."), **full(optim["state"], "optimizer.")}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def largest_difference(a: dict, b: dict) -> float:
    """The largest |a - b| over every tensor; infinity where keys, shapes or plain values differ."""
    if set(a) != set(b):
        return float("inf")
    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if not isinstance(x, torch.Tensor):
            if x != y:
                return float("inf")
            continue
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst


def main() -> None:
    root, source, *targets = sys.argv[1:]
    dist.init_process_group("gloo")
    plan = load_plan(source)
    model, optimizer = laid_out(plan, 0)
    losses = [step(model, optimizer, BATCHES[i]) for i in range(2)]
    save_checkpoint(model, Path(root) / "ckpt", optimizer=optimizer, plan=plan)
    saved = state(model, optimizer)
    loss = step(model, optimizer, BATCHES[2])
    stepped = state(model, optimizer)
    results = {}
    for target in targets:
        model, optimizer = laid_out(load_plan(target), 99)
        info = load_checkpoint(model, Path(root) / "ckpt", optimizer=optimizer)
        loaded = state(model, optimizer)
        held = sum(_local(t).numel() * t.element_size() for t in model.state_dict().values())
        reads = [None] * dist.get_world_size()
        dist.all_gather_object(reads, (info.read_bytes, held))
        again = step(model, optimizer, BATCHES[2])
        results[Path(target).stem] = {
            "loaded": largest_difference(saved, loaded),
            "stepped": largest_difference(stepped, state(model, optimizer)),
            "loss": abs(again - loss),
            "keys": len(loaded),
            "steps": sorted({int(v) for k, v in loaded.items() if k.endswith(".step")}),
            "layout": info.layout,
            "placements": str(model.layers[0].attention.wq.weight.placements),
            "reads": reads,  # per rank: (the bytes the load says it read, the bytes of its local shards)
        }
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "keys": len(saved), "targets": results}), flush=True)
    finish()


if __name__ == "__main__":
    main()
