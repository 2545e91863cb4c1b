"""What every bench script shares: its command line, timing, medians, the goal check, the exit code.

The scripts run as `python bench/NAME.py` (this folder is then first on sys.path)
and `import _common`. They import torch, transformers and tpplan's runtime inside
the functions that need them, so `--help` answers at once (tests/test_bench.py
runs `--help` of every script).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


def arguments(doc: str, check: str | None = None) -> argparse.ArgumentParser:
    """A parser whose --help is the script's docstring; `check` (what is missed)
    adds `--check`: exit 1 when a goal is missed."""
    summary, _, details = doc.strip().partition("\n")
    parser = argparse.ArgumentParser(
        description=summary, epilog=details.strip() or None, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if check is not None:
        parser.add_argument("--check", action="store_true", help=f"exit 1 {check}")
    return parser


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """What one call returns, and its wall seconds."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    return timed(fn)[1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    """The median wall seconds of `runs` calls."""
    return median([seconds(fn) for _ in range(runs)])


def wall_seconds(command: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of a whole process; a failing command ends the bench with its error."""
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr}")
    return elapsed


def json_run(command: list[str]) -> tuple[float, int, float, dict]:
    """(wall seconds, peak RSS bytes, CPU seconds, the JSON it prints) of one fresh process
    (from wait4: its CPU with that of the children it waited for, a dry run's forked positions,
    and the largest RSS of any of them); a failing command ends the bench with its error."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{' '.join(command)} failed:\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime, json.loads(out.read())


def within(value: float, goal: float) -> bool:
    """The goal check: at most the goal."""
    return value <= goal


def exit_code(check: bool, goals_met: bool) -> int:
    """1 when --check was given and a goal is missed, else 0."""
    return 1 if check and not goals_met else 0
