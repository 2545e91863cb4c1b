"""The torch versions tpplan is tested with, and the one line a user of another
gets. tpplan uses private torch APIs (`_StridedShard`, `fake_collectives`,
`LocalTensorMode`, DTensor's sharding-propagation internals, the meta
function of `_grouped_mm` that hf/grouped_mm.py replaces) that change
between minor releases, so the range is what CI runs, not what might work.
pyproject.toml states the same range (tests/test_torch_range.py checks).

No torch here: the installed version is read from its package metadata.
"""

from __future__ import annotations

import functools
import sys

TESTED = ((2, 13), (2, 14))  # [lowest tested minor, first untested minor)
REQUIREMENT = f"torch>={TESTED[0][0]}.{TESTED[0][1]},<{TESTED[1][0]}.{TESTED[1][1]}"


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def outside(version: str) -> str | None:
    """The line to print when `version` is outside the tested range, else None."""
    minor = _minor(version)
    if minor is not None and TESTED[0] <= minor < TESTED[1]:
        return None
    tested = ", ".join(f"{major}.{m}" for major, m in _minors())
    return (
        f"tpplan: warning: torch {version} is outside the tested range ({REQUIREMENT}: torch {tested}); "
        "tpplan uses private torch APIs (_StridedShard, fake_collectives, LocalTensorMode) that may differ"
    )


def _minors() -> list[tuple[int, int]]:
    (major, low), (_, high) = TESTED
    return [(major, m) for m in range(low, high)]


@functools.cache
def warn_once() -> None:
    """Print `outside()`'s line once per process (stderr), when torch is installed and untested."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("torch")
    except PackageNotFoundError:
        return
    line = outside(installed)
    if line is not None:
        print(line, file=sys.stderr)
