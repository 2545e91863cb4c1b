"""One training step of the whole model, composed from two truncated ones.

A model whose run of identical blocks is cut to 2 blocks (A: first, last) and to
3 (B: first, template, last) differs from the whole model only in the blocks
left out of B: copies of the template, between it and the last block. Each
copy adds what the template adds, so every moment of the whole step is a
moment of B with some copies' worth of memory added:

- before the template's forward (embedding, the run's first block): the copies'
  parameters and optimizer state (`start`: B minus A when the step starts);
- in the template's forward: that, plus 0 to M copies' forward (the copies run
  after it, each one forward higher: `forward` is B minus A when the loss is
  computed); the highest is the template itself or the last copy;
- from the block after the template to its backward: M x `forward`;
- in the template's backward: from M x `forward` (the last copy's backward comes
  first) to M x `backward` (the template's own, last);
- after it: M x `backward`; the optimizer step (and the state's first step
  before the measured one) grow as the two runs do, linearly.

`Timeline` records the highest moment of each of these regions of B (and the
marks of A and B); `compose` adds the copies and takes the highest.
Collectives and what stays after the step are linear in the copies. The
composed peak is that of the whole simulation exactly when the blocks are
identical (tests/test_reuse.py compares them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .memory import StepMemory, _categories, _peak_module
from .memory_report import CATEGORIES

if TYPE_CHECKING:
    from .memory import PlannedStep
    from .reuse import BlockReuse

STAGES = ("before", "template forward", "between", "template backward", "after")
Mem = dict[str, int]  # CATEGORIES and "total"


class CompositionError(ValueError):
    """The truncated runs do not compose (the blocks did not run in order): simulate the whole model."""


def _mem(found: tuple[int, dict[str, int]]) -> Mem:
    return {**found[1], "total": found[0]}


def _plus(x: Mem, y: Mem, times: int = 1) -> Mem:
    return {key: x[key] + times * y[key] for key in x}


def _minus(x: Mem, y: Mem) -> Mem:
    return {key: x[key] - y[key] for key in x}


class Timeline:
    """The highest memory of each region of one measured step, and the memory
    where it starts, where the loss is computed and where backward ends.

    `template`, `after_template` and `before_template` are block fqns (B's
    template, the block that follows it in forward, the one that follows it in
    backward); without them the step is one region ("step")."""

    def __init__(self, template: str | None = None, after_template: str | None = None, before_template: str | None = None):
        self.blocks = (template, after_template, before_template)
        self.root = ""
        self.stage = 0
        self.started = False
        self.highest: dict[str, tuple[Mem, list[str], str]] = {}  # region -> (memory, active modules, phase)
        self.marks: dict[str, Mem] = {}

    def begin(self, root: str) -> None:
        """The name torch's module tracker gives the model (its class): block fqns are under it."""
        self.root = root
        self.names = tuple(f"{root}.{b}" if b else None for b in self.blocks)

    def mark(self, name: str, found: tuple[int, dict[str, int]]) -> None:
        self.marks[name] = _mem(found)
        self.started = self.started or name == "start"

    def observe(self, tracker: Any) -> None:
        """After every op (torch's tracker calls it with itself)."""
        total = sum(snapshot["Total"] for snapshot in tracker._curr_mem_snap.values())
        modules = tracker._mod_tracker
        region = self._region(modules.parents, modules.is_bw, tracker._in_opt)
        best = self.highest.get(region)
        if best is None or total > best[0]["total"]:
            phase = "optimizer step" if tracker._in_opt else "backward" if modules.is_bw else "forward"
            self.highest[region] = (_mem(_categories(tracker._curr_mem_snap)), list(modules.parents), phase)

    def _region(self, parents: set[str], backward: bool, optimizer: bool) -> str:
        if not self.started:
            return "init"  # the optimizer state's first step, before the measured one
        if optimizer:
            return "optimizer"
        template, after, before = self.names
        if template is None:
            return "step"
        entered = (not backward and template in parents, not backward and after in parents,
                   backward and template in parents, backward and before in parents)
        if self.stage < 4 and entered[self.stage]:
            self.stage += 1
        return STAGES[self.stage]


def compose(reuse: "BlockReuse", short: tuple["PlannedStep", Timeline], long: tuple["PlannedStep", Timeline]) -> "PlannedStep":
    """The whole model's step from A (`short`, 2 blocks of the run) and B (`long`, 3)."""
    from .memory import PlannedStep

    (planned_a, a), (planned_b, b) = short, long
    if b.stage != 4:
        raise CompositionError(f"the blocks did not run in order (the step never reached the {STAGES[b.stage + 1]} region)")
    copies = len(reuse.reused)
    added = {name: _minus(b.marks[name], a.marks[name]) for name in ("start", "forward", "backward")}

    def grown(region: str) -> Mem:
        if region not in a.highest:
            raise CompositionError(f"the 2-block run has no {region} region")
        return _minus(b.highest[region][0], a.highest[region][0])

    # (region of B, memory added by the copies, the moment is the last copy's), in the order the step meets them
    moments = [
        ("init", lambda: grown("init"), False),
        ("before", lambda: added["start"], False),
        ("template forward", lambda: added["start"], False),
        ("template forward", lambda: added["forward"], True),
        ("between", lambda: added["forward"], False),
        ("template backward", lambda: added["forward"], True),
        ("template backward", lambda: added["backward"], False),
        ("after", lambda: added["backward"], False),
        ("optimizer", lambda: grown("optimizer"), False),
    ]
    if max(held["total"] for held, _, _ in b.highest.values()) != planned_b.step.peak_bytes:
        raise CompositionError("the regions of the step do not hold its peak")
    peak: tuple[Mem, str] | None = None
    for region, extra, last_copy in moments:
        if region not in b.highest:
            continue
        held, parents, phase = b.highest[region]
        total = _plus(held, extra(), copies)
        if peak is None or total["total"] > peak[0]["total"]:
            where = _peak_module(parents, phase, b.root)  # "layers.1.attention (backward)"
            if last_copy and reuse.under_template(where.partition(" (")[0]):
                where = reuse.rename(where, reuse.reused[-1])
            peak = (total, where)
    assert peak is not None, "a measured step has at least one op"
    held, where = peak
    step_a, step_b = planned_a.step, planned_b.step
    step = StepMemory(
        peak_bytes=held["total"],
        categories={name: held[name] for name in CATEGORIES},
        after_step=_linear(step_a.after_step, step_b.after_step, copies),
        peak_module=where,
        comms={phase: _linear(step_a.comms[phase], counts, copies) for phase, counts in step_b.comms.items()},
        comm_bytes={phase: _linear(step_a.comm_bytes[phase], sizes, copies) for phase, sizes in step_b.comm_bytes.items()},
        losses=step_b.losses,
    )
    if min(step.categories.values()) < 0 or min(step.after_step.values()) < 0:
        raise CompositionError("the composed step holds negative memory")
    memory = dataclasses.replace(planned_b.memory, per_rank_peak_bytes=step.peak_bytes, categories=step.categories,
                                 steady=step.after_step, peak_module=step.peak_module, reuse=reuse)
    blocks = [name for name, _ in reuse.expand((fqn, None) for fqn in planned_b.blocks)]
    return PlannedStep(memory=memory, step=step, blocks=blocks, notes=planned_b.notes)


def _linear(a: dict[str, int], b: dict[str, int], copies: int) -> dict[str, int]:
    """B plus `copies` times what B has more than A, per key (a collective, a category)."""
    if set(a) - set(b):
        raise CompositionError(f"the 3-block run lacks {sorted(set(a) - set(b))} of the 2-block run")
    return {key: b[key] + copies * (b[key] - a.get(key, 0)) for key in b}
