"""Step time of a tpplan-applied model vs the same styles applied by hand, 2 gloo ranks.

    python bench/bench_apply_overhead.py [--steps 30] [--nproc 2] [--check]

Launches itself under `torchrun --standalone` (gloo on CPU). On every rank it
builds two identical Llama-style decoders from one seed: one parallelized by
`plans/llama_tp_sp.yaml` through tpplan (what `tpplan apply` runs), the other
by torchtitan-style hand-written `parallelize_module` calls with the same
styles. Both then train (forward, backward, SGD step) in alternation, so
machine noise hits both alike; rank 0 prints the median step times and the
ratio tpplan / hand-written. Goal: ratio <= 1.02 (--check exits 1 above it).
The two models must also compute the same thing: their first-step losses are
compared, exactly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _common import ROOT, arguments, exit_code, median, within

GOAL = 1.02
PLAN = ROOT / "plans" / "llama_tp_sp.yaml"


def by_hand(model, tp_mesh) -> None:
    """The shipped SP plan written out as torchtitan's apply_tp does."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan import load_plan
    from tpplan.models.llama import LlamaConfig, Transformer
    from tpplan.simulation.locate import apply_plan
    from tpplan.simulation.simulate import default_inputs

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        # Big enough that a step is compute and communication, not Python overhead alone.
        cfg = LlamaConfig(dim=512, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=2048, ffn_hidden=1536, max_seq_len=256)
        models = {}
        for name in ("tpplan", "by hand"):
            torch.manual_seed(0)
            models[name] = Transformer(cfg)
        apply_plan(load_plan(PLAN), models["tpplan"], mesh)
        by_hand(models["by hand"], mesh)
        inputs = default_inputs(models["tpplan"], batch=4, seq=128, generator=torch.Generator().manual_seed(1))
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}

        def step(name: str) -> tuple[float, float]:
            model, optimizer = models[name], optimizers[name]
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            return time.perf_counter() - start, loss.item()

        first = {name: step(name)[1] for name in models}  # warm-up, and both must compute the same
        if first["tpplan"] != first["by hand"]:
            raise SystemExit(f"the two models differ: first losses {first}")
        step("tpplan"), step("by hand")
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(steps):
            order = ("tpplan", "by hand") if i % 2 == 0 else ("by hand", "tpplan")
            for name in order:
                times[name].append(step(name)[0])
        if rank == 0:
            medians = {name: median(t) for name, t in times.items()}
            ratio = medians["tpplan"] / medians["by hand"]
            print(f"{world} gloo ranks, Llama dim {cfg.dim} x {cfg.n_layers} layers, batch 4 x 128 tokens, {steps} steps each, alternating")
            print(f"plan {PLAN.relative_to(ROOT)}; identical first-step loss {first['tpplan']:.6f}")
            for name, step_s in medians.items():
                print(f"  {name:8s} median step {step_s * 1e3:8.2f} ms   (min {min(times[name]) * 1e3:.2f}, max {max(times[name]) * 1e3:.2f})")
            print(f"ratio tpplan / by hand: {ratio:.3f}   (goal <= {GOAL})")
            code = exit_code(bool(os.environ.get("BENCH_CHECK")), within(ratio, GOAL))
            if code:
                raise SystemExit(code)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = arguments(__doc__, check=f"when the ratio is above {GOAL}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code = 0
        try:
            worker(args.steps)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        # As tpplan's torchrun workers do: skip the interpreter teardown, during which
        # gloo workers that ran DTensor collectives abort now and then (torch 2.13).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.check:
        env["BENCH_CHECK"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__, "--worker", "--steps", str(args.steps)]
    sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
