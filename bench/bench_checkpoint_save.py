"""Atomic checkpoint saves: their cost over a save in place, and training during an asynchronous save.

    python bench/bench_checkpoint_save.py [--model tpplan.models.llama:bench_1024] [--rounds 6] [--saves 4] [--nproc 2] [--check]

Launches itself under `torchrun --standalone` (gloo on CPU); the model is
parallelized by `plans/llama_tp.yaml` over all ranks, checkpoints go to a
temporary directory (`--dir`, default the system's).

1. Save time: `save_checkpoint(model, dir)` (staged, fsynced, exchanged into
   place, the previous copy kept as the next save's staging directory) vs what
   it replaced, `dcp.save` with `FileSystemWriter(dir, overwrite=True)` into the
   target in place (fsync on too), alternating ABBA, `--rounds` each, medians.
   Both start from their steady state: the in-place directory holds a
   checkpoint whose files it overwrites, the atomic one a checkpoint and its
   spare (two saves before the first round). Goal: atomic / in place <= 1.05.
2. Training during an asynchronous save: AdamW steps, in `--saves` cycles of
   `save_checkpoint(..., step=N, keep=2, optimizer=opt, async_save=True)`, steps
   while it is written, then `--every` steps without a save (so both kinds of
   step see the same load from outside), after 3 such cycles to warm (the
   staging buffers, the spare); the median step time of the steps
   that began while a save was being written vs the others. Goal: <= 1.1. Also
   printed: how long the `save_checkpoint` call itself blocked (the copy of the
   state to CPU memory, not in the step times), the CPU seconds of the training
   thread per step and of the writer per save, and the load average.
3. A reference for the machine: the same steps while a separate process at nice 19
   writes as many bytes as the rank's share of one checkpoint (a plain buffer, fsynced:
   no serialization, no DCP) vs without: what writing that much costs the training here
   by itself (2 ranks filling 2 cores: 1.23-1.48 measured, above the async save's own).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, arguments, exit_code, median, within

FLOOR_WRITE = "import os, sys; os.nice(19); f = open(sys.argv[1], 'wb'); f.write(bytearray(int(sys.argv[2]))); f.flush(); os.fsync(f.fileno())"
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
    in_place(), atomic(), atomic()  # warm, each in its steady state: over a previous checkpoint (and its spare)
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

    def step() -> tuple[float, float]:
        """(wall, CPU seconds of this thread) of one training step."""
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
        start, cpu = time.perf_counter(), time.thread_time()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.thread_time() - cpu

    def all_done(handle) -> bool:
        """Whether the save (or the floor's writer process) is done on every rank (rank 0's commits
        last): the ranks take as many steps."""
        done = handle.done() if hasattr(handle, "done") else handle.poll() is not None
        flag = torch.tensor([1 if done else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    step(), step()  # warm, and AdamW's state exists
    load = [os.getloadavg()[0]]
    plain, during, blocked, writer_cpu, root = [], [], [], [], os.path.join(where, "async")
    warm = 3  # not measured: the first save allocates the staging buffers, the third is the first with a spare (keep=2)
    for n in range(warm + args.saves):
        process_cpu, thread_cpu = time.process_time(), time.thread_time()
        start = time.perf_counter()
        handle = tpplan.save_checkpoint(model, root, step=n, keep=2, optimizer=optimizer, async_save=True)
        stall = time.perf_counter() - start
        steps = []
        while not all_done(handle):
            steps.append(step())
        handle.wait()
        spent = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu)  # the writer's (and torch's other threads')
        after = [step() for _ in range(args.every)]
        if n < warm:
            continue
        blocked.append(stall)
        writer_cpu.append(spent)
        during += steps
        plain += after
    # 3. The reference: the same steps while a process of its own at nice 19 writes as many bytes as this
    # rank's share of a checkpoint (a plain buffer and an fsync: no serialization, no DCP)
    share = sum(os.path.getsize(os.path.join(root, f"step-{warm + args.saves - 1}", f)) for f in
                os.listdir(os.path.join(root, f"step-{warm + args.saves - 1}"))) // world
    floor_steps, floor_plain = [], []
    for _ in range(args.saves):
        writer = subprocess.Popen([sys.executable, "-c", FLOOR_WRITE, os.path.join(where, f"floor-{rank}.bin"), str(share)])
        while not all_done(writer):
            floor_steps.append(step())
        floor_plain += [step() for _ in range(args.every)]
    load.append(os.getloadavg()[0])
    dist.barrier()
    if rank == 0:
        print(f"{args.model} on {world} gloo ranks, {size / 2**20:.0f} MiB per checkpoint (model), {args.rounds} rounds; tpplan from {os.path.dirname(tpplan.__file__)}")
        for name, values in times.items():
            print(f"  {name:8s} save: median {median(values):.3f} s   (min {min(values):.3f}, max {max(values):.3f})")
        print(f"ratio atomic / in place: {save_ratio:.3f}   (goal <= {SAVE_GOAL})")
        ok = within(save_ratio, SAVE_GOAL)
        walls = lambda rows: [w for w, _ in rows]  # noqa: E731
        cpus = lambda rows: [c for _, c in rows]  # noqa: E731
        print(f"  training step without a save: median {median(walls(plain)) * 1e3:.1f} ms (min {min(walls(plain)) * 1e3:.1f}, "
              f"max {max(walls(plain)) * 1e3:.1f}; {len(plain)} steps), training thread CPU {median(cpus(plain)) * 1e3:.1f} ms")
        print(f"  save_checkpoint(async_save=True) blocked: median {median(blocked) * 1e3:.1f} ms (min {min(blocked) * 1e3:.1f}, "
              f"max {max(blocked) * 1e3:.1f}); writer CPU per save (rank 0) median {median(writer_cpu):.3f} s; load average {load[0]:.2f} -> {load[1]:.2f}")
        if during:
            step_ratio = median(walls(during)) / median(walls(plain))
            print(f"  training step during an async save: median {median(walls(during)) * 1e3:.1f} ms (min {min(walls(during)) * 1e3:.1f}, "
                  f"max {max(walls(during)) * 1e3:.1f}; {len(during)} steps), training thread CPU {median(cpus(during)) * 1e3:.1f} ms")
            print(f"ratio step during async save / without: {step_ratio:.3f}   (goal <= {STEP_GOAL})")
            ok = ok and within(step_ratio, STEP_GOAL)
        else:
            print("  every async save finished before the next step began")
        if floor_steps:
            floor = median(walls(floor_steps)) / median(walls(floor_plain))
            print(f"  reference: training step while a nice-19 process writes {share / 2**20:.0f} MiB (a rank's share, no serialization) "
                  f"and fsyncs: median {median(walls(floor_steps)) * 1e3:.1f} ms ({len(floor_steps)} steps) vs {median(walls(floor_plain)) * 1e3:.1f} ms")
            print(f"ratio step during that write / without: {floor:.3f}   (writing that much, by itself, on this machine)")
        code = exit_code(bool(os.environ.get("BENCH_CHECK")), ok)
        if code:
            raise SystemExit(code)


def main() -> None:
    parser = arguments(__doc__, check=f"when atomic / in place is above {SAVE_GOAL} or the step ratio above {STEP_GOAL}")
    parser.add_argument("--model", default="tpplan.models.llama:bench_1024", help="MOD:FN of the model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--saves", type=int, default=4, help="async saves measured (3 more before them, to warm)")
    parser.add_argument("--every", type=int, default=3, help="steps without a save after each async save")
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
                   "--model", args.model, "--rounds", str(args.rounds), "--saves", str(args.saves), "--every", str(args.every),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--dir", where]
        sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
