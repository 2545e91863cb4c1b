"""One rule for the TP degrees a command works at (tpplan.core.degrees): asked for, else
the plan's mesh.sizes, else the command's own default."""

from __future__ import annotations

import pytest

from tpplan.core.degrees import DEFAULT_TP_SIZES, dividing, tp_degrees


def test_asked_beats_promised_beats_the_default_which_is_computed_only_when_needed():
    def analysis():
        raise AssertionError("the default was computed though degrees were given")

    assert tp_degrees([8, 2], [2, 4], analysis) == [8, 2]
    assert tp_degrees(3, [2, 4], analysis) == [3]
    assert tp_degrees(None, (4, 2), analysis) == [4, 2]
    assert tp_degrees(None, (), lambda: [2, 3]) == [2, 3]
    assert tp_degrees(None, None, DEFAULT_TP_SIZES) == [2, 4, 8]
    assert tp_degrees(None, ()) == []  # no default: the caller refuses (a dry run needs a degree)


def test_dividing_keeps_the_candidates_that_divide_every_known_size():
    assert dividing(DEFAULT_TP_SIZES, [32, 8, 11008]) == [2, 4, 8]
    assert dividing(DEFAULT_TP_SIZES, [12, 6, None]) == [2]  # None: a size the config does not give
    assert dividing(DEFAULT_TP_SIZES, [3]) == []


def test_the_dry_run_simulates_the_largest_promised_degree_and_memory_planning_every_one(tmp_path):
    from tpplan.core.loader import load_plan
    from tpplan.runtime.dryrun import dry_run_tp
    from tpplan.runtime.options import ApplyOptions, ApplyOptionsError

    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nmesh: {sizes: [4, 2]}\nrules:\n  blocks.*.in_proj: colwise\n")
    plan = load_plan(path)
    tp, note = dry_run_tp(ApplyOptions(plan=str(path), model="tpplan.models.mlp:tiny"), plan)
    assert (tp, note) == (4, "--tp not given: simulating TP 4, the largest of the plan's mesh.sizes [4, 2]")
    assert dry_run_tp(ApplyOptions(plan=str(path), model="tpplan.models.mlp:tiny", tp=2), plan) == (2, None)
    path.write_text("version: 1\nrules:\n  blocks.*.in_proj: colwise\n")
    with pytest.raises(ApplyOptionsError, match="needs a TP degree"):
        dry_run_tp(ApplyOptions(plan=str(path), model="tpplan.models.mlp:tiny"), load_plan(path))
