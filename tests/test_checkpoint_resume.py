"""Training that survives a killed rank (examples/train.py on torchrun gloo ranks,
lr 0.02 so that a wrong optimizer state or data position shows in the losses):

- `torchrun --max-restarts 1` with rank 1 SIGKILLed in step 13 (tests/train_killed.py,
  first attempt only) resumes from the latest step checkpoint (step 10) by itself and
  ends bitwise equal to 20 uninterrupted steps: every step's loss, the weights and
  the AdamW state of step 20;
- the same checkpoint resumed on one device (TP 1, no torchrun) follows the
  uninterrupted losses to float tolerance;
- the same with --async-save (every 5 steps): bitwise from whichever step was complete;
- (slow) 10 steps, a kill, a new job with --resume: bitwise again; resumed at TP 4 on
  4 ranks: to tolerance."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from test_torchrun import ROOT, torchrun
from tpplan import load_checkpoint

sys.path.insert(0, str(ROOT / "examples"))
import train  # noqa: E402

ARGS = ["--plan", "plans/llama_tp.yaml", "--tp", "2", "--lr", "0.02", "--steps", "20", "--save-every", "10"]


def losses(text: str) -> dict[int, str]:
    """{step: loss as printed (every digit)}; a step printed twice (a restart redid it) must agree."""
    found: dict[int, str] = {}
    for step, value in re.findall(r"^step (\d+) loss (\S+)$", text, re.MULTILINE):
        assert found.setdefault(int(step), value) == value, f"step {step}: {found[int(step)]} then {value}"
    return found


def final(root) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = train.build("tpplan.models.llama:tiny", torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    info = load_checkpoint(model, root, optimizer=optimizer)
    return {"step": info.step, "model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}


def max_diff(a: dict, b: dict) -> float:
    diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(flat(a), flat(b))]
    return max(diffs)


def flat(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in flat(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in flat(v)]
    return []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    result = torchrun(2, "examples/train.py", *ARGS, "--save", str(root), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, losses(result.stdout)


def killed_run(tmp_path, monkeypatch, *torchrun_args: str):
    monkeypatch.setenv("KILL_RANK", "1")
    monkeypatch.setenv("KILL_STEP", "13")
    root = tmp_path / "ckpt"
    return root, torchrun(2, *torchrun_args, "tests/train_killed.py", *ARGS, "--save", str(root), timeout=400)


@pytest.mark.slow  # 2 torchrun jobs (~25 s): the default suite keeps a seeded kill during a save
def test_max_restarts_resumes_a_killed_rank_bitwise_on_the_uninterrupted_run(uninterrupted, tmp_path, monkeypatch):
    want_root, want = uninterrupted
    root, result = killed_run(tmp_path, monkeypatch, "--max-restarts", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1: SIGKILL in step 13" in result.stderr
    assert f"resumed from {root} at step 10" in result.stdout
    got = losses(result.stdout)
    assert list(got) == list(range(1, 21)) and got == want  # 11 and 12 printed twice, equal
    a, b = final(want_root), final(root)
    assert a["step"] == b["step"] == 20
    assert max_diff(a, b) == 0.0 and all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))

    # The same step 10, resumed on one device (no plan, no torchrun): the same curve to float tolerance.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    one = subprocess.run([sys.executable, "examples/train.py", *ARGS, "--resume", str(root / "step-10")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    resumed = losses(one.stdout)
    assert list(resumed) == list(range(11, 21))
    worst = max(abs(float(resumed[s]) - float(want[s])) for s in resumed)
    print("one-device resume: max loss diff", worst)
    assert worst < 1e-4


@pytest.mark.slow
def test_kill_then_resume_in_a_new_job_is_bitwise_and_another_tp_degree_is_close(uninterrupted, tmp_path, monkeypatch):
    want_root, want = uninterrupted
    root, result = killed_run(tmp_path, monkeypatch)  # no restarts: the job fails
    assert result.returncode != 0 and "rank 1: SIGKILL in step 13" in result.stderr
    first = losses(result.stdout)
    again = torchrun(2, "examples/train.py", *ARGS, "--save", str(root), "--resume", str(root), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    second = losses(again.stdout)
    assert list(second) == list(range(11, 21))
    assert {**{s: v for s, v in first.items() if s <= 10}, **second} == want
    assert max_diff(final(want_root), final(root)) == 0.0
    # step 10 at TP 4 on 4 ranks
    tp4 = torchrun(4, "examples/train.py", *ARGS[:2], "--tp", "4", *ARGS[4:], "--resume", str(root / "step-10"), timeout=400)
    assert tp4.returncode == 0, tp4.stderr[-3000:]
    resumed = losses(tp4.stdout)
    worst = max(abs(float(resumed[s]) - float(want[s])) for s in resumed)
    print("TP 4 resume: max loss diff", worst)
    assert list(resumed) == list(range(11, 21)) and worst < 1e-4


@pytest.mark.slow  # 3 torchrun jobs (~25 s); the default suite keeps a seeded kill during a save (test_checkpoint_faults.py)
# and asynchronous saves loaded back bitwise (test_checkpoint_matrix.py)
def test_max_restarts_resumes_from_asynchronous_saves_bitwise(uninterrupted, tmp_path, monkeypatch):
    """--async-save: every 5 steps a save written in the background while training goes on.
    Rank 1 is killed in step 13: the restarted job resumes from the latest complete step (10,
    or 5 while step 10's write was still going on) and ends bitwise equal to the uninterrupted
    run: the staged copy holds the state of the step it was taken at."""
    want_root, want = uninterrupted
    monkeypatch.setenv("KILL_RANK", "1")
    monkeypatch.setenv("KILL_STEP", "13")
    root = tmp_path / "ckpt"
    args = [*ARGS[:-1], "5", "--async-save"]
    result = torchrun(2, "--max-restarts", "1", "tests/train_killed.py", *args, "--save", str(root), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1: SIGKILL in step 13" in result.stderr
    resumed = re.search(rf"resumed from {re.escape(str(root))} at step (\d+)", result.stdout)
    assert resumed and resumed.group(1) in ("5", "10"), result.stdout[-2000:]
    got = losses(result.stdout)
    assert list(got) == list(range(1, 21)) and got == want
    a, b = final(want_root), final(root)
    assert a["step"] == b["step"] == 20 and max_diff(a, b) == 0.0
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-10", "step-15", "step-20"]  # --keep 3
