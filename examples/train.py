"""A short trainer to copy: torchrun, a tpplan plan on the tp dim, FSDP2 on the
dp dim, AdamW, and torch's loss_parallel() when the plan asks for it.

    # 4 ranks: a (dp 2, tp 2) mesh; each dp rank trains on its half of the batch
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 20

    # the same steps on one device, without torchrun: the loss curve to compare with
    python examples/train.py --plan plans/llama_tp_sp.yaml --steps 20

    # stop after 10 steps, then resume: the same curve as 20 steps in one go
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 10 --save ckpt
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 20 --resume ckpt

Every rank builds the model from the same seed, `load_plan(...).apply` shards
it over the tp dim, `fully_shard` (per block, then the root) shards it again
over dp. The data is a fixed random token stream: step N's global batch is the
same on every run, and dp rank r trains on rows r::dp of it, so the mean loss
over dp ranks equals the one-device loss of the whole batch.

`--save DIR` writes the sharded weights with `tpplan.save_checkpoint` (DCP) and
AdamW's sharded state with torch's `get_optimizer_state_dict` + `dcp.save`;
`--resume DIR` loads both into the freshly sharded model (each rank its own
shards) and continues at the next step of the data stream.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
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


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, path: str) -> None:
    """Weights through tpplan (DCP), the optimizer state through DCP, the step as JSON (every rank calls it)."""
    tpplan.save_checkpoint(model, os.path.join(path, "model"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(path, "optimizer"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(path, "step.json"), "w") as f:
            json.dump({"step": step}, f)


def resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> int:
    """Load what `save` wrote into the sharded model and its optimizer; the last step done."""
    tpplan.load_checkpoint(model, os.path.join(path, "model"))
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    with open(os.path.join(path, "step.json")) as f:
        return json.load(f)["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", default="tpplan.models.llama:tiny", help="MOD:FN returning the model")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over dp ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", metavar="DIR", help="save the weights and optimizer state after the last step")
    parser.add_argument("--resume", metavar="DIR", help="continue from what --save wrote")
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
    done = resume(model, optimizer, args.resume) if args.resume else 0

    data = batches(vocab, args.batch, args.seq)
    for _ in range(done):  # the batches the resumed run has seen
        next(data)
    for step in range(done + 1, args.steps + 1):
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

    if args.save:
        save(model, optimizer, args.steps, args.save)
    if distributed:
        dist.destroy_process_group()
        os._exit(0)  # torch 2.13 gloo may abort during interpreter shutdown after DTensor collectives


if __name__ == "__main__":
    main()
