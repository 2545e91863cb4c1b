"""torch as the user meets it: the range tpplan is tested with is stated once
(core/torch_range.py), equal in pyproject.toml, a torch outside it gets one
clear line, and torch's own logs stay off a run that succeeds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.slow  # ~15 s: a subprocess builds and probes the MoE model
def test_import_hf_of_a_moe_model_prints_no_torch_log(tmp_path):
    pytest.importorskip("transformers")
    # its per-head-norm probe runs the model on fake tensors (its experts' grouped_mm
    # in float32: hf.grouped_mm): a fake kernel that failed would log a traceback
    result = subprocess.run(
        [sys.executable, "-m", "tpplan", "import-hf", "qwen3_moe", "-o", str(tmp_path / "plan.yaml")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == ["left out"] * 3 + ["added"] * 2
