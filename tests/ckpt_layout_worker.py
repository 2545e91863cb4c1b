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

    torchrun --nproc-per-node 4 tests/ckpt_layout_worker.py [--model MOD:FN] ROOT SOURCE TARGET...

`--model` (default tpplan.models.llama:tiny): another model, e.g. transformers' Qwen3-MoE
saved with its experts over ep and loaded with them sharded over tp.
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
from tpplan.simulation.modelref import load_callable
from worker_common import finish


def batches(model) -> list[torch.Tensor]:
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else model.tok_embeddings.num_embeddings
    return [torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


def laid_out(factory, plan, seed: int):
    """The model of seed `seed` under `plan` on the 4 ranks, and its AdamW."""
    torch.manual_seed(seed)
    model = factory()
    plan.apply(model, plan.build_mesh(dist.get_world_size()))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def step(model, optimizer, batch: torch.Tensor) -> float:
    """One AdamW step on the whole batch (every rank the same: the data-parallel
    gradients are averaged over equal batches, so each layout computes the same step)."""
    logits = model(batch[:, :-1])
    logits = getattr(logits, "logits", logits)  # transformers' output
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
    args, model_ref = sys.argv[1:], "tpplan.models.llama:tiny"
    if args[0] == "--model":
        model_ref, args = args[1], args[2:]
    root, source, *targets = args
    factory = load_callable(model_ref, "--model")
    dist.init_process_group("gloo")
    plan = load_plan(source)
    model, optimizer = laid_out(factory, plan, 0)
    BATCHES = batches(model)
    losses = [step(model, optimizer, BATCHES[i]) for i in range(2)]
    save_checkpoint(model, Path(root) / "ckpt", optimizer=optimizer, plan=plan)
    saved = state(model, optimizer)
    loss = step(model, optimizer, BATCHES[2])
    stepped = state(model, optimizer)
    results = {}
    for target in targets:
        model, optimizer = laid_out(factory, load_plan(target), 99)
        info = load_checkpoint(model, Path(root) / "ckpt", optimizer=optimizer)
        loaded = state(model, optimizer)
        held = sum(_local(t).numel() * t.element_size() for t in model.state_dict().values())
        reads = [None] * dist.get_world_size()
        dist.all_gather_object(reads, (info.read_bytes, held))
        again = step(model, optimizer, BATCHES[2])
        results[Path(target).stem] = {
            "loaded": largest_difference(saved, loaded),
            "differing": sorted(k for k in saved if k in loaded and largest_difference({k: saved[k]}, {k: loaded[k]}) > 0)[:8],
            "stepped": largest_difference(stepped, state(model, optimizer)),
            "loss": abs(again - loss),
            "keys": len(loaded),
            "steps": sorted({int(v) for k, v in loaded.items() if k.endswith(".step")}),
            "layout": info.layout,
            "placements": {name: str(p.placements) for name, p in model.named_parameters()  # a first projection's, the experts'
                           if isinstance(p, DTensor) and name.endswith(("attention.wq.weight", "q_proj.weight", "experts.gate_up_proj"))
                           and ".0." in name},
            "reads": reads,  # per rank: (the bytes the load says it read, the bytes of its local shards)
        }
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "keys": len(saved), "targets": results}), flush=True)
    finish()


if __name__ == "__main__":
    main()
