"""`apply --dry-run --checkpoint` under a version 2 layout the dry run does not
simulate yet (its data axes, `fsdp`, `checkpointing`: core/axes.py's APPLIED): whether
the checkpoint will load under it, from headers alone (SPEC §7).

DCP reshards any layout of the same global tensors into any other, so the answer
needs no simulated rank: the model, built on the meta device, against the
checkpoint's keys, shapes and dtypes and its optimizer state's shapes
(`checkpoint.run.will_load`); the target mesh is the one torchrun would build
(`mesh_dims`), its sizes checked against the world as `validate --world` does. The
report says what was not simulated (per-rank shapes, memory, collectives): a note,
never silence.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..core.axes import APPLIED, mesh_dims, unapplied, world_problems
from ..core.plan import Plan
from ..core.problems import PlanError
from ..simulation.modelref import build_model, load_callable
from .dry_world import simulates_world
from .dry_world import world_of as world_at
from .options import ApplyOptions, ApplyOptionsError
from .report import ApplyReport


def applies(options: ApplyOptions, plan: Plan) -> bool:
    """Whether this check answers the dry run: a checkpoint with nothing asked that needs
    a simulation (--check, memory planning, --save), and a version 2 layout beyond the TP
    axis: data axes the dry run would plan memory for, or keys it does not simulate that
    torchrun applies (a layout that can run)."""
    keys = unapplied(plan, "dry-run")
    simulates = options.check or options.train.plans_memory or options.save  # these need the simulation: refused as before
    beyond_tp = simulates_world(plan, options) or (bool(keys) and all(key[-1] in APPLIED["torchrun"] for key in keys))
    return bool(options.checkpoint) and not simulates and beyond_tp


def world_of(options: ApplyOptions, plan: Plan) -> int:
    """The world of the layout: --world, or the plan's sizes' product (at `--tp` where it
    promises several degrees), as the dry run of a world takes it (`dry_world.world_of`)."""
    candidates = list(plan.mesh.candidates())
    sizes = next((c for c in candidates if options.tp is None or c["tp"] == options.tp), None)
    if sizes is None:
        promised = ", ".join(str(c["tp"]) for c in candidates)
        raise ApplyOptionsError("tp", "not-promised", f"tp {options.tp}: the plan's mesh.tp promises {promised}",
                                tp=options.tp, promised=promised)
    return world_at(options, plan, sizes["tp"])


def checkpoint_dry_run(options: ApplyOptions, plan: Plan, on_event: Callable[[str], None]) -> ApplyReport:
    """The dry run's report: the checkpoint against the plan's whole layout (headers only)."""
    from ..checkpoint.run import open_checkpoint, will_load

    world = world_of(options, plan)
    report = ApplyReport(mode="dry-run", plan_file=options.plan, model=options.model, world_size=world,
                         plan_name=plan.name, device="meta", backend="fake")
    if problems := world_problems(plan, world):
        report.problems = problems
        return report
    shape, names = mesh_dims(plan, world, options.tp)
    target = dict(zip(names, shape))
    report.mesh, report.tp, report.dp = target, shape[-1], math.prod(shape[:-1])
    skipped = ", ".join(".".join(key) for key in unapplied(plan, "dry-run"))
    layout = ', '.join(f'{n} {s}' for n, s in target.items())
    report.notes = [f"the dry run does not simulate {skipped} yet: --checkpoint was checked from its headers against the "
                    f"whole layout ({layout}); per-rank shapes, memory and collectives are not reported (torchrun applies "
                    "the layout)" if skipped else
                    f"--checkpoint was checked from its headers against the whole layout ({layout}); per-rank memory and "
                    "collectives: the same dry run with a memory option (--batch, --seq, --memory-limit)"]
    factory = load_callable(options.model, "--model")
    try:
        source = open_checkpoint(options.checkpoint)
        on_event("building the model on the meta device")
        model = build_model(options.model, "meta", factory, real_buffers=True)
        plan.match(model)  # the rules and sections name modules the model has
        report.checkpoint, found = will_load(model, source, options.allow_missing, target)
    except PlanError as exc:
        report.problems = exc.problems
        return report
    report.problems = list(found)
    return report
