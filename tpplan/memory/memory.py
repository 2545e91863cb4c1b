"""Will it fit? Per-rank memory of one training step, measured by torch's own
trackers.

`measure_training_step` makes the optimizer state and then measures one step
(forward, loss, backward, optimizer step) under
`torch.distributed._tools.mem_tracker.MemTracker` (or, with FSDP2, its
`fsdp2_mem_tracker.FSDPMemTracker`), which follow every tensor storage through
torch's dispatcher and sort it into parameters, gradients, optimizer state,
activations and temporaries: the steady state of training. The same
function measures a real rank (real tensors, `bench/`) and plans one in the dry
run (`plan_memory`: FakeTensorMode under the fake process group, the world of
the mesh simulated as any one of its ranks, no memory spent), so prediction and
measurement are one code path.

Collectives are counted per pass and per mesh axis with their bytes
(`simulation.comm_axes.collective_bytes`): the larger of each collective's buffers on this rank, i.e.
the full tensor of an all-gather or reduce-scatter and the tensor of an all-reduce.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .memory_report import CATEGORIES, MemoryReport
from ..simulation.comm_axes import counting, per_op
from ..simulation.training import TrainOptions, make_optimizer, make_targets, torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..simulation.positions import MeshDims

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# torch's tracker categories (MemTracker's and FSDPMemTracker's) -> ours (SPEC §4).
_CATEGORY = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "All Gather": "temporaries",
    "Reduce Scatter": "temporaries",
    "Other": "temporaries",
}


def parse_size(text: str) -> int:
    """`80GiB`, `80 GB`, `1.5TiB`, `123456` (bytes) -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: write a number with a unit, e.g. 80GiB, 40GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


# -- collectives per axis -----------------------------------------------------------


def nested(counts: dict[tuple[str, str], int], sizes: dict[tuple[str, str], int], axes) -> dict[str, dict[str, dict[str, int]]]:
    """{axis: {op: {"count", "bytes"}}} of one phase, every axis of `axes` present."""
    found: dict[str, dict[str, dict[str, int]]] = {axis: {} for axis in axes}
    for (axis, op), n in sorted(counts.items()):
        found.setdefault(axis, {})[op] = {"count": n, "bytes": sizes.get((axis, op), 0)}
    return found


# -- the tracker ----------------------------------------------------------------------


def _tracker(model: "nn.Module", optimizer, inputs: tuple, fsdp: bool, recorder=None):
    """torch's tracker, told to remember where the peak happens (the modules
    active when the peak last rose, and the pass), and to show every op's
    memory to `recorder.observe(tracker)` (reuse.Timeline) when given one."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class PeakSite(base):
        peak_site: tuple[list[str], str] = ([], "forward")
        phase = "start"  # the step's part now running (measure_training_step sets it)
        phase_peaks: dict[str, tuple[int, dict]]  # its highest total, and the snapshot there
        in_backend = 0  # inside a collective's wait (`_backend_buffers_untracked`): its buffers are the backend's

        def _track(self, reftype, t) -> None:
            if not self.in_backend:
                super()._track(reftype, t)

        def _update_peak_stats(self, peak_state) -> None:
            total = sum(snapshot["Total"] for snapshot in self._curr_mem_snap.values())
            if total > self.phase_peaks.get(self.phase, (-1, None))[0]:
                self.phase_peaks[self.phase] = (total, {device: dict(snapshot) for device, snapshot in self._curr_mem_snap.items()})
            # torch's version also updates every tracked module's own peak, walking all
            # of them after every op: quadratic in depth (minutes at 126 layers). Only
            # the global peak is read here, with the modules active when it rose.
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)
                    phase = "optimizer step" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                    self.peak_site = (list(self._mod_tracker.parents), phase)
            if recorder is not None:
                recorder.observe(self)

    if fsdp:
        tracker = PeakSite(model, optimizer)
        tracker.track_inputs(inputs)
    else:
        tracker = PeakSite()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []), *inputs)
    tracker.phase_peaks = {}
    from ..simulation.held import held_modules

    root = type(model).__name__  # the tracker's name for the model; its children's are under it
    for path, held in held_modules(model):
        tracker._mod_tracker._known_modules[held] = f"{root}.{path}"
    return tracker


@contextlib.contextmanager
def _propagation_untracked() -> Iterator[None]:
    """DTensor's sharding propagation runs each new op once on global-shape tensors in
    the active fake mode (`detect_fake_mode()`), to learn the output's metadata; under
    the dry run's FakeTensorMode the tracker counts those transient full-size tensors
    as this rank's memory, on the first use of each op and shape only (so a planned
    peak depended on what ran before it in the process). A fresh mode per propagation,
    as in eager mode, keeps them out of the count."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _backend_buffers_untracked(tracker) -> Iterator[None]:
    """Memory a process group allocates inside a collective is the backend's, not the
    step's: neither torch's tracker nor the dry run (the fake group allocates nothing)
    counts NCCL's (its reduce-scatter reads the input in place), nor gloo's staging
    buffers made on its worker thread. But gloo's reduce-scatter (`_reduce_scatter_base`,
    FSDP2's gradient reduction) clones its whole input, all-reduces the clone and, when
    waited on, copies this rank's chunk out of it: that chunk is cut on the waiting
    thread, under the tracker, which then counted the clone (every unsharded gradient of
    the unit, until the work is dropped) as a temporary of the step, on gloo ranks only
    and only where the wait is Python's `Work.wait` (an op's `wait_tensor` hides it). At
    tp 1 with checkpointed blocks the root unit's clone (embedding and head) was the
    measured peak. Storages first seen inside a wait are left untracked, so a gloo rank
    counts what the step itself allocates, as a CUDA rank's and the dry run's do."""
    from torch._C._distributed_c10d import Work

    original = Work.wait

    def wait(self, *args, **kwargs):
        tracker.in_backend += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.in_backend -= 1

    Work.wait = wait
    try:
        yield
    finally:
        Work.wait = original


def _peak_module(parents: list[str], phase: str, root: str) -> str:
    """The innermost active module, without the tracker's root-class prefix."""
    names = [p for p in parents if p != "Global"]
    if not names:  # no module running: the loss, or the optimizer
        return {"forward": "loss", "backward": "loss (backward)"}.get(phase, phase)
    # sorted first: modules active together (w1 and w3 in backward) tie, and a set's order varies by process
    innermost = max(sorted(names), key=lambda n: (n.count("."), len(n)))
    fqn = innermost[len(root) + 1:] if innermost.startswith(root + ".") else ("<root>" if innermost == root else innermost)
    return fqn if phase == "optimizer step" else f"{fqn} ({phase})"


def _categories(snapshot: dict) -> tuple[int, dict[str, int]]:
    """(total, {our category: bytes}) of a tracker snapshot (one device per rank)."""
    categories = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for device_snapshot in snapshot.values():
        for kind, held in device_snapshot.items():
            if kind == "Total":
                total += held
            else:
                categories[_CATEGORY[str(getattr(kind, "value", kind))]] += held
    return total, categories


def _initialize_state(model: "nn.Module", optimizer) -> None:
    """The optimizer state of a steady-state step (AdamW's moments), made by one
    step on zero gradients rather than a whole warm-up step: the same state for
    half the cost. (On real tensors the weights move by weight decay only.)"""
    import torch

    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    model.zero_grad(set_to_none=True)


@dataclass
class StepMemory:
    """What `measure_training_step` found on this rank."""

    peak_bytes: int
    categories: dict[str, int]
    after_step: dict[str, int]  # what stays between steps: parameters and optimizer state
    peak_module: str
    # {"forward"|"backward"|"optimizer": {(mesh axis, op): count}}, and the bytes of the same
    axis_comms: dict[str, dict[tuple[str, str], int]]
    axis_bytes: dict[str, dict[tuple[str, str], int]]
    losses: list[float] = field(default_factory=list)
    untracked_backward: int = 0  # modules whose backward torch's ModTracker skipped (freed after their forward)
    # the highest total of each part of the step ("forward", "backward", "reduce" (a stage's), "optimizer"),
    # and the total where each part ends ("start" included): what a pipeline's composition reads
    phase_peaks: dict[str, int] = field(default_factory=dict)
    phase_ends: dict[str, int] = field(default_factory=dict)
    phase_categories: dict[str, dict[str, int]] = field(default_factory=dict)  # by category at each part's peak
    phase_end_categories: dict[str, dict[str, int]] = field(default_factory=dict)  # and where each part ends
    stage_output: "tuple[tuple[int, ...], torch.dtype] | None" = None  # a non-last pipeline stage's output: shape, dtype

    @property
    def comms(self) -> dict[str, dict[str, int]]:
        """{"forward"|"backward"|"optimizer": {op: count}}, every axis together."""
        return {phase: per_op(counts) for phase, counts in self.axis_comms.items()}

    @property
    def comm_bytes(self) -> dict[str, dict[str, int]]:
        return {phase: per_op(sizes) for phase, sizes in self.axis_bytes.items()}

    def comms_by_axis(self, axes) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """SPEC §7's {axis: {"forward"|"backward": {op: {"count", "bytes"}}}}, every axis of `axes`."""
        return by_axis(self.axis_comms, self.axis_bytes, axes)


def by_axis(counts: dict[str, dict[tuple[str, str], int]], sizes: dict[str, dict[tuple[str, str], int]],
            axes) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """SPEC §7's {axis: {"forward"|"backward": {op: {"count", "bytes"}}}} of a step's
    {phase: {(axis, op): count}} and the bytes of the same, every axis of `axes`."""
    phases = {phase: nested(counts[phase], sizes[phase], axes) for phase in ("forward", "backward")}
    every = {**dict.fromkeys(axes), **phases["forward"], **phases["backward"]}  # the mesh's, then any group that is no dim's
    return {axis: {phase: phases[phase].get(axis, {}) for phase in phases} for axis in every}


@dataclass(frozen=True)
class StageIO:
    """One microbatch of a pipeline stage, as torch's `PipelineStage` runs it: whether
    it is the first (token inputs) or the last (its loss starts the backward; else a
    gradient received for its output), the microbatches its gradients are divided by.
    The receive buffers (its input, its output's gradient) are not counted in the
    measured step: PipelineStage holds one per microbatch across steps, and the
    composition (pipeline_memory.py) counts them once."""

    first: bool
    last: bool
    microbatches: int
    targets: "torch.Tensor | None" = None  # the last stage's
    fsdp_units: tuple[str, ...] = ()  # the stage's share of the plan's FSDP2 units


def _held_stage(model: "nn.Module") -> Any:
    """A stand-in for torch's `PipelineStage` holding `model`, for its own methods: the
    fake process group cannot build a stage (pytorch#191538)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.stage import _PipelineStageBase

    held = SimpleNamespace(submod=model)
    held.scale_grads = lambda factor: _PipelineStageBase.scale_grads(held, factor)
    return held


def _stage_backward(model: "nn.Module", stage: StageIO, inputs: tuple, output: Any) -> None:
    """One microbatch's backward by torch's `PipelineStage` code: from the loss, or from a
    gradient received for the output (made here, freed after: the composition counts
    the receive buffers), into the stage's input; FSDP2 left unsharded and unsynced,
    as between microbatches."""
    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase

    grad = None if stage.last else torch.empty_like(output)
    received = [t for t in inputs if getattr(t, "requires_grad", False)]
    _PipelineStageBase.backward_maybe_with_nosync(_held_stage(model), "full", {
        "stage_output": output, "output_grads": grad, "input_values": received})


def _stage_reduce(model: "nn.Module", stage: StageIO) -> None:
    """The end of a pipeline step's backward, by torch's `PipelineStage` code: FSDP2's
    gradient reduction, then the gradients divided by the microbatch count."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    _PipelineStageBase.perform_reduce_grad(_held_stage(model), stage.microbatches)


@contextlib.contextmanager
def _untracked_modules() -> Iterator[list]:
    """torch's ModTracker warns "Module is None. Skipping PRE_BW hook." for each module
    freed between its forward and its backward (one a model makes inside another's
    forward): counted (one per module) for the report's note, not printed; every
    other warning is shown as it came."""
    import warnings

    skipped: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield skipped
    for w in caught:
        text = str(w.message)
        if text.startswith("Module is None. Skipping"):  # PRE_BW once per module; its POST_BW twin dropped
            if "PRE_BW" in text:
                skipped.append(w)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def measure_training_step(
    model: "nn.Module",
    inputs: tuple,
    optimizer_name: str = "adamw",
    loss_parallel: bool = False,
    fsdp: bool = False,
    seed: int = 0,
    recorder=None,
    axis_of=None,
    stage: "StageIO | None" = None,
) -> StepMemory:
    """Peak memory of this rank over a steady-state training step (the optimizer
    state made first, then `reset_mod_stats()` and the measured step), by
    category, with the collectives of the step. Works on real and on fake tensors.
    `recorder` (reuse.Timeline) sees every op and the memory where the step's
    forward, backward and optimizer step begin and end; `axis_of` names the mesh
    axis of each collective (simulation/comm_axes.py). With `stage`, the step is one
    microbatch of a pipeline stage, run as torch's `PipelineStage` runs it (`_stage_backward`, `_stage_reduce`)."""
    import torch

    from ..simulation.fsdp import fake_friendly_meshes
    from ..simulation.training import loss_context, loss_value, training_loss

    if stage is not None:
        # imported before the tracker: torch.distributed.pipelining makes a module-level tensor at
        # import, which the first stage a process simulates would otherwise count in its step (4 bytes)
        import torch.distributed.pipelining.stage  # noqa: F401
    optimizer = make_optimizer(optimizer_name, model)
    targets = stage.targets if stage is not None else make_targets(model, inputs, torch.Generator().manual_seed(seed + 2))
    # a stage's input is PipelineStage's receive buffer, held across the step: counted by the composition, not here
    tracker = _tracker(model, optimizer, () if stage is not None else inputs, fsdp, recorder)
    if recorder is not None:
        recorder.begin(type(model).__name__)

    def mark(name: str) -> None:
        if recorder is not None:
            recorder.mark(name, _categories(tracker.get_tracker_snapshot()))

    counts = {phase: Counter() for phase in ("forward", "backward", "optimizer")}
    sizes = {phase: Counter() for phase in ("forward", "backward", "optimizer")}
    losses = []
    ends: dict[str, int] = {}

    end_categories: dict[str, dict[str, int]] = {}

    def phase(name: str) -> None:  # the step's next part begins: the one before ends here
        ends[tracker.phase], end_categories[tracker.phase] = _categories(tracker.get_tracker_snapshot())
        tracker.phase = name

    with _untracked_modules() as untracked, fake_friendly_meshes(), _propagation_untracked(), _backend_buffers_untracked(tracker), tracker:
        if optimizer is not None:
            _initialize_state(model, optimizer)
        tracker.reset_mod_stats()
        tracker.phase_peaks.clear()
        mark("start")
        phase("forward")
        generator = torch.Generator().manual_seed(seed + 3)
        with loss_context(loss_parallel):
            with counting(counts["forward"], sizes["forward"], axis_of):
                if stage is None:  # the logits live only in the loss's graph: its backward frees them
                    output, loss = None, training_loss(model(*inputs), targets, loss_parallel, generator)
                else:  # PipelineStage holds a stage's output until its backward
                    output = model(*inputs)
                    loss = training_loss(output, targets, loss_parallel, generator) if stage.last else None
            mark("forward")
            phase("backward")
            with counting(counts["backward"], sizes["backward"], axis_of):
                if stage is None:
                    loss.backward()
                else:
                    _stage_backward(model, stage, inputs, output if loss is None else loss)
            stage_output = (tuple(output.shape), output.dtype) if stage is not None and not stage.last else None
            del output
            mark("backward")
        if stage is not None:
            phase("reduce")
            counts["reduce"], sizes["reduce"] = Counter(), Counter()
            with counting(counts["reduce"], sizes["reduce"], axis_of):
                _stage_reduce(model, stage)
            mark("reduce")
        phase("optimizer")
        if optimizer is not None:
            with counting(counts["optimizer"], sizes["optimizer"], axis_of):
                optimizer.step()
        model.zero_grad(set_to_none=True)
        phase("end")
        if loss is not None:
            losses.append(loss_value(loss.detach()))
        del loss
        after = _categories(tracker.get_tracker_snapshot())
    total, categories = _categories(tracker.get_tracker_snapshot("peak"))
    return StepMemory(
        peak_bytes=total,
        categories=categories,
        after_step=after[1],
        peak_module=_peak_module(*tracker.peak_site, type(model).__name__),
        axis_comms={phase: dict(sorted(c.items())) for phase, c in counts.items()},
        axis_bytes={phase: dict(sorted(s.items())) for phase, s in sizes.items()},
        losses=losses,
        untracked_backward=len(untracked),
        phase_peaks={name: total for name, (total, _) in tracker.phase_peaks.items()},
        phase_ends=ends,
        phase_categories={name: _categories(snap)[1] for name, (_, snap) in tracker.phase_peaks.items()},
        phase_end_categories=end_categories,
        stage_output=stage_output,
    )


# -- the dry run's memory planning ---------------------------------------------------


@dataclass
class PlannedStep:
    memory: MemoryReport
    step: StepMemory
    blocks: list[str]
    notes: list[str] = field(default_factory=list)  # what the planning chose (e.g. why no block was reused)
    checkpointed: list[str] = field(default_factory=list)  # the modules activation checkpointing wraps
    layouts: tuple = ()  # positions.Layout of every parameter simulated: what tells positions apart


# simulate(model, recorder=None, wrap=None) -> PlannedStep: one built model, sharded and measured
Simulate = Callable[..., PlannedStep]


def plan_memory(
    plan: Any,
    build: Callable[[], "nn.Module"],
    make_inputs: Callable[["nn.Module"], tuple],
    shard: Callable[["nn.Module", Any], Any],
    dims: "MeshDims",
    train: TrainOptions,
    run: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
    strategy: "Callable[[nn.Module, Simulate], PlannedStep] | None" = None,
    rank: int = 0,
    stage: "Callable[[nn.Module], StageIO] | None" = None,
) -> PlannedStep:
    """Simulate the world of mesh `dims` as global `rank`, on fake tensors: `build()`
    the model, cast it to `train.dtype`, `shard(model, mesh)` (the plan's TP rules),
    then what follows them (activation checkpointing, FSDP2 over the data dims above
    1: a version 2 plan's axes or --fsdp's dp), and measure one training step on
    `make_inputs(model)`. `run(fn)` wraps the step (the dry run's failure locator).
    `strategy(model, simulate)` decides how the built model is simulated
    (reuse.block_reuse: repeated blocks once); without one, it is simulated whole.
    `stage(model)` (on the whole built model): the step is one microbatch of that
    pipeline stage (`shard` cuts the stage from the model after the TP rules)."""
    from ..sharding.context_parallel import section
    from ..simulation.comm_axes import mesh_axes
    from ..simulation.device_rules import context_parallel_rules
    from ..simulation.modelref import default_dtype
    from ..simulation.simulate import fake_tensors, simulated_world

    # context parallelism simulated as a CUDA rank runs it (torch's ring on the CPU kernel's shapes)
    with simulated_world(dims.world, rank), context_parallel_rules() if section(plan) is not None else contextlib.nullcontext():
        mesh = dims.build("cpu")
        axis_of = mesh_axes(mesh, plan)
        with fake_tensors():
            with default_dtype(torch_dtype(train.dtype)):
                model = build()

            def simulate(model: "nn.Module", recorder=None, wrap: list[str] | None = None) -> PlannedStep:
                io = stage(model) if stage is not None else None
                return _simulate(plan, model, make_inputs(model), shard, mesh, dims, train, run, recorder, wrap, axis_of, io)

            return (strategy or (lambda model, simulate: simulate(model)))(model, simulate)


def _simulate(plan, model, inputs, shard, mesh, dims: "MeshDims", train: TrainOptions, run, recorder, wrap, axis_of,
              stage: StageIO | None = None) -> PlannedStep:
    """The plan, what follows it (activation checkpointing; FSDP2 on `wrap`, default: the
    plan's units or the model's blocks) and one measured step of a built model."""
    from ..sharding.context_parallel import section, shard_sequence
    from ..simulation.fsdp import apply_after_rules, fake_friendly_meshes
    from ..simulation.positions import layouts

    # FSDP2 over the data dims, or (a version 2 plan) over efsdp alone where ep leaves the experts replicated
    data_parallel = dims.dp > 1 or plan.version == 2
    with fake_friendly_meshes():
        shard(model, mesh)
        units = None
        if stage is not None:
            from ..sharding.pipeline import held_units

            units = held_units(model, stage.fsdp_units)
        checkpointed, wrapped = apply_after_rules(plan, model, mesh, data_parallel, wrap, units)
    batch, seq = (int(inputs[0].shape[0]) if inputs and inputs[0].ndim else 0), (int(inputs[0].shape[1]) if inputs and inputs[0].ndim > 1 else 0)
    if section(plan) is not None and stage is None:  # this rank's part of the sequence, as the training loop cuts it (its labels alike)
        inputs = tuple(shard_sequence(plan, mesh, list(inputs), [1] * len(inputs)))
    # torch's FSDPMemTracker takes an FSDP2 root: experts sharded alone over efsdp (no data axes: tp 4, ep 2) are
    # followed by MemTracker, storage by storage as every other tensor
    step = run(lambda: measure_training_step(model, inputs, train.optimizer_name, plan.loss_parallel, fsdp="" in wrapped,
                                             recorder=recorder, axis_of=axis_of, stage=stage))
    first_param = next(model.parameters(), None)
    memory = MemoryReport(
        tp=dims.tp,
        dp=dims.dp,
        per_rank_peak_bytes=step.peak_bytes,
        categories=step.categories,
        steady=step.after_step,
        peak_module=step.peak_module,
        limit_bytes=train.memory_limit,
        batch=batch,
        seq=seq,
        dtype=str(first_param.dtype).removeprefix("torch.") if first_param is not None else "",
        optimizer=train.optimizer_name,
    )
    notes = [f"the backward of {step.untracked_backward} module(s) freed after their forward (made inside another's forward) "
             "is counted in the totals but not attributed to a module: torch's ModTracker skips them"] if step.untracked_backward else []
    return PlannedStep(memory=memory, step=step, blocks=wrapped, notes=notes, checkpointed=checkpointed, layouts=layouts(model))
