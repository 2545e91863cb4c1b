"""The pipeline dry run of the Llama-3-405B shape at PP 16 x dp_shard 64 x TP 8 (world
8192), 1F1B, 16 microbatches of one sequence, seq 8192, bf16, AdamW, full activation
checkpointing of layers.*, FSDP2 units layers.*: wall time and peak RSS of the memory
plan, each stage's peak, and Megatron-LM's theoretical-memory formula for the same
layout beside it.

    python bench/bench_pipeline_405b.py [--exact] [--check]

One fresh process, the whole command line as a user types it: `python -m tpplan
apply --plan P --model tpplan.models.llama:llama3_405b --dry-run --world 8192
--dtype bf16 --optimizer adamw --batch 16 --seq 8192 --format json`, P extending
plans/llama_tp.yaml (no sequence parallelism: tpplan's Llama reads the sequence
length from its input, TP158) with the mesh, `fsdp`, `checkpointing` and a
`pipeline` of 16 stages cut as Llama 3's paper cut its 126 layers: one layer fewer
on the first stage (with the embeddings) and on the last (with the head), 8 on each
other. Goals: <= 10 s wall, <= 2 GiB RSS (`--check` exits 1 otherwise); `--exact`
also runs it with --no-reuse (every stage and block simulated) and requires every
figure of the two reports equal to one part in a million (the first stage's
composed blocks differ from simulating each by a few bytes, tests/test_pipeline_dryrun.py).

Megatron's formula (tpplan/memory/megatron.py) takes the first stage, bf16 weights
with fp32 main weights and Adam moments under its distributed optimizer over the 64
data-parallel ranks, and no activation checkpointing; the dry run plans tpplan's
step: AdamW's moments in bf16 under FSDP2 (sharded 64 ways), PipelineStage's receive
buffers, FSDP2's unsharded weights and gradients kept between microbatches.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent
GOAL_WALL_S, GOAL_RSS_BYTES = 10.0, 2 * 1024**3
PP, DP, TP, MICROBATCHES, SEQ = 16, 64, 8, 16, 8192


def plan_text() -> str:
    stages = [["tok_embeddings", "layers.{0..6}"], *([f"layers.{{{7 + 8 * i}..{14 + 8 * i}}}"] for i in range(14)),
              ["layers.{119..125}", "norm", "output"]]
    return (f"version: 2\nname: llama3-405b-pp-fsdp-tp\nextends: {ROOT / 'plans' / 'llama_tp.yaml'}\nrules: {{}}\n"
            f"mesh: {{pp: {PP}, dp_shard: {DP}, tp: {TP}}}\nfsdp:\n  units: [layers.*]\ncheckpointing:\n  modules: layers.*\n"
            f"pipeline:\n  stages: {json.dumps(stages)}\n  schedule: 1F1B\n  microbatches: {MICROBATCHES}\n")


def run(plan: str, *more: str) -> tuple[float, int, float, dict]:
    return _common.json_run([sys.executable, "-m", "tpplan", "apply", "--plan", plan, "--model", "tpplan.models.llama:llama3_405b",
                             "--dry-run", "--world", str(PP * DP * TP), "--dtype", "bf16", "--optimizer", "adamw",
                             "--batch", str(MICROBATCHES), "--seq", str(SEQ), "--format", "json", *more])


def largest_difference(report: dict, other: dict) -> tuple[float, float]:
    """(the largest absolute difference, the largest relative one) between two reports'
    numbers, key by key (the notes, which say how much was simulated, left out); inf
    where their keys or strings differ."""
    worst = [0.0, 0.0]

    def walk(a, b) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for key in a:
                if key != "notes":
                    walk(a[key], b[key])
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for x, y in zip(a, b):
                walk(x, y)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            worst[0] = max(worst[0], abs(a - b))
            worst[1] = max(worst[1], abs(a - b) / max(abs(a), abs(b), 1))
        elif a != b:
            worst[:] = [float("inf"), float("inf")]

    walk(report, other)
    return worst[0], worst[1]


def main() -> int:
    parser = _common.arguments(__doc__, check="when the wall time or the RSS misses its goal")
    parser.add_argument("--exact", action="store_true", help="also run with --no-reuse and require every figure equal")
    args = parser.parse_args()
    from tpplan.memory.megatron import TransformerShape, megatron_memory
    from tpplan.models.llama import LlamaConfig

    with tempfile.TemporaryDirectory() as folder:
        plan = str(Path(folder) / "llama3_405b_pp.yaml")
        Path(plan).write_text(plan_text())
        wall, rss, cpu, report = run(plan)
        whole = run(plan, "--no-reuse") if args.exact else None
    gib = 2**30
    pipeline = report["pipeline"]
    print(f"Llama-3-405B shape, pp {PP} x dp_shard {DP} x tp {TP} (world {PP * DP * TP}), 1F1B, {MICROBATCHES} microbatches "
          f"of 1 x {SEQ}, bf16, AdamW, full AC on layers.*, FSDP2 on layers.*")
    print(f"wall {wall:.1f} s ({wall / GOAL_WALL_S:.2f} of the {GOAL_WALL_S:.0f} s goal); peak RSS {rss / gib:.2f} GiB "
          f"({rss / GOAL_RSS_BYTES:.2f} of the 2 GiB goal); CPU {cpu:.1f} s; {report['notes'][0]}")
    print(f"bubble {pipeline['bubble']:.4f} (formula (p - 1)/(m + p - 1) = {(PP - 1) / (MICROBATCHES + PP - 1):.4f})")
    print(f"{'stage':>5} {'peak GiB':>9} {'in flight':>9} {'activations/mb GiB':>19} {'p2p/mb MiB':>11}  at")
    for stage in pipeline["stages"]:
        print(f"{stage['stage']:5} {stage['per_rank_peak_bytes'] / gib:9.2f} {stage['in_flight']:9} "
              f"{stage['activations'] / gib:19.3f} {stage['p2p_bytes'] / 2**20:11.0f}  {stage['peak_action']}")
    memory = report["memory"]
    print(f"worst rank: {memory['per_rank_peak_bytes'] / gib:.2f} GiB at {memory['peak_module']}: "
          + ", ".join(f"{k} {memory[k] / gib:.2f}" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")))
    cfg = LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_hidden=53248)
    shape = TransformerShape(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads, cfg.ffn_hidden, cfg.vocab_size)
    megatron = megatron_memory(shape, tp=TP, pp=PP, dp=DP, seq=SEQ, micro_batch=1, microbatches=MICROBATCHES)
    print(f"Megatron's formula (first stage): weights and optimizer {megatron.weights_and_optimizer / gib:.2f} GiB, "
          f"activations {megatron.activations / gib:.2f} GiB, total {megatron.total / gib:.2f} GiB; "
          f"the dry run's stage 0: {pipeline['stages'][0]['per_rank_peak_bytes'] / gib:.2f} GiB, its worst "
          f"{memory['per_rank_peak_bytes'] / gib:.2f} GiB")
    exact = True
    if whole is not None:
        absolute, relative = largest_difference(report, whole[3])
        exact = relative <= 1e-6
        print(f"--no-reuse: wall {whole[0]:.1f} s, peak RSS {whole[1] / gib:.2f} GiB; the largest difference of any figure "
              f"{absolute:.0f} bytes ({relative:.1e} of it){'' if exact else ': ABOVE one part in a million'}")
    return _common.exit_code(args.check, _common.within(wall, GOAL_WALL_S) and _common.within(rss, GOAL_RSS_BYTES) and exact)


if __name__ == "__main__":
    raise SystemExit(main())
