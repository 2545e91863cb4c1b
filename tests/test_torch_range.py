"""The torch range tpplan is tested with is stated once (core/torch_range.py),
equal in pyproject.toml, and a torch outside it gets one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tpplan.core.torch_range import REQUIREMENT, outside

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_requires_the_tested_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"(torch[<>=!~][^"]*)"', text) == [REQUIREMENT] == ["torch>=2.13,<2.14"]


def test_the_installed_torch_is_in_the_range():
    assert outside(torch.__version__) is None


def test_a_torch_outside_the_range_gets_one_line_naming_it():
    for version in ("2.12.1", "2.14.0", "3.0.0+cu130", "nightly"):
        line = outside(version)
        assert line == (
            f"tpplan: warning: torch {version} is outside the tested range (torch>=2.13,<2.14: torch 2.13); "
            "tpplan uses private torch APIs (_StridedShard, fake_collectives, LocalTensorMode) that may differ"
        )
    assert outside("2.13.0+cpu") is None and outside("2.13.2") is None
