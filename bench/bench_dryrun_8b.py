"""`tpplan apply --dry-run --tp 8` of a Llama-3-8B-shaped decoder: wall time and peak RSS.

    python bench/bench_dryrun_8b.py [--runs 3] [--tp 8] [--plan plans/llama_tp_sp.yaml ...] [--check]

Each run is the whole command line as a user types it, in a fresh process
(`python -m tpplan apply --plan P --model tpplan.models.llama:llama3_8b
--dry-run --tp 8 --format json`): import, meta-device build of 32 layers (dim
4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256; 8.03e9 parameters, 29.9
GiB in float32), sharding under the fake process group, one forward and
backward with collective counting, and the report. Peak RSS is that process's
own (wait4), so the bench's own memory does not count. Goals: <= 60 s wall and
<= 2 GiB peak RSS per run (--check exits 1 above either).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, arguments, exit_code, median, within

GOAL_WALL_S = 60.0
GOAL_RSS_BYTES = 2 * 1024**3
MODEL = "tpplan.models.llama:llama3_8b"


def one_run(plan: str, tp: int) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, the JSON report) of one dry run in a fresh process."""
    command = [sys.executable, "-m", "tpplan", "apply", "--plan", plan, "--model", MODEL, "--dry-run", "--tp", str(tp), "--format", "json"]
    # Output to files, not pipes: the child is reaped with wait4 (its own rusage), which
    # Popen.communicate would do first with plain wait.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {process.returncode}:\n{stdout}\n{stderr}")
    return wall, usage.ru_maxrss * 1024, json.loads(stdout)  # ru_maxrss: KiB on Linux


def main() -> int:
    parser = arguments(__doc__, check="when a goal is missed")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--plan", action="append", help="default: plans/llama_tp.yaml and plans/llama_tp_sp.yaml")
    args = parser.parse_args()
    plans = args.plan or ["plans/llama_tp.yaml", "plans/llama_tp_sp.yaml"]

    print(f"tpplan apply --dry-run --tp {args.tp} --model {MODEL}  ({os.cpu_count()} CPUs, {args.runs} runs each)")
    missed = False
    for plan in plans:
        walls, peaks = [], []
        for _ in range(args.runs):
            wall, peak, report = one_run(plan, args.tp)
            walls.append(wall)
            peaks.append(peak)
        comms = report["comms"]
        params = report["params"]
        print(f"\n{plan}")
        print(f"  wall      median {median(walls):6.2f} s   max {max(walls):6.2f} s   (goal <= {GOAL_WALL_S:.0f} s)")
        print(f"  peak RSS  median {median(peaks) / 2**20:6.0f} MiB max {max(peaks) / 2**20:6.0f} MiB (goal <= {GOAL_RSS_BYTES / 2**30:.0f} GiB)")
        print(f"  params    total {params['total_bytes']} B ({params['total_bytes'] / 2**30:.2f} GiB), per rank {params['per_rank_bytes']} B ({params['per_rank_bytes'] / 2**30:.2f} GiB)")
        print(f"  comms     forward {comms['forward']}  backward {comms['backward']}")
        missed |= not (within(max(walls), GOAL_WALL_S) and within(max(peaks), GOAL_RSS_BYTES))
    print("\ngoals " + ("MISSED" if missed else "met"))
    return exit_code(args.check, not missed)


if __name__ == "__main__":
    sys.exit(main())
