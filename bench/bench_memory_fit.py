"""Which TP degrees fit 80 GiB? The Llama-3 8B and 70B shapes at seq 8192.

    python bench/bench_memory_fit.py [--models llama3_8b llama3_70b] [--plan plans/llama_tp_sp.yaml]
                                     [--seq 8192] [--fsdp N] [--limit 80GiB]

For each model: `tpplan apply --dry-run --memory-limit 80GiB` without --tp (every
degree of the plan's mesh.sizes is planned: bf16, AdamW, batch 1), one fresh
process per model; prints the per-rank peak, the share of the limit and the
verdict per degree, and the wall time of the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = _common.arguments(__doc__)
    parser.add_argument("--models", nargs="+", default=["llama3_8b", "llama3_70b"])
    parser.add_argument("--plan", default="plans/llama_tp_sp.yaml")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--fsdp", type=int)
    parser.add_argument("--limit", default="80GiB")
    args = parser.parse_args()
    from tpplan.memory.memory import parse_size

    limit = parse_size(args.limit)
    for name in args.models:
        command = [sys.executable, "-m", "tpplan", "apply", "--plan", args.plan, "--model", f"tpplan.models.llama:{name}",
                   "--dry-run", "--dtype", "bf16", "--optimizer", "adamw", "--batch", "1", "--seq", str(args.seq),
                   "--memory-limit", args.limit, "--format", "json", *(["--fsdp", str(args.fsdp)] if args.fsdp else [])]
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            print(f"{name}: the dry run failed:\n{result.stderr[-2000:]}")
            return 1
        report = json.loads(result.stdout)
        rows = report.get("memory_by_tp") or [{"tp": report["tp"], "dp": report["dp"], **report["memory"]}]
        print(f"{name}, {args.plan}, bf16, AdamW, batch 1, seq {args.seq}{f', FSDP {args.fsdp}' if args.fsdp else ''}: "
              f"limit {args.limit} ({wall:.1f} s)")
        print(f"  {'tp':>3} {'world':>6} {'peak per rank':>14} {'of limit':>9}  fits")
        for row in rows:
            peak = row["per_rank_peak_bytes"]
            if peak is None:
                print(f"  {row['tp']:>3} {row['tp'] * row['dp']:>6} {'failed':>14}  {row['problem']}")
                continue
            verdict = "yes" if row["fits"] else "no"
            print(f"  {row['tp']:>3} {row['tp'] * row['dp']:>6} {peak / 2**30:>10.2f} GiB {peak / limit:>9.2f}  {verdict}")
        memory = report["memory"]
        print(f"  reported TP {report['tp']}: peak at {memory['peak_module']}; "
              + ", ".join(f"{k} {memory[k] / 2**30:.2f} GiB" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
