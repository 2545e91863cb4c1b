"""Start-up of plan-only `tpplan validate`, as a ratio to importing its two dependencies.

    python bench/bench_validate_startup.py [--runs 21] [--plan plans/mlp_tp.yaml] [--check]

Runs `python -m tpplan validate PLAN` (text output, not a terminal) and
`python -c "import yaml, pydantic"` alternately, so machine noise hits both
alike, and prints their medians and the ratio. Goal: ratio <= GOAL (--check
exits 1 above it). A ratio, not seconds, so the goal holds on any machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _common import ROOT, arguments, exit_code, median, wall_seconds, within

GOAL = 2.5


def main() -> int:
    parser = arguments(__doc__, check=f"if the ratio is above {GOAL}")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--plan", default=str(ROOT / "plans" / "mlp_tp.yaml"))
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

    validate_s, baseline_s = (median(times[k]) for k in ("validate", "baseline"))
    ratio = validate_s / baseline_s
    print(f"tpplan validate {Path(args.plan).name}: {validate_s * 1000:6.1f} ms (median of {args.runs})")
    print(f"import yaml, pydantic:  {baseline_s * 1000:6.1f} ms")
    print(f"ratio: {ratio:.2f} (goal <= {GOAL})")
    return exit_code(args.check, within(ratio, GOAL))


if __name__ == "__main__":
    sys.exit(main())
