"""Every bench script answers --help at once (no torch imported for it) and shares bench/_common.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("bench_*.py"))


def test_every_bench_script_is_found():
    assert "bench_validate_startup.py" in SCRIPTS and len(SCRIPTS) >= 6


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_help(script):
    result = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ")
    assert "import _common" in (BENCH / script).read_text() or "from _common import" in (BENCH / script).read_text()


def test_the_goal_check_exits_1_only_when_checked_and_missed():
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    assert [_common.exit_code(check, met) for check, met in ((True, False), (True, True), (False, False))] == [1, 0, 0]
    assert _common.within(2.5, 2.5) and not _common.within(2.51, 2.5)
    assert _common.median([3.0, 1.0, 2.0]) == 2.0
    assert _common.timed(lambda: 7)[0] == 7
