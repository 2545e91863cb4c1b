"""Cost by what differs, not by depth: repeated blocks are simulated once.

The memory plan of a decoder whose blocks are identical (the same modules,
parameter and buffer shapes, attributes, and the same plan rules: block identity
is simulation/blocks.py's, at its `exact` strength) costs the
same at 4 blocks and at 126 when the repeated blocks are not all simulated:
`block_reuse(plan)` finds the longest run of identical blocks in the list FSDP
wraps (the largest `ModuleList`, e.g. `layers`), simulates the model truncated
to 2 and to 3 blocks of that run (every other block kept, every name kept), and
composes the full step from the two (`compose`, below): what one more block
adds, times the blocks left out. The run's first block, its last and one in its
middle (the template) are simulated; the others are reused from the template.

A model whose blocks differ, or whose truncated copy cannot be simulated, is
simulated whole, with a note that says why. `--no-reuse` simulates it whole.

## Composing the step

One training step of the whole model, composed from two truncated ones.

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

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..simulation.blocks import attribute_value, first_difference, only_children, runs, shared, signatures
from .memory import PlannedStep, StepMemory, _categories, _peak_module
from .memory_report import CATEGORIES

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan
    from .memory import Simulate

# Below this many identical blocks, two truncated runs (2 + 3 blocks) cost about as much as the whole.
MIN_RUN = 6


@dataclass(frozen=True)
class BlockReuse:
    """Which blocks of `container` were reused: `keys[start:stop]` are identical;
    `keys[start]`, the template `keys[start + 1]` and `keys[stop - 1]` were
    simulated, the blocks between the template and the last were not."""

    container: str  # "layers"
    keys: tuple[str, ...]  # every block's key in the container, in order ("0", ..., "125")
    start: int
    stop: int

    def fqn(self, key: str) -> str:
        return f"{self.container}.{key}" if self.container else key

    @property
    def template(self) -> str:
        return self.fqn(self.keys[self.start + 1])

    @property
    def reused(self) -> tuple[str, ...]:
        return tuple(self.fqn(k) for k in self.keys[self.start + 2:self.stop - 1])

    def kept(self, run_blocks: int) -> list[str]:
        """The keys of a copy that keeps `run_blocks` (2 or 3) blocks of the run: its first, (the template,) its last."""
        run = [self.keys[self.start], *self.keys[self.start + 1:self.start + run_blocks - 1], self.keys[self.stop - 1]]
        return [*self.keys[:self.start], *run, *self.keys[self.stop:]]

    @property
    def simulated(self) -> list[str]:
        return [self.fqn(k) for k in self.kept(3)]

    def describe(self) -> str:
        first, last = self.keys[self.start + 2], self.keys[self.stop - 2]
        shown = self.fqn(first) if first == last else f"{self.fqn(first)}-{last}"
        return f"{shown} reused from {self.template} ({len(self.simulated)} of {len(self.keys)} blocks of '{self.container}' simulated)"

    def to_json(self) -> dict[str, Any]:
        return {"container": self.container, "blocks": len(self.keys), "from": self.template,
                "reused": list(self.reused), "simulated": self.simulated}

    def rename(self, name: str, block: str) -> str:
        """`name` under the template, moved under `block`."""
        return block + name[len(self.template):]

    def under_template(self, name: str) -> bool:
        return name == self.template or name.startswith(self.template + ".")

    def expand(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """(fqn, value) pairs of the simulated copy, in module order, with the
        template's pairs repeated for every reused block after the template's own:
        the pairs of the whole model, in its order."""
        out: list[tuple[str, Any]] = []
        template: list[tuple[str, Any]] = []

        def flush() -> None:
            for block in self.reused:
                out.extend((self.rename(name, block), value) for name, value in template)
            template.clear()

        for name, value in named:
            if not self.under_template(name) and template:
                flush()
            if self.under_template(name):
                template.append((name, value))
            out.append((name, value))
        flush()
        return out

    def expand_dict(self, by_fqn: dict[str, Any]) -> dict[str, Any]:
        return dict(self.expand(by_fqn.items()))

    def expand_params(self, layouts: list) -> list:
        """ParamLayouts of the whole model from the simulated copy's."""
        return [dataclasses.replace(p, name=name) for name, p in self.expand((p.name, p) for p in layouts)]


# -- which blocks are identical -------------------------------------------------------


def find_run(model: "nn.Module", plan: "Plan") -> BlockReuse | str | None:
    """The longest run of identical blocks (at least MIN_RUN) of the list FSDP wraps;
    a note when the list is long enough but its blocks differ; None when there is
    nothing to reuse (no such list, a short one, or a plan that does not resolve:
    the whole simulation reports its problems)."""
    from ..simulation.fsdp import blocks

    fqns = blocks(model)
    if len(fqns) < MIN_RUN:
        return None
    container = fqns[0].rpartition(".")[0]
    claimed, problems = plan.claim(model)
    if problems:
        return None
    if container in claimed:
        return f"the plan's rule '{claimed[container].pattern}' shards '{container}' itself: all {len(fqns)} blocks simulated"
    sections = _section_claims(model, plan)
    if sections is None:
        return None
    for section, by_fqn in sections.items():
        around = [fqn for fqn in by_fqn if fqn == "" or container == fqn or container.startswith(f"{fqn}.")]
        if around and not (section == "fsdp.units" and around == [""]):  # the root's FSDP unit holds every block alike
            return f"the plan's {section} '{by_fqn[around[0]]}' wraps '{around[0] or '<root>'}', which holds the blocks: all {len(fqns)} blocks simulated"

    def what_plan_does(fqn: str) -> Any:  # the TP rule, and (version 2) the checkpointing and FSDP unit globs
        rule = getattr(claimed.get(fqn), "pattern", None)
        return (rule, *(by_fqn.get(fqn) for by_fqn in sections.values())) if sections else rule

    found_signatures = signatures([(fqn, model.get_submodule(fqn)) for fqn in fqns], exact=True, held_twice=shared(model),
                                  rule=what_plan_does)
    best = max(runs(found_signatures), key=len)  # the first of the longest
    if len(best) < MIN_RUN:
        return f"no {MIN_RUN} consecutive blocks of '{container}' are identical ({first_difference(fqns, found_signatures)}): all {len(fqns)} simulated"
    keys = tuple(fqn.rpartition(".")[2] for fqn in fqns)
    found = BlockReuse(container, keys, best.start, best.stop)
    moved = _positional_setting(model, found)
    if moved:
        return f"{moved} gives the blocks of '{container}' settings by position that a shorter list would move: all {len(fqns)} simulated"
    return found


def _section_claims(model: "nn.Module", plan: "Plan") -> dict[str, dict[str, str]] | None:
    """{section: {fqn: glob}} of a version 2 plan's checkpointing modules and FSDP units
    (blocks are identical only where these treat them alike too); None where they do not
    resolve (the whole simulation reports why)."""
    from ..core.sections import claim_section

    if plan.version != 2:
        return {}
    tree, under = plan.module_tree(model)
    found: dict[str, dict[str, str]] = {}
    for section, present in (("checkpointing.modules", plan.spec.checkpointing), ("fsdp.units", plan.spec.fsdp and plan.spec.fsdp.units)):
        if not present:
            continue
        claimed, problems = claim_section(plan, tree, under, section)
        if problems:
            return None
        found[section] = {fqn: entry.pattern for fqn, entry in claimed.items()}
    return found


def _positional_setting(model: "nn.Module", reuse: BlockReuse) -> str | None:
    """A per-block list outside the blocks (transformers' `config.layer_types`) that a
    forward indexes by position (`enumerate(self.layers)`) and that reads differently at
    a truncated copy's positions than at its blocks' own indices; None when there is none."""
    from torch import nn

    prefix = f"{reuse.container}." if reuse.container else ""
    owners: list[tuple[str, Any]] = [(name, m) for name, m in model.named_modules() if not (prefix and name.startswith(prefix))]
    for name, module in list(owners):
        config = getattr(module, "config", None)
        if hasattr(config, "__dict__") and not isinstance(config, nn.Module):
            owners.append((f"{name}.config" if name else "config", config))
    for owner, obj in owners:
        for attribute, value in vars(obj).items():
            if not isinstance(value, (list, tuple)) or len(value) != len(reuse.keys):
                continue
            for blocks in (2, 3):
                kept = [reuse.keys.index(k) for k in reuse.kept(blocks)]
                if any(attribute_value(value[position]) != attribute_value(value[index]) for position, index in enumerate(kept)):
                    return f"'{owner}.{attribute}'" if owner else f"'{attribute}'"
    return None


# -- the strategy ---------------------------------------------------------------------


def block_reuse(plan: "Plan", event: Callable[[str], None] = lambda text: None) -> "Callable[[nn.Module, Simulate], PlannedStep]":
    """plan_memory's strategy: simulate the repeated blocks once when the model has
    them, else (or when the truncated copies cannot be simulated) the whole model."""
    from ..core.problems import PlanError, first_line

    def whole(model: "nn.Module", simulate: "Simulate", note: str | None) -> "PlannedStep":
        planned = simulate(model)
        planned.notes += [note] if note else []
        return planned

    def strategy(model: "nn.Module", simulate: "Simulate") -> "PlannedStep":
        found = find_run(model, plan)
        if not isinstance(found, BlockReuse):
            return whole(model, simulate, found)
        whole_note = f"all {len(found.keys)} blocks of '{found.container}' simulated"
        try:
            short, long = _truncated_copy(model, found, 2), _truncated_copy(model, found, 3)
        except Exception as exc:  # deepcopy runs the model's own code (__deepcopy__, pickling hooks): any error
            return whole(model, simulate, f"the model cannot be copied to simulate its repeated blocks once ({first_line(exc)}): {whole_note}")
        nearby = (found.fqn(found.keys[found.stop - 1]), found.fqn(found.keys[found.start]))
        timelines = (Timeline(), Timeline(found.template, *nearby))
        try:
            event(f"simulating {found.describe()}")
            planned = [simulate(copied, recorder=timeline, wrap=[found.fqn(k) for k in found.kept(n)])
                       for copied, timeline, n in zip((short, long), timelines, (2, 3))]
            return compose(found, *zip(planned, timelines))
        except (PlanError, CompositionError) as exc:
            return whole(model, simulate, f"the model truncated to fewer blocks of '{found.container}' could not be simulated "
                         f"({first_line(exc)}): {whole_note}")

    return strategy


def _truncated_copy(model: "nn.Module", reuse: BlockReuse, run_blocks: int) -> "nn.Module":
    """A copy of `model` whose container keeps `reuse.kept(run_blocks)` under their own
    names (so the plan's rules and the report's names stay those of the model);
    `model` itself is left whole."""
    keep = set(reuse.kept(run_blocks))
    with only_children(model.get_submodule(reuse.container), keep.__contains__), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return copy.deepcopy(model)


# -- composing the whole step from the two truncated ones ----------------------------

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
        # (region, the step's part: forward, backward, reduce, optimizer) -> (memory, active modules, phase)
        self.highest: dict[tuple[str, str], tuple[Mem, list[str], str]] = {}
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
        part = tracker.phase  # measure_training_step's: a pipeline stage's gradient reduction is a part of its own
        best = self.highest.get((region, part))
        if best is None or total > best[0]["total"]:
            phase = "optimizer step" if tracker._in_opt else "backward" if modules.is_bw else "forward"
            self.highest[(region, part)] = (_mem(_categories(tracker._curr_mem_snap)), list(modules.parents), phase)

    def region_highest(self, region: str) -> tuple[Mem, list[str], str] | None:
        """The highest moment of `region`, whatever part of the step it was in."""
        found = [held for (where, _), held in self.highest.items() if where == region]
        return max(found, key=lambda held: held[0]["total"]) if found else None

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
    (planned_a, a), (planned_b, b) = short, long
    if b.stage != 4:
        raise CompositionError(f"the blocks did not run in order (the step never reached the {STAGES[b.stage + 1]} region)")
    copies = len(reuse.reused)
    added = {name: _minus(b.marks[name], a.marks[name]) for name in ("start", "forward", "backward", "reduce") if name in b.marks}

    def grown(region: str) -> Mem:
        in_a, in_b = a.region_highest(region), b.region_highest(region)
        if in_a is None or in_b is None:
            raise CompositionError(f"the 2-block run has no {region} region")
        return _minus(in_b[0], in_a[0])

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
    parts: dict[str, Mem] = {}  # each part of the step's highest moment (a pipeline stage's composition reads them)
    for region, extra, last_copy in moments:
        for (where_b, part), (held, parents, phase) in b.highest.items():
            if where_b != region:
                continue
            # a pipeline stage's gradient reduction (FSDP2's) frees what its backward left: what the copies add after it
            after_reduction = region == "after" and part in ("optimizer", "end") and "reduce" in added
            total = _plus(held, added["reduce"] if after_reduction else extra(), copies)
            if part not in parts or total["total"] > parts[part]["total"]:
                parts[part] = total
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
        axis_comms={phase: _linear(step_a.axis_comms[phase], counts, copies) for phase, counts in step_b.axis_comms.items()},
        axis_bytes={phase: _linear(step_a.axis_bytes[phase], sizes, copies) for phase, sizes in step_b.axis_bytes.items()},
        losses=step_b.losses,
        phase_peaks={part: held["total"] for part, held in parts.items() if part in step_b.phase_peaks},
        phase_ends=_linear(step_a.phase_ends, step_b.phase_ends, copies),
        phase_categories={part: {name: held[name] for name in CATEGORIES} for part, held in parts.items() if part in step_b.phase_peaks},
        phase_end_categories={part: _linear(step_a.phase_end_categories[part], categories, copies)
                              for part, categories in step_b.phase_end_categories.items()},
        stage_output=step_b.stage_output,
    )
    if min(step.categories.values()) < 0 or min(step.after_step.values()) < 0:
        raise CompositionError("the composed step holds negative memory")
    memory = dataclasses.replace(planned_b.memory, per_rank_peak_bytes=step.peak_bytes, categories=step.categories,
                                 steady=step.after_step, peak_module=step.peak_module, reuse=reuse)
    blocks = [name for name, _ in reuse.expand((fqn, None) for fqn in planned_b.blocks)]
    checkpointed = [name for name, _ in reuse.expand((fqn, None) for fqn in planned_b.checkpointed)]
    return PlannedStep(memory=memory, step=step, blocks=blocks, notes=planned_b.notes, checkpointed=checkpointed, layouts=planned_b.layouts)


def _linear(a: dict[str, int], b: dict[str, int], copies: int) -> dict[str, int]:
    """B plus `copies` times what B has more than A, per key (a collective, a category)."""
    if set(a) - set(b):
        raise CompositionError(f"the 3-block run lacks {sorted(set(a) - set(b))} of the 2-block run")
    return {key: b[key] + copies * (b[key] - a.get(key, 0)) for key in b}
