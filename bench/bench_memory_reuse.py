"""Memory planning with repeated blocks simulated once against `--no-reuse` (every block):
wall, CPU, peak RSS, their ratio, and whether every figure of the report agrees.

    python bench/bench_memory_reuse.py [--shapes 8b 405b] [--check]

Each run is one fresh process, the whole command line as a user types it:
`python -m tpplan apply --plan plans/llama_tp_sp.yaml --model tpplan.models.llama:llama3_8b
--dry-run --tp 8 --dtype bf16 --optimizer adamw --batch 1 --seq 8192 --format json`
(8b: 32 layers at TP 8; 405b: 126 layers at TP 8 x FSDP 16, world 128), once with reuse
and once with `--no-reuse`. The figures compared: the per-rank peak and its categories,
the peak module, what stays after the step, collective counts and bytes, modules and
parameters (`memory.block_reuse` and `notes` aside); the largest difference is printed
in bytes. Goals: 405b with reuse <= 20 s wall, every figure equal (`--check` exits 1
otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import _common

SHAPES = {
    "8b": ("tpplan.models.llama:llama3_8b", ["--tp", "8"]),
    "405b": ("tpplan.models.llama:llama3_405b", ["--tp", "8", "--fsdp", "16"]),
}
GOAL_405B_S = 20.0


def one_run(model: str, degrees: list[str], reuse: bool) -> tuple[float, float, int, dict]:
    """(wall s, CPU s, peak RSS bytes, JSON report) of one dry run in a fresh process."""
    command = [sys.executable, "-m", "tpplan", "apply", "--plan", "plans/llama_tp_sp.yaml", "--model", model, "--dry-run",
               *degrees, "--dtype", "bf16", "--optimizer", "adamw", "--batch", "1", "--seq", "8192", "--format", "json",
               *([] if reuse else ["--no-reuse"])]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=_common.ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{err.read()[-3000:]}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, json.loads(out.read())


def largest_difference(a, b, path: str = "") -> tuple[float, str]:
    """The largest absolute difference between two JSON values, and where (inf: not the same keys or kinds)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return float("inf"), f"{path} keys {sorted(set(a) ^ set(b))[:3]}"
        return max((largest_difference(a[k], b[k], f"{path}.{k}") for k in a), default=(0.0, ""), key=lambda found: found[0])
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return float("inf"), f"{path} length"
        return max((largest_difference(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))), default=(0.0, ""), key=lambda found: found[0])
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return (float(abs(a - b)), path) if a != b else (0.0, "")
    return (0.0, "") if a == b else (float("inf"), path)


def main() -> int:
    parser = _common.arguments(__doc__, check="when 405b misses 20 s or a figure differs")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["8b", "405b"])
    args = parser.parse_args()
    ok = True
    for shape in args.shapes:
        model, degrees = SHAPES[shape]
        reused, whole = one_run(model, degrees, True), one_run(model, degrees, False)
        reports = []
        for wall, cpu, rss, report in (reused, whole):
            stripped = dict(report)
            stripped["memory"] = {k: v for k, v in report["memory"].items() if k != "block_reuse"}
            stripped.pop("notes")
            reports.append(stripped)
        diff, where = largest_difference(*reports)
        block = reused[3]["memory"]["block_reuse"]
        print(f"{shape} ({' '.join(degrees)}): reuse {reused[0]:.1f} s wall, {reused[1]:.1f} s CPU, {reused[2] / 2**30:.2f} GiB RSS; "
              f"--no-reuse {whole[0]:.1f} s wall, {whole[1]:.1f} s CPU, {whole[2] / 2**30:.2f} GiB RSS; "
              f"wall ratio {reused[0] / whole[0]:.2f}, CPU ratio {reused[1] / whole[1]:.2f}")
        print(f"  reused: {', '.join(block['reused'][:1] + block['reused'][-1:]) if block else 'nothing'} "
              f"from {block and block['from']}; largest difference {diff:g} ({where or 'none'}); "
              f"peak {reused[3]['memory']['per_rank_peak_bytes'] / 2**30:.2f} GiB at {reused[3]['memory']['peak_module']}")
        ok = ok and diff == 0 and (shape != "405b" or _common.within(reused[0], GOAL_405B_S))
    return _common.exit_code(args.check, ok)


if __name__ == "__main__":
    raise SystemExit(main())
