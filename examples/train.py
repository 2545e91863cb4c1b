"""A short trainer to copy: torchrun, a tpplan plan on the tp dim, FSDP2 on the
dp dim (or a version 2 plan's every axis), AdamW, and torch's loss_parallel() when
the plan asks for it.

Any causal LM `tpplan apply` takes: `--model MOD:FN` (a function returning the
model) or `--model hf:SPEC` (a transformers config: a directory, a config.json
or a model type), whose output is the logits or has `.logits`.

    # 4 ranks: a (dp 2, tp 2) mesh; each dp rank trains on its half of the batch
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 20

    # the same steps on one device, without torchrun: the loss curve to compare with
    python examples/train.py --plan plans/llama_tp_sp.yaml --steps 20

    # stop after 10 steps, then resume: the same curve as 20 steps in one go
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 10 --save ckpt
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 --steps 20 --resume ckpt

    # a version 2 plan: its named mesh (dp_shard -1: the rest of the world, tp 2), FSDP2 on
    # its units and the TP rules, all from the file
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_fsdp_tp.yaml --tp 2 --steps 20

    # a pipeline (pp 2 × tp 2): this rank's stages run by torch's schedule, the plan's microbatches
    torchrun --nproc-per-node 4 examples/train.py --plan plans/llama_pp_tp.yaml --steps 20

    # a transformers model with its plan
    torchrun --nproc-per-node 2 examples/train.py --model tpplan.models.hf:qwen3 --plan plans/hf/qwen3_tp.yaml --tp 2

    # survive a killed rank: torchrun restarts the ranks, which resume from ckpt's latest step
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train.py --plan plans/llama_tp_sp.yaml --tp 2 \
        --steps 20 --save ckpt --save-every 5

Every rank builds the model from the same seed (`tpplan.build_model`, as the
CLI's --model), `load_plan(...).apply` shards it over the tp dim, `fully_shard`
(per block, then the root) shards it again over dp. A plan with a `pipeline`
gives each rank its stages (`plan.pipeline_stages`), which torch's
`PipelineStage`s and the plan's schedule run: the first stage takes the tokens,
the last computes the loss, and checkpoints hold each rank's stages' keys. The data is a fixed random
token stream of the model's vocabulary: step N's global batch is the
same on every run, and dp rank r trains on rows r::dp of it, so the mean loss
over dp ranks equals the one-device loss of the whole batch.

`--save DIR` makes DIR a training root: `tpplan.save_checkpoint(..., step=N)`
writes DIR/step-N atomically after the last step and every `--save-every N`
steps (the sharded weights, AdamW's sharded state, and in `extra` the data
stream's position and the RNG state), keeping the `--keep` newest.
`--resume DIR` loads the latest complete step into the freshly sharded model
(each rank its own shards) and continues the data stream where it stopped;
after torchrun restarts the ranks (`--max-restarts`), they resume from `--save`
by themselves. `--async-save` writes in the background while training goes on.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """The model `ref` names (MOD:FN or hf:SPEC), on `device`."""
    torch.manual_seed(0)  # the same weights on every rank, and in the one-device run
    try:
        return tpplan.build_model(ref, device)
    except (ValueError, tpplan.PlanError) as exc:  # no such model, or its factory failed: the message says where
        raise SystemExit(str(exc)) from None


def vocab_size(model: torch.nn.Module) -> int:
    """The token vocabulary: the model's config (transformers, or any `config.vocab_size`), else its first Embedding."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None:
        raise SystemExit(f"--model: {type(model).__name__} has no config.vocab_size and no nn.Embedding: not a token model")
    return embedding.num_embeddings


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks FSDP2 shards one by one: the model's longest ModuleList (`layers`)."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=torch.nn.ModuleList())


class Batches:
    """(tokens, next tokens) of a fixed random stream: the same on every rank and run.
    Its position is its generator's state (saved in the checkpoint's extra)."""

    def __init__(self, vocab: int, batch: int, seq: int):
        self.vocab, self.batch, self.seq = vocab, batch, seq
        self.generator = torch.Generator().manual_seed(1)

    def __next__(self):
        stream = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.generator)
        return stream[:, :-1], stream[:, 1:]


def parallelize(model: torch.nn.Module, plan: tpplan.Plan, tp: int | None, device: torch.device):
    """Shard `model` over every rank; returns (the mesh, this rank's part of the model: the
    model, or its pipeline stages). A version 2 plan names every axis: its mesh (pp,
    dp_replicate, dp_shard, tp) is built once and `apply` lays out all of it (the TP
    rules, activation checkpointing, FSDP2/HSDP on its units), or `pipeline_stages` cuts
    this rank's stages from it. A version 1 plan is the tp dim of a (dp, tp) mesh,
    FSDP2 per block then the root on dp."""
    world = dist.get_world_size()
    if plan.version == 2:
        try:
            mesh = plan.build_mesh(world, device.type, tp)
        except ValueError as exc:  # its sizes do not make the world: the message has the numbers
            raise SystemExit(f"{plan.file}: {exc}") from None
        if plan.pipeline is not None:
            return mesh, plan.pipeline_stages(model, mesh)
        plan.apply(model, mesh)
        return mesh, model
    tp = tp or 2
    if world % tp:
        raise SystemExit(f"--tp ({tp}) must divide the world size ({world})")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", plan.mesh_axis))
    plan.apply(model, mesh)
    if mesh["dp"].size() > 1:
        for block in blocks(model):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh, model


class Pipeline:
    """This rank's stages under torch's schedule: `step` runs one batch's microbatches
    and returns the loss on the last stage's ranks (None on the others)."""

    def __init__(self, plan: tpplan.Plan, stages: list, mesh, device: torch.device, local_batch: int):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

        pipe, pp = plan.spec.pipeline, mesh["pp"]
        count = pp.size() * pipe.virtual_stages
        microbatches = pipe.microbatches or local_batch // pipe.microbatch_size
        if not microbatches or local_batch % microbatches:
            raise SystemExit(f"--batch: each data-parallel rank's {local_batch} sequences do not split into the plan's "
                             f"{microbatches} microbatches")
        ids = plan.stage_ids(mesh)  # the stages' indices, in the order pipeline_stages gives them
        torch_stages = [PipelineStage(stage, i, count, device, group=pp.get_group()) for stage, i in zip(stages, ids)]
        schedule = get_schedule_class(pipe.schedule)
        multi = issubclass(schedule, PipelineScheduleMulti)
        self.schedule = schedule(torch_stages if multi else torch_stages[0], n_microbatches=microbatches, loss_fn=cross_entropy)
        self.first, self.last = 0 in ids, count - 1 in ids

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        losses: list = []
        # return_outputs=False: the last stage need not keep every microbatch's logits, only the losses
        self.schedule.step(*((tokens,) if self.first else ()), **({"target": targets, "losses": losses} if self.last else {}),
                           return_outputs=False)
        return torch.stack(losses).mean() if self.last else None


def cross_entropy(output, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)  # transformers' output, or the logits themselves
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


DATA_DIMS = ("dp", "dp_replicate", "dp_shard")  # v1's dp, v2's data axes: the ranks that split the batch


def data_rank(mesh) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their count): its coordinate
    on the mesh's data dims, outermost first (tp ranks share one batch)."""
    index, count = 0, 1
    for name, size, coordinate in zip(mesh.mesh_dim_names, mesh.shape, mesh.get_coordinate()):
        if name in DATA_DIMS:
            index, count = index * size + coordinate, count * size
    return index, count


def save(model, optimizer, step: int, data: Batches, args, plan: tpplan.Plan) -> "tpplan.AsyncSave | str":
    """DIR/step-N: weights and AdamW state (each rank its shards), the data position and RNG, and the
    plan and mesh it was saved under (it loads under any other: every rank calls it)."""
    extra = {"data": data.generator.get_state(), "rng": torch.get_rng_state()}
    return tpplan.save_checkpoint(model, args.save, step=step, keep=args.keep, optimizer=optimizer, extra=extra,
                                  async_save=args.async_save, plan=plan)


def resume(model, optimizer, data: Batches, path: str) -> int:
    """The latest complete step of `path` into the sharded model (or its stages) and its optimizer; the last step done."""
    info = tpplan.load_checkpoint(model, path, optimizer=optimizer)
    data.generator.set_state(info.extra["data"])
    torch.set_rng_state(info.extra["rng"])
    return info.step


def init_process_group(backend: str) -> None:
    """dist.init_process_group, with a store prefix per torchrun attempt: torch 2.13's
    torchrun --standalone keeps its store across restarts, and restarted ranks would
    otherwise read the dead ranks' gloo addresses (and hang connecting to them)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        dist.init_process_group(backend)
        return
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=int(os.environ["RANK"]), world_size=world)


def resume_from(args) -> str | None:
    """--resume, or after torchrun restarted the ranks (a rank died) the --save root, once it holds a step."""
    if args.resume:
        return args.resume
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and args.save and os.path.exists(os.path.join(args.save, "latest")):
        return args.save
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", default="tpplan.models.llama:tiny", help="MOD:FN returning the model, or hf:SPEC (as tpplan apply)")
    parser.add_argument("--tp", type=int, help="the tp degree (default 2; a version 2 plan: its mesh.tp, or one of its listed degrees)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over dp ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", metavar="DIR", help="save step checkpoints (weights, optimizer, data position) here after the last step")
    parser.add_argument("--save-every", type=int, metavar="N", help="also save every N steps")
    parser.add_argument("--keep", type=int, default=3, help="how many of the newest step checkpoints to keep")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background (dcp.async_save)")
    parser.add_argument("--resume", metavar="DIR", help="continue from the latest complete step --save wrote")
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # under torchrun; else one device, no plan
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    plan = tpplan.load_plan(args.plan)
    model = build(args.model, device)
    vocab = vocab_size(model)
    dp, dp_rank, use_loss_parallel, part, pipeline = 1, 0, False, model, None
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh, part = parallelize(model, plan, args.tp, device)
        dp_rank, dp = data_rank(mesh)
        use_loss_parallel = plan.loss_parallel  # the head keeps the logits sharded on the vocabulary
        if isinstance(part, list):  # this rank's pipeline stages
            pipeline = Pipeline(plan, part, mesh, device, args.batch // dp)
    # a group for the DTensors and one for what the plan leaves whole: AdamW's default foreach
    # step on a GPU refuses one call mixing them
    optimizer = torch.optim.AdamW(tpplan.param_groups(torch.nn.ModuleList(part) if pipeline else part), lr=args.lr)
    data = Batches(vocab, args.batch, args.seq)
    source = resume_from(args)
    done = resume(part, optimizer, data, source) if source else 0
    if source and (not distributed or dist.get_rank() == 0):
        print(f"resumed from {source} at step {done}", flush=True)

    pending = None
    for step in range(done + 1, args.steps + 1):
        tokens, targets = (t[dp_rank::dp].to(device) for t in next(data))
        with loss_parallel() if use_loss_parallel else contextlib.nullcontext():
            if pipeline is not None:
                loss = pipeline.step(tokens, targets)  # forward and backward of every microbatch
            else:
                loss = cross_entropy(model(tokens), targets)
                loss.backward()  # inside loss_parallel() too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        value = torch.zeros((), device=device) if loss is None else (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if distributed and (dp > 1 or pipeline is not None):
            # the mean over the ranks holding a loss (each tp rank holds its dp rank's; under a
            # pipeline, the last stage's ranks): the whole batch's loss
            dist.all_reduce(value)
            value /= dist.get_world_size() // (mesh["pp"].size() if pipeline is not None else 1)
        if not distributed or dist.get_rank() == 0:
            print(f"step {step} loss {value.item()!r}", flush=True)  # every digit: resumed runs compare bitwise
        if args.save and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            pending = save(part, optimizer, step, data, args, plan)

    if pending is not None and args.async_save:
        pending.wait()  # the last checkpoint is committed before the job ends
    if distributed:
        dist.destroy_process_group()
        os._exit(0)  # torch 2.13 gloo may abort during interpreter shutdown after DTensor collectives


if __name__ == "__main__":
    main()
