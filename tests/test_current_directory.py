"""What the user names by `MODULE:ATTRIBUTE` (`--model`, `--inputs`, a plan's
`style: PKG.MOD:Class`) is found in the current directory, as `python -m tpplan`
finds it, also when the directory is not on sys.path: the `tpplan` console
script puts its bin/ directory there, not the one it runs in (as `python -P`
does here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpplan import load_plan
from tpplan.simulation.modelref import load_callable
from tpplan.sharding.compile import style_class

ROOT = Path(__file__).resolve().parent.parent

MODELS = """
    import torch
    from torch import nn


    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))


    def build():
        return Pair()


    def inputs():
        return torch.randn(2, 3, 16)
"""

STYLES = """
    from torch.distributed.tensor.parallel import ColwiseParallel


    class MyStyle(ColwiseParallel):
        pass
"""


def plan_text(styles: str) -> str:
    return f"version: 1\nrules:\n  up: {{style: {styles}:MyStyle, like: colwise}}\n  down: rowwise\n"


def write(directory: Path, **files: str) -> None:
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))


def test_the_console_entry_point_finds_model_inputs_and_style_in_the_current_directory(tmp_path):
    write(tmp_path, **{"mymodels.py": MODELS, "mystyles.py": STYLES, "plan.yaml": plan_text("mystyles")})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-P", "-c", "from tpplan.cli.app import main; main()", "apply", "--dry-run", "--tp", "2",
               "--model", "mymodels:build", "--inputs", "mymodels:inputs", "--plan", "plan.yaml", "--format", "json"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["modules"] == {"up": "mystyles:MyStyle", "down": "rowwise"}
    assert report["parameters"]["up.weight"]["local_shapes"] == [[16, 16], [16, 16]]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The current directory is tmp_path, which sys.path does not name (nor "")."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("option", ["--model", "--inputs"])
def test_a_model_or_inputs_reference_imports_from_the_current_directory(elsewhere, monkeypatch, option):
    name = f"cwd_models_{option.strip('-')}"
    write(elsewhere, **{f"{name}.py": MODELS})
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert load_callable(f"{name}:build", option).__module__ == name
    assert sys.path[0] == str(elsewhere)


def test_a_plan_style_class_imports_from_the_current_directory(elsewhere, monkeypatch):
    write(elsewhere, **{"cwd_styles.py": STYLES})
    monkeypatch.delitem(sys.modules, "cwd_styles", raising=False)
    (elsewhere / "plan.yaml").write_text(plan_text("cwd_styles"))
    [rule] = [r for r in load_plan(elsewhere / "plan.yaml").rules if r.pattern == "up"]
    assert style_class(rule.spec).__module__ == "cwd_styles"
