"""The world a dry run simulates: a version 1 plan's TP degree (times --fsdp's dp), or
a version 2 plan's named axes over `--world N` ranks (its mesh's product where no axis
is -1), the same mesh torchrun would build (core/axes.py's `mesh_dims`)."""

from __future__ import annotations

import math

from ..core.axes_spec import DP_AXES, WORLD_AXES
from ..core.plan import Plan
from ..core.problems import PlanError, error
from ..simulation.positions import MeshDims
from .devices import mesh_shape
from .options import ApplyOptions, ApplyOptionsError


def simulates_world(plan: Plan, options: ApplyOptions) -> bool:
    """Whether the dry run simulates more than the TP axis: a version 2 plan with data
    axes or with what follows the TP rules (fsdp, checkpointing), or --world given.
    Such a run plans memory, as --fsdp's always has (its report is per rank and per axis)."""
    if options.world is not None:
        return True
    if plan.version != 2:
        return False
    sizes = plan.mesh.sizes
    return (any(sizes[axis] != 1 for axis in DP_AXES) or plan.spec.fsdp is not None or plan.spec.checkpointing is not None
            or plan.spec.pipeline is not None)


def plans_world(options: ApplyOptions) -> bool:
    """Whether the options ask for a world's memory plan beyond the size of its batch
    (--world, --every-rank, a dtype, an optimizer or a memory limit, the flags' or the
    plan's training section's as `options.with_training` merged them): what sends a plan
    with context parallelism to memory planning rather than to one CUDA rank's shapes
    and ring (runtime/dryrun_cp.py), which --batch and --seq (and the section's
    global_batch and seq) size too."""
    train = options.train
    return options.world is not None or options.every_rank or any(
        value is not None for value in (train.dtype, train.optimizer, train.memory_limit, train.fsdp))


def check_world(options: ApplyOptions, plan: Plan) -> None:
    """The options that size the world, before anything is built: --world only for a
    version 2 plan (at least 1), --fsdp only for version 1, the plan's axes against
    --world (located, as under torchrun)."""
    from ..core.axes import world_problems

    if options.world is not None and options.world < 1:
        raise ApplyOptionsError("world", "below-one", f"{options.world} is not at least 1", world=options.world)
    if plan.version == 1:
        if options.world is not None:
            raise ApplyOptionsError("world", "version-1", "a version 1 plan's dry run simulates tp ranks (times fsdp's): "
                                    "the world size sizes a version 2 plan's mesh", world=options.world)
        return
    if options.train.fsdp:
        raise ApplyOptionsError("fsdp", "version-2", "FSDP on a dp dim is a version 1 plan's shorthand: a version 2 plan sets "
                                "mesh.dp_shard (and its fsdp section) instead")
    if options.world is not None and (problems := world_problems(plan, options.world)):
        raise PlanError(problems)


def world_of(options: ApplyOptions, plan: Plan, tp: int) -> int:
    """The world size at TP degree `tp`: --world, or the product of a version 2 plan's
    axes when none takes the rest (-1); a usage error when --world is needed."""
    if options.world is not None:
        return options.world
    rest = plan.mesh.rest_axis
    if rest is not None and rest != "tp":
        raise ApplyOptionsError("world", "missing", f"mesh.{rest} is -1 (the rest of the world): give the world size",
                                axis=rest)
    sizes = {**plan.mesh.sizes, "tp": tp}
    return math.prod(sizes[axis] for axis in WORLD_AXES)  # ep borrows its ranks from these


def dry_run_dims(options: ApplyOptions, plan: Plan, tp: int) -> MeshDims:
    """The mesh simulated at TP degree `tp`: version 1's tp alone, or (dp, tp) with
    --fsdp's dp; version 2's axes over `world_of` ranks (TP121 where they do not make
    that world at this degree)."""
    from ..core.axes import mesh_dims

    if plan.version == 1:
        return MeshDims(*mesh_shape(tp * options.train.dp, tp, plan.mesh_axis))
    world = world_of(options, plan, tp)
    try:
        shape, names = mesh_dims(plan, world, tp)
    except ValueError as exc:  # this degree does not make the world (another of the plan's may)
        raise PlanError([error("TP121", f"mesh at TP {tp} on {world} ranks: {exc}", plan.file,
                               *(plan.source.locate(("mesh",), key=True) if plan.source is not None else (1, 1)))]) from None
    if shape[-1] != tp:
        raise ApplyOptionsError("tp", "plan-mismatch", f"tp {tp}: the plan's mesh gives tp {shape[-1]} on {world} ranks",
                                tp=tp, plan_tp=shape[-1], world=world, dims=" × ".join(f"{n} {s}" for n, s in zip(names, shape)))
    return MeshDims(shape, names)
