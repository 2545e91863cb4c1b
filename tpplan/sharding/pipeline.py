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

from typing import Any

from torch import nn

from ..core.axes_spec import V_SCHEDULES
from ..core.problems import PlanError
from ..core.stages import split_units, stage_problems


class NotInStage(nn.Module):
    """A unit of another stage: hands its first input (the hidden states) on."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def stages_of(plan: Any, model: nn.Module) -> tuple[list[list[str]], list[str]]:
    """(the units of each stage, in stage order; every unit) of `model` as the plan's
    pipeline cuts it (core/stages.py); a PlanError where it cannot (TP154–TP157)."""
    tree, _ = plan.module_tree(model)
    modules = dict(model.named_modules())
    stages, problems = stage_problems(plan, tree, lambda fqn: next(modules[fqn].parameters(), None) is not None)
    if problems:
        raise PlanError(problems)
    return stages, split_units(tree)[0]


def rank_stages(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices the pp rank `pp_rank` runs, in the order its schedule takes them."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def keep_stage(model: nn.Module, units: list[str], kept: list[str]) -> nn.Module:
    """`model` with the units (with parameters) outside `kept` removed, in place (module
    docstring); units without parameters (a rotary table) stay: every stage runs them."""
    kept_set = set(kept)
    for unit in units:
        if unit in kept_set or next(model.get_submodule(unit).parameters(), None) is None:
            continue
        parent, _, name = unit.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(owner, (nn.ModuleList, nn.ModuleDict)):
            del owner._modules[name]  # not `del owner[i]`: a ModuleList would renumber the blocks after it
        else:
            setattr(owner, name, NotInStage())
    return model


def output_tensor(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook on a stage: it hands on a tensor (torch's `PipelineStage` sends
    tensors), a model output's `.logits` (the hidden states, where the head is another
    stage's)."""
    return output.logits if hasattr(output, "logits") else output
