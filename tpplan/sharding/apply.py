"""The one applier (as torch's `parallelize_module` beside its styles): a plan
resolved against a model, each claimed module's style compiled and applied, tied
parameters tied again. `Plan.apply` and the runtime's located application both
call `apply_plan`; a module that cannot be sharded is a `ModuleShardingError`
naming the rule, the module and the error torch (or the model) raised.

    claimed = apply_plan(plan, model, mesh)  # {fqn: rule}, in module order
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from ..core.problems import PlanError, raised_by_tpplan, reason
from .compile import StyleClassError, compile_for
from .styles import ParallelStyle
from .tied import retie, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..core.problems import Problem


# What the applier reads of a plan and its rules (core.plan's Plan and Rule). They are
# named by shape, not imported: Plan.apply calls down into this module (SPEC's
# `plan.apply(model, mesh)`), so importing them back would make the two a cycle.
class Rule(Protocol):
    pattern: str
    spec: Any  # the rule's style spec (core.style_model)

    def problem(self, code: str, message: str) -> "Problem": ...


class Plan(Protocol):
    version: int
    spec: Any  # the plan's sections (version 2: fsdp, checkpointing)
    mesh: Any  # core.axes.NamedMesh: every axis by name

    @property
    def src_data_rank(self) -> int | None: ...

    def tp_mesh(self, mesh: "DeviceMesh") -> "DeviceMesh": ...

    def match(self, model: nn.Module) -> dict[str, Rule]: ...

    def match_experts(self, model: nn.Module) -> dict[str, Any]: ...


class ModuleShardingError(PlanError):
    """Applying `rule`'s style to the module `fqn` raised `error` (torch's, the
    model's, or a style's `StyleInputError`): TP501 at the rule. A tpplan bug is
    never one: it escapes as it was raised."""

    def __init__(self, rule: "Rule", fqn: str, module: nn.Module, tp: int, error: BaseException, axis: str = "TP"):
        self.rule, self.fqn, self.module, self.tp, self.error = rule, fqn, module, tp, error
        super().__init__([rule.problem(
            "TP501",
            f"{rule.spec.style} cannot shard '{fqn or '<root>'}' ({type(module).__name__}{_parameter_shapes(module)}) "
            f"at {axis} {tp}: {reason(error)}",
        )])

    def __reduce__(self):  # pickled (torchrun ranks send errors to each other) as the PlanError it is
        return PlanError, (self.problems,)


def apply_plan(
    plan: "Plan", model: nn.Module, mesh: "DeviceMesh", on_module: Callable[[int, int, str], None] | None = None
) -> dict[str, "Rule"]:
    """Parallelize `model` in place over the plan's mesh axis; returns {fqn: the rule
    that claimed it}, in module order. `on_module(done, total, fqn)` after each module.

    PlanError: the plan does not match the model (TP200, TP201), a class it names
    cannot be used (TP306), tied parameters got different layouts (TP210); a
    `ModuleShardingError` (TP501) when a module's style fails on it."""
    tp_mesh = plan.tp_mesh(mesh)  # a mesh without the plan's axis is the caller's ValueError, not a module's
    claimed = plan.match(model)
    tied = shared_parameters(model)
    # Descendants first: a parent's NoParallel then replicates only what no more
    # specific rule has sharded already.
    order = list(reversed(claimed.items()))
    for done, (fqn, rule) in enumerate(order, start=1):
        _apply_rule(plan, model, fqn, rule, tp_mesh)
        if on_module is not None:
            on_module(done, len(order), fqn)
    problems = []
    for group, described in retie(model, tied):
        rule = next(r for r in (_claiming_rule(claimed, fqn) for fqn, _ in group) if r is not None)
        problems.append(rule.problem(
            "TP210",
            f"tied parameters got different layouts: {described}; give their modules styles that shard "
            "the same dim (a rowwise Embedding and a colwise Linear both shard(0)) or untie them",
        ))
    if problems:
        raise PlanError(problems)
    return claimed


def resolve(plan: "Plan", model: nn.Module) -> dict[str, ParallelStyle]:
    """{concrete module path: a fresh ParallelStyle}, in module order (what `apply_plan` applies)."""
    return {fqn: compiled(rule, plan.src_data_rank, model.get_submodule(fqn)) for fqn, rule in plan.match(model).items()}


def compiled(rule: "Rule", src_data_rank: int | None, module: nn.Module) -> ParallelStyle:
    """The rule's style object for `module` (a LoRA-wrapped Linear: the style that shards
    its base layer, its adapters following, sharding/lora.py); a class the plan names
    that cannot be used is TP306 at the rule."""
    try:
        return compile_for(rule.spec, module, src_data_rank)
    except StyleClassError as exc:
        raise PlanError([rule.problem("TP306", f"rule '{rule.pattern}': {exc}")]) from None


def _apply_rule(plan: "Plan", model: nn.Module, fqn: str, rule: "Rule", mesh: "DeviceMesh", axis: str = "TP") -> None:
    """`rule`'s style on the module `fqn` over the 1-D `mesh` (the tp dim; the ep dim for an experts rule)."""
    module = model.get_submodule(fqn)
    try:
        style = compiled(rule, plan.src_data_rank, module)
        if rule.spec.needs_parent():  # colwise with heads: the attention module holding it
            style.bind_parent(model.get_submodule(fqn.rpartition(".")[0]))
        parallelize_module(module, mesh, style, src_data_rank=plan.src_data_rank)
    except PlanError:
        raise
    except Exception as exc:  # torch raises anything from deep inside; it becomes the rule's error
        if raised_by_tpplan(exc):
            raise  # tpplan's own code: a bug, shown as one
        raise ModuleShardingError(rule, fqn, module, mesh.size(), exc, axis) from exc


def apply_experts(
    plan: "Plan", model: nn.Module, mesh: "DeviceMesh", on_module: Callable[[int, int, str], None] | None = None
) -> dict[str, Any]:
    """EP after the TP rules (torchtitan's order): each module a version 2 plan's `experts`
    rules match gets its style over the ep dim of the mesh's expert view (expert_mesh.py:
    ep borrows its ranks from dp_shard·cp·tp); returns {fqn: the experts rule}, none
    without the section. A glob matching nothing (TP200), a module two experts rules
    match (TP201) or that a TP rule lays out too (TP201: its parameters would be placed
    twice) is the plan's error at the experts rule (`Plan.match_experts`, which callers
    run before the TP rules too)."""
    from .expert_mesh import expert_view

    view = expert_view(plan, mesh)
    if view is None:
        return {}
    claimed = plan.match_experts(model)
    _refuse_laid_out(plan.match(model), claimed, model)
    ep_mesh = view["ep"]
    order = list(claimed.items())
    for done, (fqn, entry) in enumerate(order, start=1):
        _apply_rule(plan, model, fqn, entry, ep_mesh, "ep")
        if on_module is not None:
            on_module(done, len(order), fqn)
    return claimed


def _refuse_laid_out(tp_claimed: dict[str, "Rule"], claimed: dict[str, Any], model: nn.Module) -> None:
    """TP201 at the experts rule where a TP rule on an ancestor (no_parallel, sequence_parallel:
    styles that lay out a whole subtree) already made the experts' parameters DTensors on
    tp: the expert style would keep that layout and shard nothing over ep."""
    from torch.distributed.tensor import DTensor

    problems = []
    for fqn, entry in claimed.items():
        module = model.get_submodule(fqn)
        if not any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            continue
        rule = _claiming_rule(tp_claimed, fqn)
        by = f"rule '{rule.pattern}' ({rule.spec.style}, {rule.where})" if rule is not None else "the TP rules"
        problems.append(entry.problem("TP201", (
            f"experts rule '{entry.pattern}': the parameters of '{fqn}' were laid out over tp by {by} already, so "
            "they cannot be placed over ep: a module takes one style; narrow that rule so that it leaves the experts out")))
    if problems:
        raise PlanError(problems)


def _parameter_shapes(module: nn.Module) -> str:
    shapes = [f"{key} {tuple(p.shape)}" for key, p in module.named_parameters(recurse=False)]
    return f", {', '.join(shapes)}" if shapes else ""


def _claiming_rule(claimed: dict[str, "Rule"], fqn: str) -> "Rule | None":
    """The rule on `fqn` or on its closest ancestor (NoParallel and sequence_parallel
    lay out the parameters of the whole subtree)."""
    while fqn not in claimed and fqn:
        fqn = fqn.rpartition(".")[0]
    return claimed.get(fqn)


def apply_every_axis(
    plan: "Plan", model: nn.Module, mesh: "DeviceMesh", on_module: Callable[[int, int, str], None] | None = None
) -> None:
    """`Plan.apply`: the TP rules, then a version 2 plan's context parallelism, experts
    over ep, activation checkpointing and FSDP2/HSDP over its data axes (and cp; the
    experts' over efsdp), in torchtitan's order. A version 1 plan is the TP axis alone:
    its caller shards the data axes (examples/train.py)."""
    from .activation_checkpoint import apply_activation_checkpointing
    from .context_parallel import apply_context_parallel, cp_mesh, refuse_device
    from .data_parallel import apply_data_parallel

    if plan.version == 2 and (plan.mesh.sizes["dp_replicate"] != 1 or plan.mesh.sizes["dp_shard"] != 1):
        names = mesh.mesh_dim_names or ()
        if "dp_shard" not in names:  # before any module is touched
            raise ValueError(f"the plan has data-parallel axes but the mesh has dims {tuple(names)}: "
                             "build it with plan.build_mesh(world), or name its dims dp_replicate, dp_shard and tp")
    if plan.version == 2 and plan.mesh.sizes["cp"] != 1:  # before any module is touched, too
        refuse_device(plan, cp_mesh(mesh).device_type)
    plan.match_experts(model)  # the experts rules' problems, before any module is touched
    apply_plan(plan, model, mesh, on_module)
    if plan.version == 2:
        apply_context_parallel(plan, model, mesh)
        apply_experts(plan, model, mesh, on_module)
        apply_activation_checkpointing(plan, model)
        apply_data_parallel(plan, model, mesh)


def build_mesh(plan: "Plan", world: int, device_type: str = "cpu", tp: int | None = None) -> "DeviceMesh":
    """`Plan.build_mesh`: the named mesh of `core.axes.mesh_dims`, and with `experts`
    rules its expert view (dp_replicate, efsdp, ep), unflattened from the same ranks now,
    on every rank in the same order (expert_mesh.py), and found again by `apply_experts`."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..core.axes import mesh_dims
    from .expert_mesh import expert_view

    shape, names = mesh_dims(plan, world, tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    expert_view(plan, mesh)
    return mesh
