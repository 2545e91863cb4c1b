"""Each layout as the version 2 plan it is (its sections beside the base plan's TP
rules, `extends`): written, checked at its sizes by the plan's own checks, and its
dry run read into a verdict (refused, over the memory, or ranked by the cost model)."""

from __future__ import annotations

import os
from typing import Any

from .bounds import Bounds, ModelFacts
from .result import FitOptions, Ranked
from .simulate import Simulated
from .space import Layout, Rejected, plan_sections, stage_units


class LayoutPlans:
    """Writes each layout's plan (its sections beside the base plan's rules, `extends`), checks it, simulates it."""

    def __init__(self, options: FitOptions, model: ModelFacts, bounds: Bounds, training: dict, context_parallel: dict | None):
        self.options, self.model, self.bounds = options, model, bounds
        self.training, self.context_parallel = training, context_parallel
        self._specs: dict[tuple, Any] = {}

    def text(self, layout: Layout, *, extends: str | None = None, probe: bool = False) -> str:
        """The layout's plan, `extends:` the base plan by `extends` (default its absolute path);
        a `probe` (every axis 1, stages by count) loads whatever its sections, for the checks
        to read at the layout's sizes."""
        from ..core.yamltext import plan_yaml

        pp = layout.mesh["pp"]
        stages = stage_units(self.model.units, self.model.blocks, pp * layout.virtual_stages) if pp > 1 and not probe else None
        if probe:
            layout = Layout((1,) * len(layout.sizes), layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)
        sections = plan_sections(layout, blocks_glob=self.model.blocks_glob, stages=stages, training=self.training,
                                 context_parallel=self.context_parallel)
        described = layout.describe().replace(" · ", ", ").replace(" × ", " x ")  # ASCII in the file
        top = {"version": 2, "name": f"fit-{'-'.join(f'{a}{s}' for a, s in layout.mesh.items() if s > 1) or 'one'}",
               "description": f"written by tpplan fit: {described}", "extends": extends or os.path.abspath(self.options.plan),
               "mesh": sections.pop("mesh")}
        return plan_yaml(top, {}, after=sections)

    def check(self, layout: Layout) -> tuple[str, str] | None:
        """The first (code, message) of the plan's checks at this layout's sizes (one parsed
        probe per kind of layout: the checks read its sections, the sizes are given); then
        what the dry run refuses to apply (TP130: the base plan's experts or context
        parallelism beside a pipeline, an experts rule ep does not carry), and the experts'
        count over ep (TP127, read from the model once)."""
        from ..core.axes import sized_problems
        from ..core.loader import load_plan

        if self.context_parallel is None and layout.mesh["cp"] > 1:
            return ("TP128", f"cp {layout.mesh['cp']}: the base plan has no context_parallel section naming the attention "
                    "modules: add one to --plan, or leave cp out of --axes")
        key = (layout.checkpointing, layout.schedule, layout.microbatches, layout.virtual_stages)
        if key not in self._specs:
            probe = load_plan(text=self.text(layout, probe=True), file="<fit>")
            self._specs[key] = (probe.spec, _unapplied(probe))
        spec, unapplied = self._specs[key]
        problems = sized_problems(spec, layout.mesh)
        if problems:
            return problems[0]
        if unapplied is not None:
            return (unapplied.code, unapplied.message)
        return self.model.experts.get(layout.mesh["ep"])

    def comms(self, layout: Layout, outcome: Simulated) -> dict[str, float]:
        """The seconds of the layout's collectives per axis (cost.comm_seconds of its dry run's)."""
        from .cost import comm_seconds

        return comm_seconds(outcome.comms_by_axis, layout.mesh, self.options.gpu, self.options.gpus_per_node)

    def verdict(self, layout: Layout, outcome: Simulated, comms: dict[str, float] | None = None) -> "Ranked | Rejected":
        """A layout's dry run read: refused by a plan check, over the memory, or ranked (by
        `comms`, its collectives' seconds, where the caller has them)."""
        memory = self.options.memory_bytes
        if outcome.refused is not None:
            return Rejected(layout, "check", outcome.refused[1], outcome.refused[0])
        if outcome.peak_bytes > memory:
            return Rejected(layout, "memory", f"{size_text(outcome.peak_bytes)} > {size_text(memory)}, {size_text(outcome.peak_bytes - memory)} "
                            f"over (at {outcome.peak_where})", peak_bytes=outcome.peak_bytes)
        step = self.bounds.step(layout, comms if comms is not None else self.comms(layout, outcome))
        tokens = self.options.global_batch * self.options.seq / step.total / self.options.world
        return Ranked(layout, outcome.peak_bytes, step, tokens, self._megatron(layout), outcome.peak_where)

    def _megatron(self, layout: Layout) -> int | None:
        from ..memory.megatron import megatron_memory

        if self.model.shape is None:
            return None
        mesh = layout.mesh
        local = self.options.global_batch // layout.dp
        micro = local // layout.microbatches if layout.microbatches else local
        estimate = megatron_memory(self.model.shape, tp=mesh["tp"], pp=mesh["pp"], dp=layout.dp, seq=self.options.seq,
                                   micro_batch=micro, microbatches=layout.microbatches,
                                   virtual_stages=layout.virtual_stages if layout.virtual_stages > 1 else None,
                                   sequence_parallel_selective=layout.checkpointing)
        return int(estimate.total)


def _unapplied(plan: Any) -> Any:
    """The problem (TP130) for which the dry run would refuse `plan`, or None."""
    from ..core.axes import NotAppliedError, refuse_unapplied

    try:
        refuse_unapplied(plan, "dry-run")
    except NotAppliedError as exc:
        return exc.problem
    return None


def size_text(count: int) -> str:
    from ..core.units import human_bytes

    return human_bytes(count)


def seconds_text(value: float) -> str:
    return f"{value:.4g} s"
