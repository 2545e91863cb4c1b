"""FSDP2 / HSDP after the TP rules: a version 2 plan's `fsdp` section over its
dp_replicate and dp_shard axes (SPEC §7), and `--fsdp N`'s shorthand (a `dp` dim).

As torchtitan's `apply_fsdp`: `fully_shard` on each unit, innermost first, then on
the root, over the data-parallel mesh: 1-D (`dp_shard`, or `--fsdp`'s `dp`) for
FSDP, 2-D (`dp_replicate`, `dp_shard`) for HSDP, where FSDP2 replicates across the
first dim and shards across the second. The plan's DTensor parameters on `tp`
become 2-D (or 3-D) DTensors, sharded on the data axes as well. The modules of the
`experts` rules (whole experts over `ep`) are their own units, sharded over efsdp,
the ranks ep leaves of dp_shard·cp·tp (`shard_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..core.axes_spec import DP_AXES, TORCH_DTYPES
from ..core.problems import PlanError
from ..core.sections import fsdp_units

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


class Plan(Protocol):
    """What this module reads of a plan (core.plan's Plan, named by shape as in apply.py:
    Plan.apply calls down here)."""

    version: int
    spec: Any
    source: Any
    file: str

    def module_tree(self, model: Any) -> Any: ...

    def match_experts(self, model: Any) -> dict[str, Any]: ...


SHORTHAND_DIM = "dp"  # --fsdp's one data-parallel dim (a version 2 plan's are core.axes_spec.DP_AXES)


@dataclass(frozen=True)
class DataParallel:
    """What FSDP2 is asked to do: its unit globs (innermost first; None: each block of
    the largest ModuleList), always followed by the root, and its policies."""

    units: tuple[str, ...] | None = None
    reshard_after_forward: bool | int = True
    mixed_precision: Any = None  # the plan's MixedPrecisionSpec, or None
    offload: bool = False

    def describe(self, mesh: dict[str, int]) -> str:
        """A note for the report: what FSDP2 did, over which dims of `mesh` ({dim: size})."""
        where = "per block and root" if self.units is None else f"on {', '.join(self.units)} and the root"
        if SHORTHAND_DIM in mesh:  # --fsdp N
            return f"FSDP2 (fully_shard {where}) over the dp dim of {mesh[SHORTHAND_DIM]}, after the plan"
        kind = "HSDP" if mesh.get("dp_replicate", 1) > 1 else "FSDP2"
        dims = [dim for dim in DP_AXES if dim in mesh] + (["cp"] if mesh.get("cp", 1) > 1 else [])
        over = " × ".join(f"{dim} {mesh[dim]}" for dim in dims)
        return f"{kind} (fully_shard {where}) over {over}, after the plan" + (
            " (the cp ranks hold the same parameters: FSDP2 shards over them too)" if mesh.get("cp", 1) > 1 else "")


def blocks(model: "nn.Module") -> list[str]:
    """The repeated blocks FSDP wraps one by one: the children of the largest ModuleList."""
    from torch import nn

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, largest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{child}" if name else child for child, _ in largest.named_children()]


def data_parallel_of(plan: "Plan | None") -> DataParallel:
    """The plan's `fsdp` section, or today's default without one (each block, then the root)."""
    spec = plan.spec.fsdp if plan is not None and plan.version == 2 else None
    if spec is None:
        return DataParallel()
    units = None if spec.units is None else tuple(glob for glob in spec.units if glob != "")  # the root comes last anyway
    return DataParallel(units, spec.reshard_after_forward, spec.mixed_precision, spec.offload)


def unit_modules(plan: "Plan | None", model: "nn.Module", wanted: DataParallel) -> list[str]:
    """The fqns `fully_shard` wraps, innermost first, the root "" last: the plan's
    `fsdp.units` as `validate --model` checks them (core/sections.py's `fsdp_units`: a
    glob matching nothing is TP200, a module two globs match TP201, a unit listed after
    one that holds it TP129, each at its glob), or each block and the root."""
    if wanted.units is None:
        return [*blocks(model), ""]
    assert plan is not None  # units come from a plan's fsdp section
    tree, under = plan.module_tree(model)
    units, problems = fsdp_units(plan, tree, under)
    if problems:
        raise PlanError(problems)
    return units


def data_parallel_mesh(mesh: "DeviceMesh") -> "DeviceMesh | None":
    """The mesh FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, dp_shard (or
    --fsdp's dp) alone for FSDP; None where the mesh has no data-parallel dim. With a
    cp dim, dp_shard·cp flattened (torchtitan's dp_shard_cp): the cp ranks hold the
    same parameters and each computes gradients on its part of the sequence, so
    FSDP2 shards and reduces over them as over data-parallel ranks."""
    names = mesh.mesh_dim_names or ()
    shard = _shard_dim(mesh, names)
    if "dp_replicate" in names:
        if shard is None:
            raise ValueError(f"HSDP needs a dp_shard dim beside dp_replicate (size 1 for pure replication); the mesh has {names}")
        return mesh["dp_replicate", shard]
    if shard is not None:
        return mesh[shard]
    return mesh[SHORTHAND_DIM] if SHORTHAND_DIM in names else None


# dp_shard and cp flattened into one dim (torchtitan's name).
CP_SHARD_DIM = "dp_shard_cp"
# Every dim FSDP2 shards (or, HSDP's dp_replicate, replicates) parameters over, and
# all-gathers them back over for the forward and backward: the data axes, cp with them,
# --fsdp's dp, and the experts' efsdp (expert_mesh.EXPERT_DIMS).
FSDP_DIMS = (*DP_AXES, "cp", CP_SHARD_DIM, SHORTHAND_DIM, "efsdp")


def _shard_dim(mesh: "DeviceMesh", names: tuple[str, ...]) -> str | None:
    """The dim FSDP2 shards over: dp_shard, cp, or both flattened (CP_SHARD_DIM)."""
    if "cp" not in names:
        return "dp_shard" if "dp_shard" in names else None
    if "dp_shard" not in names:
        return "cp"
    mesh["dp_shard", "cp"]._flatten(CP_SHARD_DIM)  # torch 2.13's private API, as torchtitan uses it
    return CP_SHARD_DIM


def apply_data_parallel(plan: "Plan | None", model: "nn.Module", mesh: "DeviceMesh", wrap: list[str] | None = None,
                        units: list[str] | None = None) -> list[str]:
    """`fully_shard` the plan's experts over efsdp (`shard_experts`), then its units (`wrap`:
    these fqns instead of the default blocks where the plan names no units, as memory
    planning's block reuse asks; `units`: these fqns whatever the plan names, a pipeline
    stage's share of them) and the root over the mesh's data-parallel dims; returns
    the wrapped fqns (root: ""). Without data-parallel dims, the experts alone where ep
    leaves them replicated (efsdp above 1: e.g. tp 4, ep 2), so that their replicas reduce
    their gradients; else nothing."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from .expert_mesh import expert_data_parallel_mesh, expert_view

    dp_mesh = data_parallel_mesh(mesh)
    view = expert_view(plan, mesh) if plan is not None else None
    if dp_mesh is None and (view is None or expert_data_parallel_mesh(view).size() == 1):
        return []
    wanted = data_parallel_of(plan)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": wanted.reshard_after_forward}
    if (mp := wanted.mixed_precision) is not None:
        def dtype(name):
            return None if name is None else getattr(torch, TORCH_DTYPES[name])

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype(mp.param_dtype), reduce_dtype=dtype(mp.reduce_dtype),
                                                   output_dtype=dtype(mp.output_dtype))
    if wanted.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    experts = shard_experts(plan, model, mesh, kwargs)  # inside the units: wrapped first
    if dp_mesh is None:
        return experts
    if units is not None:  # resolved already: a pipeline stage's share of the whole model's units
        wrapped = [*units, ""]
    else:
        wrapped = [*wrap, ""] if wrap is not None and wanted.units is None else unit_modules(plan, model, wanted)
    for fqn in wrapped:
        if fqn not in experts:  # a unit that is an experts module is sharded over efsdp already
            fully_shard(model.get_submodule(fqn) if fqn else model, **kwargs)
    return [*experts, *(fqn for fqn in wrapped if fqn not in experts)]


def shard_experts(plan: "Plan | None", model: "nn.Module", mesh: "DeviceMesh", kwargs: dict[str, Any]) -> list[str]:
    """`fully_shard` each module a version 2 plan's `experts` rules placed over ep, over
    (dp_replicate,) efsdp (sharding/expert_mesh.py), as torchtitan's apply_fsdp does: the
    experts' parameters are sharded over the ranks ep leaves, the rest of the model over
    dp_shard. Their gradients are divided by the model's data-parallel degree (1 without
    data axes), not by efsdp: the all-to-all has already summed the tokens of the ep
    group's ranks, and efsdp's sum adds the other groups' tokens.
    Where efsdp·ep exceeds the expert count, FSDP shards dim 1 (dim 0 holds too few
    experts to split). Returns their fqns, none without experts rules."""
    from torch.distributed.tensor import Shard
    from torch.distributed.fsdp import fully_shard

    from ..core.expert_styles import expert_count
    from .expert_mesh import expert_data_parallel_mesh, expert_view

    view = expert_view(plan, mesh) if plan is not None else None
    if view is None:
        return []
    claimed = plan.match_experts(model)
    edp = expert_data_parallel_mesh(view)
    dp_mesh = data_parallel_mesh(mesh)
    efsdp, ep, factor = view["efsdp"].size(), view["ep"].size(), dp_mesh.size() if dp_mesh is not None else 1
    group = kwargs["reshard_after_forward"]
    if not isinstance(group, bool) and efsdp % group:  # a group of dp_shard ranks (TP125) is none of efsdp's
        group = True
    for fqn in claimed:
        module = model.get_submodule(fqn)
        dim_1 = efsdp * ep > (expert_count(module) or 0)
        fully_shard(module, **{**kwargs, "mesh": edp, "reshard_after_forward": group},
                    shard_placement_fn=(lambda param: Shard(1)) if dim_1 else None)
        if factor != edp.size():
            module.set_gradient_divide_factor(factor)
            if efsdp > 1:
                # torch divides with NCCL's PREMUL_SUM otherwise, which gloo lacks: sum, then divide.
                # Not on one efsdp rank: torch 2.13 copies the gradient divided by the factor
                # there and would divide it again after a forced sum.
                module.set_force_sum_reduction_for_comms(True)
    return list(claimed)
