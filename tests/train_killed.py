"""examples/train.py, with rank $KILL_RANK SIGKILLing itself in its optimizer step
number $KILL_STEP, on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0):
what a preempted or OOM-killed rank looks like to the job."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def arm(rank: int, step: int) -> None:
    original = torch.optim.AdamW.step
    calls = [0]

    def step_then_maybe_die(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            print(f"rank {rank}: SIGKILL in step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step_then_maybe_die


if __name__ == "__main__":
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and os.environ.get("RANK") == os.environ["KILL_RANK"]:
        arm(int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"]))
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
