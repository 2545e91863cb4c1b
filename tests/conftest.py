"""Shared fixtures. Keep this small: helpers used by one file live in that file."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tpplan import PlanError, load_plan


@pytest.fixture
def problems():
    """`problems(text)` -> [(code, line, column), ...] of loading `text` (empty when it loads)."""

    def _problems(text: str) -> list[tuple[str, int, int]]:
        try:
            load_plan(text=text)
        except PlanError as exc:
            return [(p.code, p.line, p.column) for p in exc.problems]
        return []

    return _problems


@pytest.fixture
def plan_error():
    """`plan_error(text)` -> the PlanError that loading `text` raises (fails the test if it loads)."""

    def _plan_error(text: str) -> PlanError:
        with pytest.raises(PlanError) as info:
            load_plan(text=text)
        return info.value

    return _plan_error


@pytest.fixture
def no_process_group_leaks():
    """Fails a test that leaves a process group initialized (later tests would inherit it).
    Used by the files that simulate ranks in-process: `pytestmark = pytest.mark.usefixtures(...)`."""
    yield
    assert not dist.is_initialized(), "a test left a process group behind"
