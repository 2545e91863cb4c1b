"""Start-up of plan-only `tpplan validate`, as a ratio to importing its two dependencies.

    python bench/bench_validate_startup.py [--runs 21] [--plan plans/mlp_tp.yaml] [--check]

Runs `python -m tpplan validate PLAN` (text output, not a terminal) and
`python -c "import yaml, pydantic"` alternately, so machine noise hits both
alike, and prints their medians and the ratio. Goal: ratio <= GOAL (--check
exits 1 above it). A ratio, not seconds, so the goal holds on any machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL = 2.5
ROOT = Path(__file__).resolve().parent.parent


def wall_seconds(command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--plan", default=str(ROOT / "plans" / "mlp_tp.yaml"))
    parser.add_argument("--check", action="store_true", help=f"exit 1 if the ratio is above {GOAL}")
    args = parser.parse_args()

    validate = [sys.executable, "-m", "tpplan", "validate", args.plan]
    baseline = [sys.executable, "-c", "import yaml, pydantic"]
    # Warm the file cache and write .pyc files (as pip does on install), even where
    # PYTHONDONTWRITEBYTECODE is set: otherwise edited modules compile on every run.
    writes_bytecode = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for command in (validate, baseline):
        wall_seconds(command, writes_bytecode)
    times: dict[str, list[float]] = {"validate": [], "baseline": []}
    for _ in range(args.runs):
        times["validate"].append(wall_seconds(validate))
        times["baseline"].append(wall_seconds(baseline))

    validate_s, baseline_s = (statistics.median(times[k]) for k in ("validate", "baseline"))
    ratio = validate_s / baseline_s
    print(f"tpplan validate {Path(args.plan).name}: {validate_s * 1000:6.1f} ms (median of {args.runs})")
    print(f"import yaml, pydantic:  {baseline_s * 1000:6.1f} ms")
    print(f"ratio: {ratio:.2f} (goal <= {GOAL})")
    return 1 if args.check and ratio > GOAL else 0


if __name__ == "__main__":
    sys.exit(main())
