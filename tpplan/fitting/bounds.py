"""What the search knows of a layout before simulating it: the model read once (its
pipeline units, their parameters, its FLOPs per module, its shape for Megatron's
formula), and from it each layout's lower bounds: its parameters, gradients and
optimizer state per rank, and its step's compute and bubble (exact parts of the
cost model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .result import FitError, FitOptions
from .space import Layout, divisors, stage_units

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
    return ModelFacts(units, blocks, f"{blocks_fqn}.*", numel, flops, shape, expert_checks(plan, model, options.world))


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
        key = (layout.mesh["pp"], layout.virtual_stages, layout.schedule)
        if key not in self._numel:
            self._numel[key] = max(sum(self.model.numel[unit] for unit in units) for units in self.rank_units(layout))
        from ..simulation.training import torch_dtype

        per = torch_dtype(self.options.dtype).itemsize * (2 + OPTIMIZER_STATES[self.options.optimizer])
        mesh = layout.mesh
        return self._numel[key] * per // (mesh["tp"] * mesh["dp_shard"] * mesh["cp"])

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
