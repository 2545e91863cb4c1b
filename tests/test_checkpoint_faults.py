"""Crash safety under fault injection: torchrun gloo jobs save a training checkpoint
after every step while one rank SIGKILLs itself at a seeded random point of a save
(tests/ckpt_fault_worker.py: a tensor item written, an fsync, a rename, the
exchange, a removal, a barrier, a broadcast; the victim and the save drawn too).
After each trial the root's latest complete checkpoint must load, on one process,
equal to the full state rank 0 recorded at that step (weights, AdamW state, extra),
every step directory left must load equal to its step or not at all, and the next
save must remove what the killed one left. One trial runs by default, 25 more with -m slow
(TP on 2 ranks, FSDP x TP on 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from test_torchrun import ROOT, torchrun
from tpplan import CheckpointError, load_checkpoint, save_checkpoint

sys.path.insert(0, str(ROOT / "examples"))
import train  # noqa: E402

CONFIGS = {"tp": (2, 2), "fsdp-tp": (4, 2)}  # (ranks, tp): dp = ranks / tp, FSDP2 on dp when > 1


def fresh():
    model = train.build("tpplan.models.llama:tiny", torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def equal(a, b, where: str = "") -> list[str]:
    """The places where two nested states differ (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def loaded(path, truths: Path) -> tuple[int, list[str], dict]:
    """(step, differences from the truth of that step, extra) of loading `path` on one process."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = fresh()
    info = load_checkpoint(model, path, optimizer=optimizer)
    truth = torch.load(truths / f"step-{info.step}.pt", weights_only=False)
    got = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    return info.step, equal(got, truth), info.extra


def trial(tmp_path: Path, config: str, seed: int) -> dict:
    ranks, tp = CONFIGS[config]
    root, truth = tmp_path / "ckpt", tmp_path / "truth"
    truth.mkdir()
    result = torchrun(ranks, "tests/ckpt_fault_worker.py", str(root), "--truth", str(truth), "--seed", str(seed), "--tp", str(tp), timeout=300)
    killed = "SIGKILL at event" in result.stderr
    assert killed and result.returncode != 0, (result.returncode, result.stderr[-3000:])
    step, differences, extra = loaded(root, truth)  # the latest complete checkpoint
    outcome = {"killed": [line for line in result.stderr.splitlines() if "SIGKILL at event" in line][0], "latest": step,
               "wrong": bool(differences) or extra["step"] != step, "steps": {}}
    for directory in sorted(root.glob("step-*")):  # the others: equal to their step, or refused
        try:
            s, differences, extra = loaded(directory, truth)
            outcome["steps"][directory.name] = "wrong" if differences or extra["step"] != s else "equal"
        except CheckpointError as exc:
            outcome["steps"][directory.name] = exc.problems[0].code
    model, optimizer = fresh()
    load_checkpoint(model, root, optimizer=optimizer)
    save_checkpoint(model, root, step=step + 10, keep=2, optimizer=optimizer)  # the next save cleans up
    outcome["left_behind"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".step-"))
    return outcome


def check(outcome: dict) -> None:
    assert not outcome["wrong"], outcome
    assert "wrong" not in outcome["steps"].values(), outcome
    spares = [name for name in outcome["left_behind"] if ".spare-" in name]  # the copy the next save overwrites
    assert len(spares) <= 1 and [name for name in outcome["left_behind"] if name not in spares] == [], outcome


@pytest.mark.parametrize("seed", [0, pytest.param(8, marks=pytest.mark.slow)])  # a tensor write on rank 1; a late commit step on rank 0
def test_a_rank_killed_during_a_save_leaves_the_latest_checkpoint_loadable_and_equal(tmp_path, seed):
    outcome = trial(tmp_path, "tp", seed)
    print(seed, outcome)
    check(outcome)


@pytest.mark.slow
def test_twenty_four_seeded_kills_on_tp_and_fsdp_by_tp(tmp_path):
    outcomes = []
    for i in range(24):
        config = "tp" if i % 2 == 0 else "fsdp-tp"
        directory = tmp_path / f"trial-{i}"
        directory.mkdir()
        outcomes.append((config, i, trial(directory, config, 100 + i)))
    for config, i, outcome in outcomes:
        print(config, 100 + i, outcome)
    loadable = sum(1 for *_, o in outcomes if not o["wrong"])
    wrong = sum(1 for *_, o in outcomes if o["wrong"] or "wrong" in o["steps"].values())
    print(f"fault trials: {len(outcomes)}, loadable latest: {loadable}, loaded wrong: {wrong}")
    for *_, outcome in outcomes:
        check(outcome)
