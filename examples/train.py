"""A short trainer to copy: torchrun, a tpplan plan on the tp dim, FSDP2 on the
dp dim, AdamW, and torch's loss_parallel() when the plan asks for it.

    # 4 ranks: a (dp 2, tp 2) mesh; each dp rank trains on its half of the batch
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 20

    # the same steps on one device, without torchrun: the loss curve to compare with
    python examples/train.py --plan plans/llama_tp_sp.yaml --steps 20

Every rank builds the model from the same seed, `load_plan(...).apply` shards
it over the tp dim, `fully_shard` (per block, then the root) shards it again
over dp. The data is a fixed random token stream: step N's global batch is the
same on every run, and dp rank r trains on rows r::dp of it, so the mean loss
over dp ranks equals the one-device loss of the whole batch.
(Checkpoint save/resume is not in this example yet: tpplan's checkpoint API
has not landed.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import tpplan


def build(ref: str, device: torch.device) -> torch.nn.Module:
    module, _, fn = ref.partition(":")
    torch.manual_seed(0)  # the same weights on every rank, and in the one-device run
    with torch.device(device):
        return getattr(importlib.import_module(module), fn)()


def batches(vocab: int, batch: int, seq: int):
    """(tokens, next tokens) of a fixed random stream: the same on every rank and run."""
    generator = torch.Generator().manual_seed(1)
    while True:
        stream = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        yield stream[:, :-1], stream[:, 1:]


def parallelize(model: torch.nn.Module, plan: tpplan.Plan, tp: int, device: torch.device):
    """The (dp, tp) mesh; the plan on tp, FSDP2 on dp. Returns the mesh."""
    world = dist.get_world_size()
    if world % tp:
        raise SystemExit(f"--tp ({tp}) must divide the world size ({world})")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", plan.mesh_axis))
    plan.apply(model, mesh)
    if mesh["dp"].size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", default="tpplan.models.llama:tiny", help="MOD:FN returning the model")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over dp ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # under torchrun; else one device, no plan
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    plan = tpplan.load_plan(args.plan)
    model = build(args.model, device)
    vocab = model.tok_embeddings.num_embeddings
    dp, dp_rank, use_loss_parallel = 1, 0, False
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = parallelize(model, plan, args.tp, device)
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        use_loss_parallel = plan.loss_parallel  # the head keeps the logits sharded on the vocabulary
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    data = batches(vocab, args.batch, args.seq)
    for step in range(1, args.steps + 1):
        tokens, targets = (t[dp_rank::dp].to(device) for t in next(data))
        with loss_parallel() if use_loss_parallel else contextlib.nullcontext():
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()  # inside loss_parallel() too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if distributed and dp > 1:  # the mean over dp ranks: the loss of the whole batch
            dist.all_reduce(value, group=mesh["dp"].get_group())
            value /= dp
        if not distributed or dist.get_rank() == 0:
            print(f"step {step} loss {value.item():.6f}", flush=True)

    if distributed:
        dist.destroy_process_group()
        os._exit(0)  # torch 2.13 gloo may abort during interpreter shutdown after DTensor collectives


if __name__ == "__main__":
    main()
