"""Atomic checkpoint saves: their cost over a save in place, and training during an asynchronous save.

    python bench/bench_checkpoint_save.py [--model tpplan.models.llama:bench_1024] [--rounds 5] [--steps 24] [--nproc 2] [--check]

Launches itself under `torchrun --standalone` (gloo on CPU); the model is
parallelized by `plans/llama_tp.yaml` over all ranks, checkpoints go to a
temporary directory (`--dir`, default the system's).

1. Save time: `save_checkpoint(model, dir)` (staged, fsynced, renamed into place,
   the previous copy removed) vs what it replaced, `dcp.save` with
   `FileSystemWriter(dir, overwrite=True)` into the target in place (fsync on
   too), alternating ABBA, `--rounds` each, medians. Goal: atomic / in place <= 1.05.
2. Training during an asynchronous save: AdamW steps, first `--steps` without
   any save, then `--steps` with `save_checkpoint(..., step=N, optimizer=opt,
   async_save=True)` started every `--every` steps; the step time of the steps
   that ran while a save was being written vs without. Goal: <= 1.1. Also
   printed: how long the `save_checkpoint` call itself blocked (DCP's copy of
   the state to CPU memory), which is not in the step times.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, arguments, exit_code, median, within

SAVE_GOAL = 1.05
STEP_GOAL = 1.1
PLAN = ROOT / "plans" / "llama_tp.yaml"


def worker(args) -> None:
    import importlib
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    import tpplan
    from tpplan.checkpoint.save import state_to_save

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # the in-place save's overwrite=True: the point
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module, _, fn = args.model.partition(":")
    torch.manual_seed(0)
    model = getattr(importlib.import_module(module), fn)()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tpplan.load_plan(str(PLAN)).apply(model, mesh)
    where = args.dir if rank == 0 else None
    box = [where]
    dist.broadcast_object_list(box, src=0)
    where = box[0]

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    in_place_dir, atomic_dir = os.path.join(where, "in-place"), os.path.join(where, "atomic")
    in_place = lambda: dcp.save(state_to_save(model), storage_writer=FileSystemWriter(in_place_dir, overwrite=True, sync_files=True))  # noqa: E731
    atomic = lambda: tpplan.save_checkpoint(model, atomic_dir)  # noqa: E731
    in_place(), atomic()  # warm: both directories exist, as over a previous checkpoint
    times = {"in place": [], "atomic": []}
    for i in range(args.rounds):  # ABBA: each goes first as often (a save pays for the previous one's writeback)
        order = [("in place", in_place), ("atomic", atomic)][:: 1 if i % 2 == 0 else -1]
        for name, fn in order:
            times[name].append(timed(fn))
    save_ratio = median(times["atomic"]) / median(times["in place"])
    size = sum(os.path.getsize(os.path.join(atomic_dir, f)) for f in os.listdir(atomic_dir))

    vocab = model.tok_embeddings.num_embeddings
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)

    def step() -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(), step()  # warm, and AdamW's state exists
    plain = [step() for _ in range(args.steps)]
    during, blocked, handle, root = [], [], None, os.path.join(where, "async")
    for i in range(args.steps):
        if i % args.every == 0:
            start = time.perf_counter()
            handle = tpplan.save_checkpoint(model, root, step=i, keep=2, optimizer=optimizer, async_save=True)
            blocked.append(time.perf_counter() - start)
        writing = handle is not None and not handle.done()
        t = step()
        if writing:
            during.append(t)
    if handle is not None:
        handle.wait()
    dist.barrier()
    if rank == 0:
        print(f"{args.model} on {world} gloo ranks, {size / 2**20:.0f} MiB per checkpoint (model), {args.rounds} rounds")
        for name, values in times.items():
            print(f"  {name:8s} save: median {median(values):.3f} s   (min {min(values):.3f}, max {max(values):.3f})")
        print(f"ratio atomic / in place: {save_ratio:.3f}   (goal <= {SAVE_GOAL})")
        ok = within(save_ratio, SAVE_GOAL)
        if during:
            step_ratio = median(during) / median(plain)
            print(f"  training step without a save: median {median(plain) * 1e3:.1f} ms; during an async save: "
                  f"median {median(during) * 1e3:.1f} ms ({len(during)} steps); save_checkpoint blocked {median(blocked) * 1e3:.1f} ms (median)")
            print(f"ratio step during async save / without: {step_ratio:.3f}   (goal <= {STEP_GOAL})")
            ok = ok and within(step_ratio, STEP_GOAL)
        else:
            print(f"  every async save finished before the next step began (save_checkpoint blocked {median(blocked) * 1e3:.1f} ms)")
        code = exit_code(bool(os.environ.get("BENCH_CHECK")), ok)
        if code:
            raise SystemExit(code)


def main() -> None:
    parser = arguments(__doc__, check=f"when atomic / in place is above {SAVE_GOAL} or the step ratio above {STEP_GOAL}")
    parser.add_argument("--model", default="tpplan.models.llama:bench_1024", help="MOD:FN of the model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6, help="start an async save every N steps")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code = 0
        try:
            worker(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo workers that ran DTensor collectives may abort in the teardown (torch 2.13)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.check:
        env["BENCH_CHECK"] = "1"
    with tempfile.TemporaryDirectory(prefix="tpplan-bench-save-", dir=args.dir) as where:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__, "--worker",
                   "--model", args.model, "--rounds", str(args.rounds), "--steps", str(args.steps), "--every", str(args.every),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--dir", where]
        sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
