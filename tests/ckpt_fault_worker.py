"""A torchrun job whose ranks train examples/train.py's model and save a training
checkpoint after every step, while one rank (the victim, drawn from --seed) kills
itself with SIGKILL at a drawn point of a drawn save: the k-th file-system or
collective event of that save (a tensor item written, an fsync, a rename, an unlink, the
exchange, a removal, a barrier, a broadcast), k drawn from the events of the
first save. Before each save, rank 0 writes the full (unsharded) model and
optimizer state of that step to --truth/step-N.pt: what a load must give back.

    torchrun --nproc-per-node 2 tests/ckpt_fault_worker.py ROOT --truth T --seed 3 --tp 2
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train  # noqa: E402  (the example trainer's model, mesh and data)

import tpplan  # noqa: E402
from tpplan.checkpoint.training import atomic  # noqa: E402


class Killer:
    """Counts the events of the saves on this rank; SIGKILLs itself at event `at` of
    save `save`, counting every event or (`commit_only`) all but the tensor writes."""

    def __init__(self, commit_only: bool):
        self.commit_only = commit_only
        self.save = self.at = None
        self.current, self.count, self.first = 0, 0, 0

    def wrap(self, owner, name: str):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.current and not (self.commit_only and name == "_write_item"):
                self.count += 1
                if self.current == self.save and self.count == self.at:
                    print(f"victim rank {dist.get_rank()}: SIGKILL at event {self.at} ({name}) of save {self.save}", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def install(self) -> None:
        for owner, name in [(filesystem, "_write_item"), (os, "fsync"), (os, "rename"), (os, "replace"), (os, "unlink"), (shutil, "rmtree"),
                            (atomic, "_exchange"), (dist, "barrier"), (dist, "broadcast"), (dist, "broadcast_object_list")]:
            self.wrap(owner, name)


def truth(model, optimizer, step: int, directory: str) -> None:
    """Rank 0 writes the full state of this step (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options), "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    if dist.get_rank() == 0:
        tmp = os.path.join(directory, f".step-{step}.pt")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(directory, f"step-{step}.pt"))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--truth", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--plan", default="plans/llama_tp.yaml")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--no-kill", action="store_true", help="count the events of each save, kill nobody")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rng = random.Random(args.seed)
    victim = rng.randrange(dist.get_world_size())
    kill_save = rng.randint(2, args.saves)  # at least one complete checkpoint before
    fraction = rng.random()
    killer = Killer(commit_only=rng.random() < 0.5)  # half the trials: a point outside the tensor writes
    if dist.get_rank() == victim and not args.no_kill:
        killer.install()

    plan = tpplan.load_plan(args.plan)
    model = train.build("tpplan.models.llama:tiny", torch.device("cpu"))
    mesh, model = train.parallelize(model, plan, args.tp, torch.device("cpu"))
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    data = train.Batches(model.tok_embeddings.num_embeddings, 4, 16)
    for step in range(1, args.saves + 1):
        tokens, targets = (t[dp_rank::dp] for t in next(data))
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        truth(model, optimizer, step, args.truth)
        if step == kill_save:
            killer.save, killer.at = step, max(1, round(fraction * killer.first))
        killer.current, killer.count = step, 0
        tpplan.save_checkpoint(model, args.root, step=step, keep=args.keep, optimizer=optimizer, extra={"step": step, "data": data.generator.get_state()})
        if step == 1:
            killer.first = killer.count
        killer.current = 0
    if dist.get_rank() == victim:
        print(f"no kill: {killer.first} events in the first save of rank {victim}", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13 gloo may abort during interpreter shutdown after DTensor collectives


if __name__ == "__main__":
    main()
