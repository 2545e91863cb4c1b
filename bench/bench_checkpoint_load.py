"""Loading a HuggingFace checkpoint at TP 2: tpplan vs transformers, side by side.

A ~1.1B-parameter random-weight Llama (TinyLlama-1.1B's shape: hidden 2048,
22 layers, 32 heads, 4 KV heads, vocab 32000) is written as bf16 safetensors
(two files and an index, ~2.2 GB) in a temp dir. Then two torchrun jobs of 2
gloo ranks each, one after the other, each process group initialised before
the clock starts:

- `tpplan`: config -> meta model -> `plan.apply` -> `load_checkpoint` (DCP's
  HuggingFaceStorageReader, each rank reading its slices);
- `transformers`: `AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`.

The plan, plans/hf/llama_tp.yaml, lays the parameters out as transformers'
own Llama plan does (vocab-parallel embedding and lm_head, colwise q/k/v and
gate/up, rowwise o/down), so both hold the same shards and read the same bytes;
a checksum of one shard per rank shows both loaded the same values.

Per rank: load time, the empty process's RSS (after the same imports in both
-- torch.distributed.checkpoint, transformers' Llama modeling code, tpplan --
and the process group), and the peak RSS during the load (VmHWM, reset before the load through
/proc/self/clear_refs). Prints load time tpplan / transformers (goal <= 1.0),
peak RSS tpplan / transformers (goal <= 1.0) and each peak / (its shard's bytes
+ the empty-process baseline) (goal <= 1.3).

Each job runs --repeat times (default 3), alternating, and the medians are
reported; before each job the checkpoint files are read once, so that both
start from a warm page cache. Both sides return parameters that are partly views of safetensors'
private mapping of the files (transformers: whatever it does not convert or
slice on dim 1; tpplan: replicated and dim-0 shards, tpplan/checkpoint/mapped.py),
and bytes not read yet are in neither the time nor the peak, so the figures
are printed twice: as loaded (the goals above), and after a first use that
reads one byte of every page of every shard on both sides (allocating
nothing), when each model is fully in memory.

    python bench/bench_checkpoint_load.py [--layers 22] [--keep DIR] [--repeat 3] [--check]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import _common

ROOT = _common.ROOT

CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

WORKER = textwrap.dedent('''
    import json, os, re, sys, time, warnings
    import torch, torch.distributed as dist, transformers
    from torch.distributed.tensor import DTensor

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

    mode, path, plan_file, out = sys.argv[1:5]
    warnings.filterwarnings("ignore")
    # The same libraries in both processes before the baseline: the load alone is measured.
    import safetensors.torch, torch.distributed.checkpoint, torch.distributed.tensor.parallel
    import transformers.models.llama.modeling_llama
    from torch.distributed.device_mesh import init_device_mesh
    from tpplan import load_checkpoint, load_plan
    import tpplan.checkpoint.load
    plan = load_plan(plan_file)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    baseline = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak of the load alone
    start = time.perf_counter()
    if mode == "tpplan":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        plan.apply(model, mesh)
        load_checkpoint(model, path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = status("VmHWM")
    anon, file_backed = status("RssAnon"), status("RssFile")
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    tensors = [local(t) for t in list(model.parameters()) + list(model.buffers())]
    shard = sum(t.numel() * t.element_size() for t in tensors)
    # First use: read one byte of every 4 KiB page of every shard, allocating nothing
    # (a tensor still backed by a file mapping is paged in now; a loaded one costs nothing).
    touch = time.perf_counter()
    for t in tensors:
        flat = t.detach().reshape(-1).view(torch.uint8) if t.numel() else None
        if flat is not None:
            int(flat[::4096].sum()) + int(flat[-1])
    touch = time.perf_counter() - touch
    used_peak = status("VmHWM")
    total = sum(float(t.double().sum()) for t in tensors)  # the values, to compare the two loads (after the peaks)
    q = local(model.model.layers[0].self_attn.q_proj.weight)
    json.dump({"rank": rank, "seconds": seconds, "baseline": baseline, "peak": peak, "shard_bytes": shard,
               "file_backed": file_backed, "anon": anon, "touch_s": touch, "used_peak": used_peak, "sum": total,
               "checksum": float(q.double().sum()), "q_shape": list(q.shape),
               "dtypes": sorted({str(p.dtype) for p in model.parameters()})}, open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()
    os._exit(0)
''')


def write_checkpoint(directory: Path, layers: int) -> int:
    """Random bf16 weights in transformers' names and layout, two files and an index; returns bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers}, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, part in enumerate(halves, start=1):
        file = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        tensors = {}
        for name in part:
            t = torch.randn(shapes[name], generator=generator, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(tensors, directory / file, metadata={"format": "pt"})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    return total


def warm(directory: Path) -> None:
    """Read every checkpoint file once, so that each job starts from the page cache:
    a machine may evict file pages unused for a while (proactive reclaim), and the
    job that follows would pay the disk the other one does not."""
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def run_job(mode: str, directory: Path, plan: Path, work: Path) -> list[dict]:
    warm(directory)
    worker = work / "worker.py"
    worker.write_text(WORKER)
    out = work / f"{mode}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker), mode, str(directory), str(plan), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{mode} job failed:\n{result.stderr[-4000:]}")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def median_results(runs: list[list[dict]]) -> list[dict]:
    """Per rank, the median over repeated jobs of every number (the first run's checksums)."""
    import statistics

    merged = []
    for rank in range(len(runs[0])):
        first = runs[0][rank]
        merged.append({k: statistics.median(run[rank][k] for run in runs) if isinstance(v, (int, float)) and k not in ("sum", "checksum") else v
                       for k, v in first.items()})
    return merged


def main() -> None:
    parser = _common.arguments(__doc__, check="when a goal is missed")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--keep", type=Path, help="write (or reuse) the checkpoint here instead of a temp dir")
    parser.add_argument("--repeat", type=int, default=3,
                        help="run each job this many times, alternating, and report medians (the machine may be shared)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tpplan-bench-") as tmp:
        work = Path(tmp)
        directory = args.keep or work / "llama"
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / "model.safetensors.index.json").exists():
            total = write_checkpoint(directory, args.layers)
        else:
            total = json.loads((directory / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        plan = ROOT / "plans/hf/llama_tp.yaml"
        load = os.getloadavg()
        runs: dict[str, list] = {"tpplan": [], "transformers": []}
        for _ in range(max(1, args.repeat)):
            for mode in runs:
                runs[mode].append(run_job(mode, directory, plan, work))
        after = os.getloadavg()
    results = {mode: median_results(r) for mode, r in runs.items()}

    print(f"checkpoint: {total / 1e9:.2f} GB bf16 safetensors ({args.layers} layers, ~{total / 2 / 1e9:.2f}B parameters), 2 gloo ranks; "
          f"medians of {max(1, args.repeat)} alternating runs each; load average before/after: {load[0]:.1f}/{after[0]:.1f}")
    for mode in runs:
        print(f"  {mode} load s per run (max over ranks): " + ", ".join(f"{max(r['seconds'] for r in run):.2f}" for run in runs[mode]))
    print(f"{'rank':>4} {'impl':>12} {'load s':>7} {'base MiB':>9} {'peak MiB':>9} {'shard MiB':>10} {'peak/(shard+base)':>18} "
          f"{'anon MiB':>9} {'file-backed MiB':>16} {'1st use s':>10} {'peak after 1st use MiB':>23}")
    for rank in range(2):
        for mode in ("tpplan", "transformers"):
            r = results[mode][rank]
            ratio = r["peak"] / (r["shard_bytes"] + r["baseline"])
            print(f"{rank:>4} {mode:>12} {r['seconds']:>7.2f} {r['baseline'] / 2**20:>9.0f} {r['peak'] / 2**20:>9.0f} {r['shard_bytes'] / 2**20:>10.0f} "
                  f"{ratio:>18.3f} {r['anon'] / 2**20:>9.0f} {r['file_backed'] / 2**20:>16.0f} {r['touch_s']:>10.2f} {r['used_peak'] / 2**20:>23.0f}")
    ours, theirs = results["tpplan"], results["transformers"]
    time_ratio = max(r["seconds"] for r in ours) / max(r["seconds"] for r in theirs)
    print("As loaded (the issue's goals). Both sides' returned parameters may still map the safetensors files "
          "(file-backed MiB): bytes not read yet are not in the time or peak.")
    print(f"  load time tpplan / transformers: {time_ratio:.3f} (goal <= 1.0)")
    met = _common.within(time_ratio, 1.0)
    for rank in range(2):
        peak_ratio = ours[rank]["peak"] / theirs[rank]["peak"]
        own_ratio = ours[rank]["peak"] / (ours[rank]["shard_bytes"] + ours[rank]["baseline"])
        met = met and _common.within(peak_ratio, 1.0) and _common.within(own_ratio, 1.3)
        print(f"  rank {rank}: peak RSS tpplan / transformers: {peak_ratio:.3f} (goal <= 1.0); "
              f"tpplan peak / (shard + baseline): {own_ratio:.3f} (goal <= 1.3)")
    used = lambda r: r["seconds"] + r["touch_s"]
    print("After first use (one byte of every page of every shard read, on both sides: each model fully in memory):")
    print(f"  load + first use time tpplan / transformers: {max(map(used, ours)) / max(map(used, theirs)):.3f}")
    for rank in range(2):
        print(f"  rank {rank}: peak RSS tpplan / transformers: {ours[rank]['used_peak'] / theirs[rank]['used_peak']:.3f}; "
              f"peak / (shard + baseline): tpplan {ours[rank]['used_peak'] / (ours[rank]['shard_bytes'] + ours[rank]['baseline']):.3f}, "
              f"transformers {theirs[rank]['used_peak'] / (theirs[rank]['shard_bytes'] + theirs[rank]['baseline']):.3f}")
    for rank in range(2):
        if ours[rank]["sum"] != theirs[rank]["sum"] or ours[rank]["q_shape"] != theirs[rank]["q_shape"]:
            print(f"rank {rank}: WARNING the two loads hold different shards")
            met = False
    sys.exit(_common.exit_code(args.check, met))


if __name__ == "__main__":
    main()
