"""Memory planning of the Llama-3-405B shape at TP 8 x FSDP 16 (version 1 plan and
--fsdp), or (--v2) of a version 2 plan at dp_replicate 8 x dp_shard 16 x cp 2 x tp 8
with activation checkpointing (world 2048, seq 32768): wall time, peak RSS, and the
parameters per rank against the value computed by hand.

    python bench/bench_memory_405b.py [--plan plans/llama_tp_sp.yaml] [--check]
    python bench/bench_memory_405b.py --v2 [--cp 2] [--exact] [--jobs N] [--check]

One fresh process, the whole command line as a user types it:
`python -m tpplan apply --plan P --model tpplan.models.llama:llama3_405b
--dry-run --tp 8 --fsdp 16 --dtype bf16 --optimizer adamw --batch 1 --seq 8192
--format json` (world 128 on fake tensors); with --v2, `--world 1024·cp`, `--seq
32768` and a plan that extends P with the mesh, `fsdp: {units: [layers.*]}`,
`checkpointing: {modules: layers.*}` and `context_parallel: {modules:
layers.*.attention}` instead of --fsdp (HSDP: FSDP2 replicates over dp_replicate,
shards over dp_shard·cp; each rank runs torch's ring attention on its 32768 / cp
tokens, simulated as on CUDA; its two positions, one per cp index, simulated at once:
`--jobs` is one per CPU, and cp 1's position runs in a forked child beside rank 0's). Peak
RSS is the largest of that process and its children (wait4). Goals: <= 60 s
wall (--v2: the issue's 10 s), <= 2 GiB RSS, parameters per rank exact (`--check`
exits 1 otherwise); `--exact` also runs it with --no-reuse (every block simulated)
and requires every figure of the two reports to be equal.

The expected parameters per rank, by hand: the plan shards every weight over
tp 8 (wq/wk/wv/w1/w3 and the head by rows, wo/w2 by columns, the embedding by
rows), norms stay whole on tp; FSDP2 then splits dim 0 of each local tensor
over dp 16 (--v2: dp_shard 16 · cp; dp_replicate's replicas hold the same). Every
such dim divides evenly, so a rank holds (all non-norm elements) / (8 · dp) + (norm
elements) / dp, in bf16 (2 bytes).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent
GOAL_WALL_S, GOAL_V2_WALL_S, GOAL_RSS_BYTES = 60.0, 10.0, 2 * 1024**3
TP, DP, BF16 = 8, 16, 2


def expected_parameter_bytes(dp: int = DP) -> int:
    from tpplan.models.llama import LlamaConfig

    # Llama 3.1 405B, as published (tpplan.models.llama:llama3_405b builds the same)
    cfg = LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_hidden=53248)
    head_dim = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * cfg.n_kv_heads * head_dim  # wq, wo; wk, wv
    feed_forward = 3 * cfg.dim * cfg.ffn_hidden
    sharded = 2 * cfg.vocab_size * cfg.dim + cfg.n_layers * (attention + feed_forward)
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    # every sharded dim divides: rows of wq (16384/8/dp), wk/wv (1024/8/dp), w1/w3 (53248/8/dp),
    # embedding and head (128256/8/dp); columns of wo/w2 over tp, then their rows over dp.
    for rows in (cfg.dim, cfg.n_kv_heads * head_dim, cfg.ffn_hidden, cfg.vocab_size):
        assert rows % (TP * dp) == 0, rows
    assert sharded % (TP * dp) == 0 and cfg.dim % dp == 0
    return BF16 * (sharded // (TP * dp) + norms // dp)


V2_PLAN = """version: 2
name: llama3-405b-hsdp-tp-ac
extends: {parent}
rules: {{}}
mesh:
  dp_replicate: 8
  dp_shard: 16
  cp: {cp}
  tp: 8
fsdp:
  units: [layers.*]
checkpointing:
  modules: layers.*
"""
CONTEXT_PARALLEL = """context_parallel:
  modules: layers.*.attention
"""
V2_SEQ = 32768


def one_run(plan: str, cp: int | None, *more: str) -> tuple[float, int, float, dict]:
    """(wall seconds, peak RSS bytes, CPU seconds, the JSON report) of the dry run in a fresh
    process; `cp`: the v2 world's (None: version 1 and --fsdp)."""
    world = ["--world", str(8 * DP * cp * TP), "--seq", str(V2_SEQ)] if cp else ["--tp", str(TP), "--fsdp", str(DP), "--seq", "8192"]
    return _common.json_run([sys.executable, "-m", "tpplan", "apply", "--plan", plan, "--model", "tpplan.models.llama:llama3_405b",
                             "--dry-run", *world, "--dtype", "bf16", "--optimizer", "adamw", "--batch", "1", "--format", "json", *more])


def figures(report: dict) -> dict:
    """Every figure of a report but what names the reuse (the reused blocks, the notes)."""
    found = json.loads(json.dumps(report))
    del found["memory"]["block_reuse"], found["notes"]
    for rank in found.get("ranks", ()):
        del rank["memory"]["block_reuse"]
    return found


def main() -> int:
    parser = _common.arguments(__doc__, check="when the wall time, the RSS or the parameters per rank miss their goal")
    parser.add_argument("--plan", default="plans/llama_tp_sp.yaml")
    parser.add_argument("--v2", action="store_true", help="a version 2 plan: dp_replicate 8 x dp_shard 16 x cp 2 x tp 8, checkpointing on")
    parser.add_argument("--cp", type=int, default=2, help="--v2's context-parallel degree (1: none)")
    parser.add_argument("--exact", action="store_true", help="also run with --no-reuse and require every figure equal")
    parser.add_argument("--jobs", type=int, help="the dry run's --jobs (default: its own, one per CPU; 1: every position in one process)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        plan, cp = args.plan, args.cp if args.v2 else None
        if cp:
            plan = str(Path(folder) / "llama3_405b_v2.yaml")
            Path(plan).write_text(V2_PLAN.format(parent=(ROOT / args.plan).resolve(), cp=cp) + (CONTEXT_PARALLEL if cp > 1 else ""))
        jobs = ("--jobs", str(args.jobs)) if args.jobs else ()
        wall, rss, cpu, report = one_run(plan, cp, *jobs)
        whole = one_run(plan, cp, "--no-reuse", *jobs) if args.exact else None
    memory = report["memory"]
    want = expected_parameter_bytes(DP * (cp or 1))
    goal_wall = GOAL_V2_WALL_S if cp else GOAL_WALL_S
    got = memory["after_step"]["parameters"]
    gib = 2**30
    where = (f"dp_replicate 8 x dp_shard {DP} x cp {cp} x tp {TP} (world {8 * DP * cp * TP}), checkpointing layers.*, "
             f"seq {V2_SEQ}" if cp else f"TP {TP} x FSDP {DP} (world 128), seq 8192")
    print(f"Llama-3-405B shape, {args.plan}, {where}, bf16, AdamW, batch 1")
    print(f"wall {wall:.1f} s ({wall / goal_wall:.2f} of the {goal_wall:.0f} s goal); "
          f"peak RSS {rss / gib:.2f} GiB ({rss / GOAL_RSS_BYTES:.2f} of the 2 GiB goal); CPU {cpu:.1f} s, its forked "
          f"positions' included (--jobs {args.jobs or 'one per CPU'})")
    print(f"parameters per rank: {got} bytes, by hand {want} ({'exact' if got == want else f'off by {got - want}'})")
    print(f"per-rank peak {memory['per_rank_peak_bytes'] / gib:.2f} GiB at {memory['peak_module']}: "
          + ", ".join(f"{k} {memory[k] / gib:.2f} GiB" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")))
    if "ranks" in report:
        print(f"positions simulated: {len(report['ranks'])} of {report['world_size']} ranks")
    if "comms_by_axis" in report:
        print("collectives per axis per rank per step: " + json.dumps(report["comms_by_axis"]))
    else:
        print("bytes per rank per step: " + json.dumps(report["comm_bytes"]))
    exact = True
    if whole is not None:
        exact = figures(report) == figures(whole[3])
        print(f"--no-reuse: wall {whole[0]:.1f} s, CPU {whole[2]:.1f} s, peak RSS {whole[1] / gib:.2f} GiB; "
              f"every figure {'equal' if exact else 'DIFFERENT'}")
    ok = _common.within(wall, goal_wall) and _common.within(rss, GOAL_RSS_BYTES) and got == want and exact
    return _common.exit_code(args.check, ok)


if __name__ == "__main__":
    raise SystemExit(main())
