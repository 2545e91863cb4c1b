"""Predicted per-rank peak of one training step (the dry run: fake tensors, fake
process group) against the peak measured on real ranks for the same step.

    python bench/bench_memory_accuracy.py [--seq 1024] [--configs tp fsdp-tp-ac hsdp-tp ep] [--device cpu|cuda] [--check]
    python bench/bench_memory_accuracy.py --fit [--seq 1024]   # tpplan fit's top 3 on 4 ranks, each measured

Model: tpplan.models.llama:bench_1024 (dim 1024, 4 layers, 16 heads / 8 KV
heads, FFN 2816, vocab 32000), batch 1, fp32, AdamW:
  tp          plans/llama_tp.yaml at TP 4 (4 ranks)
  tp-sp       plans/llama_tp_sp.yaml at TP 4 (4 ranks)
  fsdp-tp     plans/llama_tp.yaml at TP 2 x FSDP2 2 (--fsdp 2, 4 ranks)
  one         plans/llama_tp.yaml on one rank (TP 1), for a machine with one GPU
Version 2 layouts (one plan, every axis; `Plan.build_mesh` and `Plan.apply` on the ranks):
  fsdp-tp-ac  dp_shard 2 x tp 2, full activation checkpointing of layers.* (4 ranks)
  hsdp-tp     dp_replicate 2 x dp_shard 2 x tp 2 (8 ranks)
  ep          plans/qwen3_moe_fsdp_ep.yaml on tpplan.models.hf:qwen3_moe: dp_shard 2 x
              tp 2, experts over ep 2, FSDP2 over efsdp 2 (4 ranks; the dry run routes
              tokens evenly, the real router does not)
`--fit`: the top 3 layouts `tpplan fit` picks for the model on 4 ranks (dp_replicate,
dp_shard, tp; a global batch of 4, fp32, AdamW, 2 GiB per rank), each plan as fit writes
it, predicted by its dry run (no flags: the plan's training section) and measured;
Megatron's formula beside each.
Measured: each config runs under `torchrun --nproc-per-node N` (gloo on CPU);
every rank builds the model on real tensors and runs the same
`tpplan.memory.memory.measure_training_step` with torch's MemTracker /
FSDPMemTracker on real storages. With `--device cuda` (nccl, one GPU per
rank) each rank also reports `torch.cuda.max_memory_allocated()` over the
measured step, the allocator's own figure. Prints predicted / measured per
config; goal within 10% (`--check` exits 1 outside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tpplan.models.llama:bench_1024"


@dataclass(frozen=True)
class Config:
    plan: str  # a file under plans/, or a version 2 plan's text (extending plans/llama_tp.yaml)
    tp: int
    dp: int = 1  # version 1: --fsdp's dp
    world: int | None = None  # version 2: the world its mesh fills
    model: str = MODEL

    @property
    def ranks(self) -> int:
        return self.world or self.tp * self.dp


V2 = "version: 2\nextends: {root}/plans/llama_tp.yaml\nrules: {{}}\n"
CONFIGS = {
    "tp": Config("llama_tp.yaml", 4), "tp-sp": Config("llama_tp_sp.yaml", 4), "fsdp-tp": Config("llama_tp.yaml", 2, 2),
    "one": Config("llama_tp.yaml", 1),  # one rank: the allocator's figure on a machine with a single GPU
    "fsdp-tp-ac": Config(V2 + "mesh: {{dp_shard: 2, tp: 2}}\ncheckpointing: {{modules: layers.*}}\n", 2, world=4),
    "hsdp-tp": Config(V2 + "mesh: {{dp_replicate: 2, dp_shard: 2, tp: 2}}\n", 2, world=8),
    "ep": Config("qwen3_moe_fsdp_ep.yaml", 2, world=4, model="tpplan.models.hf:qwen3_moe"),
}
GOAL = 0.10


def plan_file(config: Config, folder: str) -> str:
    """The config's plan as a file: one under plans/, or its version 2 text written into `folder`."""
    if config.plan.endswith(".yaml"):
        return str(ROOT / "plans" / config.plan)
    path = Path(folder) / "plan.yaml"
    path.write_text(config.plan.format(root=ROOT))
    return str(path)


def predicted(config: Config, seq: int, plan: str) -> dict:
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.torchrun import ApplyOptions
    from tpplan.simulation.training import TrainOptions

    train = TrainOptions(batch=1, seq=seq, optimizer="adamw", fsdp=config.dp if config.dp > 1 else None)
    report = dry_run(ApplyOptions(plan=plan, model=config.model, tp=config.tp, train=train, world=config.world))
    assert report.ok, report.problems
    return report.to_json()["memory"]


def worker(config: Config, seq: int, device_type: str, plan_path: str, batch: int = 1) -> None:
    """One real rank (under torchrun): build, shard, measure; rank 0 prints every rank's figures."""
    import torch
    import torch.distributed as dist

    from tpplan import load_plan
    from tpplan.core.axes import tp_dims
    from tpplan.simulation.fsdp import shard_data_parallel
    from tpplan.simulation.modelref import build_model, load_callable
    from tpplan.simulation.positions import MeshDims
    from tpplan.memory.memory import measure_training_step
    from tpplan.simulation.simulate import default_inputs

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    plan = load_plan(plan_path)
    if plan.version == 2:  # the named mesh (and the expert view) torchrun builds
        mesh = plan.build_mesh(config.world, device.type, config.tp)
    else:  # the (dp, tp) mesh the dry run simulates
        mesh = MeshDims(*tp_dims(config.dp * config.tp, config.tp, plan.mesh_axis)).build(device.type)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(config.model, device.type, load_callable(config.model, "--model"))
    plan.apply(model, mesh)  # a version 2 plan: every axis (TP, experts, AC, FSDP2)
    wrapped = plan.version == 2 and any(type(m).__name__.startswith("FSDP") for m in model.modules())
    if config.dp > 1:
        shard_data_parallel(model, mesh)
    torch.manual_seed(1)
    inputs = (default_inputs(model, batch, seq),)
    allocator = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step = measure_training_step(model, inputs, "adamw", plan.loss_parallel, fsdp=config.dp > 1 or wrapped)
    if device.type == "cuda":
        torch.cuda.synchronize()
        allocator = torch.cuda.max_memory_allocated()
    mine = {"rank": dist.get_rank(), "peak": step.peak_bytes, "categories": step.categories, "allocator": allocator}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo may abort at interpreter exit after DTensor collectives


def measured(name: str, seq: int, device_type: str, plan: str, fitted: tuple[int, int] | None = None) -> list[dict]:
    """Every rank's figures under torchrun; `fitted`: (tp, per-rank batch) of a layout fit chose (4 ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    ranks = FIT_WORLD if fitted else CONFIGS[name].ranks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
               "--worker", name, "--plan-file", plan, "--seq", str(seq), "--device", device_type]
    command += ["--fitted", f"{fitted[0]},{fitted[1]}"] if fitted else []
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"torchrun for {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT "))


def main() -> int:
    parser = _common.arguments(__doc__, check="unless every predicted peak is within the goal (a tenth) of the measured one")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--configs", nargs="+", default=["tp", "tp-sp", "fsdp-tp", "fsdp-tp-ac", "hsdp-tp", "ep"], choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan-file", help=argparse.SUPPRESS)
    parser.add_argument("--fitted", help=argparse.SUPPRESS)
    parser.add_argument("--fit", action="store_true", help="tpplan fit's top 3 layouts on 4 ranks, each measured")
    args = parser.parse_args()
    if args.worker:
        if args.fitted:
            tp, batch = map(int, args.fitted.split(","))
            worker(Config(args.plan_file, tp, world=FIT_WORLD), args.seq, args.device, args.plan_file, batch)
        else:
            worker(CONFIGS[args.worker], args.seq, args.device, args.plan_file)
        return 0
    if args.fit:
        return fitted_layouts(args)

    mib = 2**20
    print(f"{MODEL} (ep: tpplan.models.hf:qwen3_moe), batch 1, seq {args.seq}, fp32, AdamW ({args.device})")
    header = f"{'config':11} {'predicted MiB':>14} {'measured MiB':>13} {'pred/meas':>10}"
    header += f" {'allocator MiB':>14} {'pred/alloc':>11}" if args.device == "cuda" else ""
    print(header)
    worst = 0.0
    for config in args.configs:
        with tempfile.TemporaryDirectory() as folder:
            plan = plan_file(CONFIGS[config], folder)
            start = time.perf_counter()
            want = predicted(CONFIGS[config], args.seq, plan)
            predict_s = time.perf_counter() - start
            ranks = measured(config, args.seq, args.device, plan)
        peak = max(r["peak"] for r in ranks)  # what must fit: the fullest rank
        ratio = want["per_rank_peak_bytes"] / peak
        worst = max(worst, abs(ratio - 1))
        line = f"{config:11} {want['per_rank_peak_bytes'] / mib:14.1f} {peak / mib:13.1f} {ratio:10.4f}"
        if args.device == "cuda":
            allocator = max(r["allocator"] for r in ranks)
            line += f" {allocator / mib:14.1f} {want['per_rank_peak_bytes'] / allocator:11.4f}"
            worst = max(worst, abs(want["per_rank_peak_bytes"] / allocator - 1))
        print(line + f"   (dry run {predict_s:.1f} s; peak at {want['peak_module']})")
        for name in ("parameters", "gradients", "optimizer", "activations", "temporaries"):
            got = ranks[0]["categories"][name]
            print(f"    {name:12} predicted {want[name] / mib:10.2f} MiB, measured (rank 0) {got / mib:10.2f} MiB")
    print(f"largest deviation {worst:.2%} (goal <= {GOAL:.0%})")
    return _common.exit_code(args.check, _common.within(worst, GOAL))


FIT_WORLD, FIT_BATCH = 4, 4


def fitted_layouts(args) -> int:
    """fit's top 3 on FIT_WORLD ranks: predicted (the written plan's dry run) / measured, Megatron's beside."""
    from tpplan import fit
    from tpplan.runtime.dryrun import dry_run
    from tpplan.runtime.options import ApplyOptions

    mib = 2**20
    result = fit(MODEL, world=FIT_WORLD, seq=args.seq, batch=FIT_BATCH, plan=str(ROOT / "plans" / "llama_tp.yaml"), memory="2GiB",
                 dtype="fp32", axes=("dp_replicate", "dp_shard", "tp"), top=3, jobs=2)
    print(f"{MODEL}, tpplan fit on {FIT_WORLD} ranks × 2 GiB, global batch {FIT_BATCH}, seq {args.seq}, fp32, AdamW ({args.device})")
    worst = 0.0
    for ranked in result.ranked[:3]:
        with tempfile.TemporaryDirectory() as folder:
            path = str(Path(folder) / "plan.yaml")
            Path(path).write_text(result.plan_text(ranked, path))
            want = dry_run(ApplyOptions(plan=path, model=MODEL)).memory.per_rank_peak_bytes
            mesh = ranked.layout.mesh
            ranks = measured("fit", args.seq, args.device, path, (mesh["tp"], FIT_BATCH // ranked.layout.dp))
        peak = max(r["peak"] for r in ranks)
        worst = max(worst, abs(want / peak - 1))
        print(f"  {ranked.layout.describe():40} fit {ranked.peak_bytes / mib:9.1f} MiB (its plan's dry run {want / mib:.1f}), "
              f"measured {peak / mib:9.1f} MiB: {want / peak:.4f}; Megatron's formula {ranked.megatron_peak_bytes / mib:9.1f} MiB")
    print(f"largest deviation {worst:.2%} (goal <= {GOAL:.0%})")
    return _common.exit_code(args.check, _common.within(worst, GOAL))


if __name__ == "__main__":
    raise SystemExit(main())
