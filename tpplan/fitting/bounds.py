"""What the search knows of a layout before simulating it: the model read once (its
pipeline units, their parameters, its FLOPs per module, its shape for Megatron's
formula), and from it each layout's lower bounds: its memory per rank (parameters,
gradients and optimizer state, and without activation checkpointing the blocks'
saved activations), and its step's compute and bubble (exact parts of the cost
model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .result import FitError, FitOptions
from .space import Layout, divisors, lighter, stage_units

OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "none": 0}  # tensors per parameter (sgd's momentum is off by default)


@dataclass(frozen=True)
class ModelFacts:
    units: list[str]  # the pipeline's units (core/stages.split_units), in order
    blocks: list[str]  # the blocks among them
    blocks_glob: str
    numel: dict[str, int]  # unit -> its parameters' elements
    flops: Any  # flops.ModuleFlops of one sequence
    shape: Any  # megatron.TransformerShape, or None where the formula cannot read the model
    experts: dict[int, tuple[str, str]] = field(default_factory=dict)  # ep -> the check (TP127) it fails (expert_checks)
    per_sequence: dict[str, int] = field(default_factory=dict)  # block -> bytes it saves for backward per sequence (flops.py)


def read_model(options: FitOptions, event: Callable[[str], None], plan: Any = None) -> ModelFacts:
    """The model's facts, and where `plan` (the base plan) has experts, the ep its layouts
    may not take (`expert_checks`)."""
    from ..core.globs import ModuleTree
    from ..core.stages import split_units
    from ..memory.megatron import TransformerShape
    from ..simulation.modelref import build_model
    from .flops import count_flops

    event("reading the model")
    model = build_model(options.model, "meta")
    units, blocks_fqn = split_units(ModuleTree(name for name, _ in model.named_modules()))
    if blocks_fqn is None:
        raise FitError(f"{options.model}: no module list of repeated blocks (such as layers) to cut into pipeline stages, "
                       "checkpoint and shard: fit searches models built of blocks")
    blocks = [unit for unit in units if unit.startswith(blocks_fqn + ".")]
    seen: set[int] = set()
    numel = {}
    for unit in units:
        count = 0
        for param in model.get_submodule(unit).parameters():
            if id(param) not in seen:  # a tied parameter counts once, where it first appears
                seen.add(id(param))
                count += param.numel()
        numel[unit] = count
    try:
        shape = TransformerShape.of(model)
    except AttributeError:
        shape = None
    event("counting the model's FLOPs")
    flops = count_flops(options.model, options.seq, options.dtype)
    return ModelFacts(units, blocks, f"{blocks_fqn}.*", numel, flops, shape, expert_checks(plan, model, options.world),
                      flops.saved_per_sequence)


def expert_checks(plan: Any, model: Any, world: int) -> dict[int, tuple[str, str]]:
    """{ep: (code, message)} of `validate --model`'s TP127 (lint/sections.uneven_experts) at
    each ep a layout of `world` may take that does not divide the experts of `plan`'s
    experts rules: the check reads the model, which fit builds once, not per layout.
    A glob that matches nothing or a module without experts is the dry run's to report."""
    if plan is None or plan.version != 2 or not plan.spec.experts:
        return {}
    from ..core.expert_styles import expert_count
    from ..core.sections import claim_section
    from ..lint.sections import uneven_experts

    tree, under = plan.module_tree(model)
    claimed, _ = claim_section(plan, tree, under, "experts")
    counts = {fqn: count for fqn in claimed if (count := expert_count(model.get_submodule(fqn))) is not None}
    found = {}
    for ep in divisors(world):
        if problems := uneven_experts(plan, claimed, counts, ep):
            found[ep] = (problems[0].code, problems[0].message)
    return found


class Bounds:
    """What a layout's pipeline cut gives its bounds and its compute, once per cut."""

    def __init__(self, model: ModelFacts, options: FitOptions):
        self.model, self.options = model, options
        self._ranks: dict[tuple, list[list[str]]] = {}
        self._flops: dict[tuple, float] = {}
        self._numel: dict[tuple, int] = {}

    def rank_units(self, layout: Layout) -> list[list[str]]:
        """Each pp rank's units (its stages')."""
        from ..core.stages import rank_stages

        pp, virtual, schedule = layout.mesh["pp"], layout.virtual_stages, layout.schedule
        key = (pp, virtual, schedule)
        if key not in self._ranks:
            stages = stage_units(self.model.units, self.model.blocks, pp * virtual)
            self._ranks[key] = stages if pp == 1 else [
                [unit for stage in rank_stages(rank, pp, virtual, schedule) for unit in stages[stage]] for rank in range(pp)]
        return self._ranks[key]

    def static_bytes(self, layout: Layout) -> int:
        """The worst pp rank's parameters, gradients and optimizer state, spread evenly over
        tp·dp_shard·cp: a lower bound of its peak (module docstring). No rank holds less:
        the TP rules shard over tp, FSDP2 over dp_shard·cp (torchtitan's dp_shard_cp), and
        the experts over ep·efsdp = dp_shard·cp·tp whatever ep is."""
        return self._tensor_bytes(layout) * (2 + OPTIMIZER_STATES[self.options.optimizer])

    def _tensor_bytes(self, layout: Layout) -> int:
        """The worst pp rank's parameters (one tensor of each: its gradients', each optimizer state's), spread as `static_bytes`."""
        key = (layout.mesh["pp"], layout.virtual_stages, layout.schedule)
        if key not in self._numel:
            self._numel[key] = max(sum(self.model.numel[unit] for unit in units) for units in self.rank_units(layout))
        from ..simulation.training import torch_dtype

        mesh = layout.mesh
        return self._numel[key] * torch_dtype(self.options.dtype).itemsize // (mesh["tp"] * mesh["dp_shard"] * mesh["cp"])

    def activation_bytes(self, layout: Layout) -> int:
        """Without activation checkpointing, what the first pp rank's blocks save for backward
        when its first backward starts: every microbatch it has run forward until then
        (all of a rank's sequences without a pipeline; min(pp, microbatches) of stage 0
        under GPipe, 1F1B and Interleaved1F1B, whose first backward on rank 0 waits for
        that many forwards), each block's saved bytes per sequence (flops.py: what grows
        with the batch, so nothing a forward shares across sequences or microbatches)
        spread evenly over tp·cp: the TP rules and context parallelism shard an
        activation at most that many ways. 0 with checkpointing (only the blocks'
        inputs are kept)."""
        if layout.checkpointing:
            return 0
        pp, sequences = layout.mesh["pp"], self.options.global_batch // layout.dp
        units, in_flight = (self.model.units, sequences) if pp == 1 else (
            stage_units(self.model.units, self.model.blocks, pp * layout.virtual_stages)[0],
            min(pp, layout.microbatches) * (sequences // layout.microbatches))
        per_sequence = sum(self.model.per_sequence.get(unit, 0) for unit in units)  # the blocks among them
        return in_flight * per_sequence // (layout.mesh["tp"] * layout.mesh["cp"])

    def memory_bytes(self, layout: Layout) -> int:
        """A lower bound of the layout's peak per rank: its parameters and optimizer state,
        then the larger of its gradients (at the end of backward) and its saved activations
        (when backward starts, before any gradient); at least its lighter twin's
        (space.lighter: Interleaved1F1B holds no less than 1F1B, whose first rank's
        in-flight count is the one `activation_bytes` knows)."""
        tensor = self._tensor_bytes(layout)
        own = tensor * (1 + OPTIMIZER_STATES[self.options.optimizer]) + max(tensor, self.activation_bytes(layout))
        twin = lighter(layout)
        return own if twin is None else max(own, self.memory_bytes(twin))

    def rank_flops(self, layout: Layout) -> float:
        """The worst pp rank's FLOPs per step: its units' forward and backward (and, with
        activation checkpointing, its blocks' forward again) for each of its sequences,
        spread evenly over tp and cp."""
        key = (layout.mesh["pp"], layout.virtual_stages, layout.schedule, layout.checkpointing)
        if key not in self._flops:
            flops, blocks = self.model.flops, set(self.model.blocks)
            worst = 0.0
            for units in self.rank_units(layout):
                forward, backward = flops.of(units)
                if layout.checkpointing:
                    forward += flops.of([unit for unit in units if unit in blocks])[0]
                worst = max(worst, forward + backward)
            self._flops[key] = worst
        mesh = layout.mesh
        return self._flops[key] * (self.options.global_batch // layout.dp) / (mesh["tp"] * mesh["cp"])

    def bubble(self, layout: Layout) -> float:
        """The idle share of the pipelined step (pipeline_memory.schedule_bubble)."""
        from ..memory.pipeline_memory import schedule_bubble

        pp = layout.mesh["pp"]
        return 0.0 if pp == 1 else schedule_bubble(layout.schedule, pp, layout.microbatches, layout.virtual_stages)

    def step(self, layout: Layout, comms: dict[str, float]):
        """The cost model's step (cost.step_time): with no collectives, its lower bound."""
        from .cost import compute_seconds, step_time

        return step_time(compute_seconds(self.rank_flops(layout), self.options.gpu), comms, self.bubble(layout))
