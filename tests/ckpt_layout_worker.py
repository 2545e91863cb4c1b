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

A plan with a pipeline runs its stages (`plan.pipeline_stages`) with torch's
`PipelineStage` and the plan's schedule; the stages are what is saved and loaded, and
their states (each pp rank holding its own keys) are gathered into one to compare.
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

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from tpplan import load_checkpoint, load_plan, save_checkpoint
from tpplan.checkpoint.stages import as_one
from tpplan.simulation.modelref import load_callable
from worker_common import finish


def batches(model) -> list[torch.Tensor]:
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else model.tok_embeddings.num_embeddings
    return [torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


class Job:
    """A model laid out by a plan on the ranks, and its AdamW: the model itself, or this
    rank's pipeline stages run by the plan's schedule."""

    def __init__(self, factory, plan, seed: int):
        torch.manual_seed(seed)
        model = factory()
        mesh = plan.build_mesh(dist.get_world_size())
        self.schedule = None
        if plan.pipeline is None:
            self.parts = [plan.apply(model, mesh)]
        else:
            self.parts = plan.pipeline_stages(model, mesh)
            pipe, pp = plan.spec.pipeline, mesh["pp"]
            self.ids = plan.stage_ids(mesh)
            count = pp.size() * pipe.virtual_stages
            stages = [PipelineStage(part, i, count, torch.device("cpu"), group=pp.get_group()) for part, i in zip(self.parts, self.ids)]
            schedule = get_schedule_class(pipe.schedule)
            self.schedule = schedule(stages if len(stages) > 1 else stages[0], n_microbatches=pipe.microbatches, loss_fn=cross_entropy)
            self.first, self.last = 0 in self.ids, count - 1 in self.ids
        self.one = as_one(self.parts)  # the stages' tensors under one module, for torch's state dicts
        self.optimizer = torch.optim.AdamW([p for part in self.parts for p in part.parameters()], lr=0.02)

    def step(self, batch: torch.Tensor) -> float:
        """One AdamW step on the whole batch (every rank the same: the data-parallel
        gradients are averaged over equal batches, so each layout computes the same step)."""
        inputs, target = batch[:, :-1], batch[:, 1:]
        if self.schedule is None:
            loss = cross_entropy(self.parts[0](inputs), target)
            loss.backward()
        else:
            losses: list = []
            self.schedule.step(*((inputs,) if self.first else ()), **({"target": target, "losses": losses} if self.last else {}))
            loss = torch.stack(losses).mean() if losses else None
        self.optimizer.step()
        self.optimizer.zero_grad()
        return next(v for v in gathered(None if loss is None else loss.item()) if v is not None)

    def state(self) -> dict:
        """Every rank's tensors, full, as one state: the pp ranks' keys merged."""
        optim = get_optimizer_state_dict(self.one, self.optimizer)
        mine = {**full(get_model_state_dict(self.one), "model."), **full(optim["state"], "optimizer.")}
        return {key: value for state in gathered(mine) for key, value in state.items()}


def cross_entropy(logits, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)  # transformers' output
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def full(value, prefix: str = "") -> dict:
    """{dotted key: the full tensor (a DTensor gathered) or plain value} of a nested state."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in full(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in full(item, f"{prefix}{i}.").items()}
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return {prefix[:-1]: value.detach().clone() if isinstance(value, torch.Tensor) else value}


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
    job = Job(factory, plan, 0)
    BATCHES = batches(factory())
    losses = [job.step(BATCHES[i]) for i in range(2)]
    save_checkpoint(job.parts, Path(root) / "ckpt", optimizer=job.optimizer, plan=plan)
    saved = job.state()
    loss = job.step(BATCHES[2])
    stepped = job.state()
    results = {}
    for target in targets:
        job = Job(factory, load_plan(target), 99)
        info = load_checkpoint(job.parts, Path(root) / "ckpt", optimizer=job.optimizer)
        loaded = job.state()
        held = sum(_local(t).numel() * t.element_size() for t in job.one.state_dict().values())
        reads = gathered((info.read_bytes, held))
        again = job.step(BATCHES[2])
        results[Path(target).stem] = {
            "loaded": largest_difference(saved, loaded),
            "differing": sorted(k for k in saved if k in loaded and largest_difference({k: saved[k]}, {k: loaded[k]}) > 0)[:8],
            "stepped": largest_difference(stepped, job.state()),
            "loss": abs(again - loss),
            "keys": len(loaded),
            "steps": sorted({int(v) for k, v in loaded.items() if k.endswith(".step")}),
            "layout": info.layout,
            "placements": {name: str(p.placements) for name, p in job.one.named_parameters()  # a first projection's, the experts'
                           if isinstance(p, DTensor) and name.endswith(("attention.wq.weight", "q_proj.weight", "experts.gate_up_proj"))
                           and ".0." in name},
            "reads": reads,  # per rank: (the bytes the load says it read, the bytes of its local shards)
        }
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "keys": len(saved), "targets": results}), flush=True)
    finish()


if __name__ == "__main__":
    main()
