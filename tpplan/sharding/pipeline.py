"""A version 2 plan's pipeline stages as modules (SPEC §8): each stage is the model
with the other stages' modules removed, its parameters keeping the model's names
(so a DCP checkpoint reshards across PP degrees), run by the model's own forward.

Removed, as torchtitan's manual split does: a block of the module list is deleted
from the list's `_modules` (the list iterates over the blocks it holds, each under
its own number: `layers.3` stays `layers.3`); any other unit (the embeddings, the
final norm, the head) becomes `NotInStage`, which hands its input on, as
torchtitan's forward skips a module set to None (`h = self.tok_embeddings(tokens)
if self.tok_embeddings else tokens`) and transformers' `base_model_pp_plan` passes
the hidden states through. A non-first stage is given the hidden states where the
model takes token ids; the last stage's output is the logits (a model output's
`.logits`, as the loss reads it).

Which stage a rank holds: stage `pp_rank + k·pp` for the looped schedules, `pp_rank`
and `2·pp − 1 − pp_rank` for the V schedules (torch's `ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.problems import PlanError, Problem, error
from ..core.stages import OTHER_STAGES, split_units, stage_problems

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class NotInStage(nn.Module):
    """A unit of another stage: hands its first input (the hidden states) on."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def stages_of(plan: Any, model: nn.Module) -> tuple[list[list[str]], list[str]]:
    """(the units of each stage, in stage order; every unit) of `model` as the plan's
    pipeline cuts it; a PlanError where it cannot (`stage_problems_of`)."""
    stages, units, problems = stage_problems_of(plan, model)
    if problems:
        raise PlanError(problems)
    return stages, units


def stage_problems_of(plan: Any, model: nn.Module) -> tuple[list[list[str]], list[str], list[Problem]]:
    """The stages, the units and the problems of the plan's pipeline on `model`: those of
    the module names (core/stages.py: TP154–TP157), then parameters tied across stages
    (TP159)."""
    tree, _ = plan.module_tree(model)
    modules = dict(model.named_modules())
    stages, problems = stage_problems(plan, tree, lambda fqn: next(modules[fqn].parameters(), None) is not None)
    if not problems:
        problems = _tied_across(plan, model, stages)
    return stages, split_units(tree)[0], problems


def _tied_across(plan: Any, model: nn.Module, stages: list[list[str]]) -> list[Problem]:
    """TP159 for each parameter that modules of two stages share (tied embeddings and head):
    each stage would hold and train its own copy."""
    from .tied import shared_parameters

    def stage_of(fqn: str) -> int | None:
        return next((i for i, units in enumerate(stages) for unit in units if fqn == unit or fqn.startswith(unit + ".")), None)

    pipe, problems = plan.spec.pipeline, []
    key = ("pipeline", "stages" if pipe.stages is not None else "layers_per_stage")
    at = plan.source.locate(key) if plan.source is not None else (1, 1)
    for group in shared_parameters(model):
        held = {(stage_of(fqn), f"{fqn}.{name}" if fqn else name) for fqn, name in group}
        if len({stage for stage, _ in held}) > 1:
            (a_stage, a), (b_stage, b) = sorted(held, key=lambda item: (item[0] is None, item[0] or 0))[:2]
            problems.append(error("TP159", f"pipeline: '{a}' (stage {a_stage}) and '{b}' (stage {b_stage}) are one tied "
                                           "parameter: each stage would train its own copy; untie them (transformers: "
                                           "tie_word_embeddings: false) or put both modules in one stage", plan.file, *at))
    return problems


def keep_stage(model: nn.Module, units: list[str], kept: list[str]) -> nn.Module:
    """`model` with the units (with parameters) outside `kept` removed, in place (module
    docstring); units without parameters (a rotary table) stay: every stage runs them.
    Blocks removed already (`drop_blocks`) count as dropped."""
    kept_set = set(kept)
    dropped = []
    for unit in units:
        parent, _, name = unit.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if unit in kept_set or (name in owner._modules and next(owner._modules[name].parameters(), None) is None):
            continue
        dropped.append(unit)
        if isinstance(owner, (nn.ModuleList, nn.ModuleDict)):
            owner._modules.pop(name, None)  # not `del owner[i]`: a ModuleList would renumber the blocks after it
        else:
            setattr(owner, name, NotInStage())
    setattr(model, OTHER_STAGES, tuple(dropped))
    return model


def drop_blocks(model: nn.Module, units: list[str], kept: list[str]) -> Callable[[], None]:
    """The blocks of the module list outside `kept` removed, in place, the other units left
    (the TP rules may name them); returns what puts them back, in their order."""
    originals: dict[int, tuple[nn.Module, dict]] = {}
    kept_set = set(kept)
    for unit in units:
        parent, _, name = unit.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if unit not in kept_set and isinstance(owner, (nn.ModuleList, nn.ModuleDict)):
            originals.setdefault(id(owner), (owner, dict(owner._modules)))
            del owner._modules[name]

    def restore() -> None:
        for owner, modules in originals.values():
            owner._modules = modules

    return restore


def output_tensor(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook on a stage: it hands on a tensor (torch's `PipelineStage` sends
    tensors), a model output's `.logits` (the hidden states, where the head is another
    stage's)."""
    return output.logits if hasattr(output, "logits") else output


def whole_model_units(plan: Any, model: nn.Module) -> list[str]:
    """The plan's FSDP2 units of the whole model (root excluded): each stage wraps its share (`held_units`)."""
    from .data_parallel import data_parallel_of, unit_modules

    return [fqn for fqn in unit_modules(plan, model, data_parallel_of(plan)) if fqn]


def held_units(stage: nn.Module, units: "list[str] | tuple[str, ...]") -> list[str]:
    """The units of `units` that `stage` holds with parameters (not another stage's)."""
    held = dict(stage.named_modules())
    return [fqn for fqn in units if fqn in held and next(held[fqn].parameters(), None) is not None]


def after_split(plan: Any, model: nn.Module, mesh: "DeviceMesh", stages: list[list[str]], units: list[str],
                data_parallel: bool) -> tuple[list[int], list[nn.Module]]:
    """This pp rank's stage indices and modules, from `model` already laid out by the TP
    rules and checkpointed: each stage the model with the other stages' units removed
    (a copy per stage but the last, which takes the model itself), FSDP2 over the data
    axes on each (`data_parallel`; the stage its root, its share of the plan's units),
    its output a tensor (`output_tensor`)."""
    import copy

    from .data_parallel import apply_data_parallel

    ids = plan.stage_ids(mesh)
    fsdp_units = whole_model_units(plan, model) if data_parallel else None
    modules = []
    for k, index in enumerate(ids):
        stage = model if k == len(ids) - 1 else copy.deepcopy(model)
        keep_stage(stage, units, stages[index])
        if fsdp_units is not None:
            apply_data_parallel(plan, stage, mesh, units=held_units(stage, fsdp_units))
        stage.register_forward_hook(output_tensor)
        modules.append(stage)
    return ids, modules


def apply_pipeline(plan: Any, model: nn.Module, mesh: "DeviceMesh") -> list[nn.Module]:
    """`Plan.pipeline_stages`: the TP rules, activation checkpointing, then this pp rank's
    stages (`after_split`) with FSDP2 over the mesh's data dims."""
    from .activation_checkpoint import apply_activation_checkpointing
    from .apply import apply_plan
    from .data_parallel import data_parallel_mesh

    stages, units = stages_of(plan, model)
    apply_plan(plan, model, mesh)
    apply_activation_checkpointing(plan, model)
    return after_split(plan, model, mesh, stages, units, data_parallel_mesh(mesh) is not None)[1]
