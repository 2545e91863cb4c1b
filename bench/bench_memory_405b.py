"""Memory planning of the Llama-3-405B shape at TP 8 x FSDP 16: wall time, peak RSS,
and the parameters per rank against the value computed by hand.

    python bench/bench_memory_405b.py [--plan plans/llama_tp_sp.yaml] [--check]

One fresh process, the whole command line as a user types it:
`python -m tpplan apply --plan P --model tpplan.models.llama:llama3_405b
--dry-run --tp 8 --fsdp 16 --dtype bf16 --optimizer adamw --batch 1 --seq 8192
--format json` (world 128 on fake tensors). Peak RSS is that process's own
(wait4). Goals: <= 60 s wall, <= 2 GiB RSS, parameters per rank exact
(`--check` exits 1 otherwise).

The expected parameters per rank, by hand: the plan shards every weight over
tp 8 (wq/wk/wv/w1/w3 and the head by rows, wo/w2 by columns, the embedding by
rows), norms stay whole on tp; FSDP2 then splits dim 0 of each local tensor
over dp 16. Every such dim divides evenly, so a rank holds
(all non-norm elements) / 128 + (norm elements) / 16, in bf16 (2 bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent
GOAL_WALL_S, GOAL_RSS_BYTES = 60.0, 2 * 1024**3
TP, DP, BF16 = 8, 16, 2


def expected_parameter_bytes() -> int:
    from tpplan.models.llama import LlamaConfig

    # Llama 3.1 405B, as published (tpplan.models.llama:llama3_405b builds the same)
    cfg = LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_hidden=53248)
    head_dim = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * cfg.n_kv_heads * head_dim  # wq, wo; wk, wv
    feed_forward = 3 * cfg.dim * cfg.ffn_hidden
    sharded = 2 * cfg.vocab_size * cfg.dim + cfg.n_layers * (attention + feed_forward)
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    # every sharded dim divides: rows of wq (16384/8/16), wk/wv (1024/8/16), w1/w3 (53248/8/16),
    # embedding and head (128256/8/16); columns of wo/w2 over tp, then their rows over dp.
    for rows in (cfg.dim, cfg.n_kv_heads * head_dim, cfg.ffn_hidden, cfg.vocab_size):
        assert rows % (TP * DP) == 0, rows
    assert sharded % (TP * DP) == 0 and cfg.dim % DP == 0
    return BF16 * (sharded // (TP * DP) + norms // DP)


def one_run(plan: str) -> tuple[float, int, float, dict]:
    """(wall seconds, peak RSS bytes, CPU seconds, the JSON report) of the dry run in a fresh process."""
    command = [sys.executable, "-m", "tpplan", "apply", "--plan", plan, "--model", "tpplan.models.llama:llama3_405b",
               "--dry-run", "--tp", str(TP), "--fsdp", str(DP), "--dtype", "bf16", "--optimizer", "adamw",
               "--batch", "1", "--seq", "8192", "--format", "json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"the dry run failed:\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime, json.loads(out.read())


def main() -> int:
    parser = _common.arguments(__doc__, check="when the wall time, the RSS or the parameters per rank miss their goal")
    parser.add_argument("--plan", default="plans/llama_tp_sp.yaml")
    args = parser.parse_args()
    wall, rss, cpu, report = one_run(args.plan)
    memory = report["memory"]
    want = expected_parameter_bytes()
    got = memory["after_step"]["parameters"]
    gib = 2**30
    print(f"Llama-3-405B shape, {args.plan}, TP {TP} x FSDP {DP} (world 128), bf16, AdamW, batch 1, seq 8192")
    print(f"wall {wall:.1f} s ({wall / GOAL_WALL_S:.2f} of the {GOAL_WALL_S:.0f} s goal); "
          f"peak RSS {rss / gib:.2f} GiB ({rss / GOAL_RSS_BYTES:.2f} of the 2 GiB goal); CPU {cpu:.1f} s "
          "(wall above CPU: other processes share the cores)")
    print(f"parameters per rank: {got} bytes, by hand {want} ({'exact' if got == want else f'off by {got - want}'})")
    print(f"per-rank peak {memory['per_rank_peak_bytes'] / gib:.2f} GiB at {memory['peak_module']}: "
          + ", ".join(f"{k} {memory[k] / gib:.2f} GiB" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")))
    print("bytes per rank per step: " + json.dumps(report["comm_bytes"]))
    ok = _common.within(wall, GOAL_WALL_S) and _common.within(rss, GOAL_RSS_BYTES) and got == want
    return _common.exit_code(args.check, ok)


if __name__ == "__main__":
    raise SystemExit(main())
