"""simulation/forked.py: keys run in forked children while the caller works, their values
read in the order asked for; a child that fails or dies hands its key back to the parent,
which raises its error there; children left running when the caller stops are killed."""

import os
import signal
import time

import pytest

from tpplan.simulation.forked import Forked

PARENT = os.getpid()


def where(key):
    """The key and the process that ran it."""
    return key, os.getpid()


def test_keys_run_in_children_at_once_and_come_back_in_the_order_asked_for():
    with Forked(3, where) as forked:
        for key in ("a", "b", "c"):
            forked.start(key)
        assert len(forked.running) == 2 and forked.queued == ["c"]  # jobs 3: this process and two children
        found = [forked.result(key) for key in ("c", "a", "b")]
    assert [key for key, _ in found] == ["c", "a", "b"]
    assert found[0][1] == PARENT  # no child was free for "c": it ran here
    assert len({pid for _, pid in found[1:]} | {PARENT}) == 3  # "a" and "b": each its own child
    assert not forked.running


def test_one_job_runs_every_key_here_when_asked():
    with Forked(1, where) as forked:
        forked.start("a")
        assert not forked.running
        assert forked.result("a") == ("a", PARENT)


def fails_in_a_child(key):
    if os.getpid() != PARENT:
        raise ValueError("only in the child")
    return key, os.getpid()


def dies_in_a_child(key):
    if os.getpid() != PARENT:
        os.kill(os.getpid(), signal.SIGKILL)
    return key, os.getpid()


@pytest.mark.parametrize("run", [fails_in_a_child, dies_in_a_child], ids=["raises", "killed"])
def test_a_child_that_fails_or_dies_hands_its_key_back_to_the_parent(run):
    with Forked(2, run) as forked:
        forked.start("a")
        assert "a" in forked.running
        assert forked.result("a") == ("a", PARENT)


def always_fails(key):
    raise ValueError(f"{key} fails")


def test_an_error_is_raised_by_the_parent_as_without_children():
    with Forked(2, always_fails) as forked:
        forked.start("a")
        with pytest.raises(ValueError, match="a fails"):
            forked.result("a")


def sleeps(key):
    time.sleep(60)
    return key


def test_children_still_running_when_the_caller_stops_are_killed_and_reaped():
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        with Forked(2, sleeps) as forked:
            forked.start("a")
            (pid, _), = forked.running.values()
            raise RuntimeError("the caller stops")
    assert time.monotonic() - started < 30
    with pytest.raises(ChildProcessError):  # reaped: no longer this process's child
        os.waitpid(pid, os.WNOHANG)
