"""`tpplan apply` of a version 2 plan with a pipeline, under torchrun (SPEC §8): each
pp rank runs its stages of the model with torch's `PipelineStage` and the plan's
schedule, each stage with the TP rules, activation checkpointing and FSDP2 over the
data axes of its own ranks, in torchtitan's order (TP → AC → the stage split →
FSDP2 on each stage, the stage its root).

Every rank builds the whole model (its weights the same everywhere: one seed), shards
it over tp, checkpoints what the plan says, then keeps its own stages' units
(`sharding/pipeline.py`: parameter names unchanged) and drops the rest; a rank of
several stages (interleaved and V schedules) keeps a copy per stage. Every rank is
given the same batch (as `apply` gives every data-parallel rank one batch), cut by
the schedule into its microbatches; the loss of each microbatch is the training
step's (`simulation/training.training_loss`), and torch's schedule divides the summed
gradients by the microbatch count, so the step equals one step on the whole batch.

`--check` compares with the model on one device: the loss and every gradient of
one step, and with `--steps N` the loss of each step and every parameter after them;
each rank compares the parameters its stages hold, by their names.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING

from ..check.result import CheckResult
from ..core.plan import Plan
from ..core.stages import split_batch, stage_rank
from .options import ApplyOptionsError
from .ranks import Ran, Rank, load_checkpoint_of

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .options import ApplyOptions


def apply_pipelined(ctx: "Rank", options: "ApplyOptions", plan: Plan, model: "nn.Module", ran: "Ran", event) -> None:
    """Shard, split into this rank's stages and run the schedule; fills `ran` (its
    problems: why it stopped)."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    from ..sharding.activation_checkpoint import apply_activation_checkpointing
    from ..sharding.pipeline import after_split, stages_of
    from ..simulation.locate import shard_with_progress
    from ..simulation.modelref import make_inputs
    from ..simulation.training import make_targets
    from .options import input_size

    pipe = plan.spec.pipeline
    mesh = plan.build_mesh(ctx.world, ctx.device.type, ran.tp)
    reference = copy.deepcopy(model) if options.check and not options.checkpoint else None
    stages, units = stages_of(plan, model)

    ran.sharded = shard_with_progress(plan, model, mesh, event)
    if options.checkpoint:  # into the whole model on every rank, before it is cut: a stage copies its part
        reference = load_checkpoint_of(ctx, options, model, ran, event)
    torch.manual_seed(options.seed + 1)  # the same inputs on every rank, as apply's (after a load: on its device)
    size = input_size(options, plan, ran.mesh)
    inputs = make_inputs(options.inputs, model, ctx.device, batch=split_batch(plan, size.get("batch"))[0], **({"seq": size["seq"]} if "seq" in size else {}))
    microbatches = microbatch_count(plan, inputs)
    targets = make_targets(model, inputs, torch.Generator().manual_seed(options.seed + 2))
    checkpointed = apply_activation_checkpointing(plan, model)
    event(f"pipeline stages of {len(stages)}")
    ids, modules = after_split(plan, model, mesh, stages, units, ran.data_parallel)
    ran.pipeline = {"schedule": pipe.schedule, "microbatches": microbatches,
                    "stages": [{"stage": i, "modules": units_, "pp_rank": stage_rank(i, ran.mesh["pp"], pipe.schedule)}
                               for i, units_ in enumerate(stages)]}
    ran.notes += _notes(plan, ran, checkpointed, microbatches)
    torch_stages = [PipelineStage(stage, index, len(stages), ctx.device, group=mesh["pp"].get_group())
                    for stage, index in zip(modules, ids)]
    schedule = _schedule(pipe.schedule, torch_stages, microbatches, plan.loss_parallel)
    holds_first, holds_last = 0 in ids, len(stages) - 1 in ids

    def step(optimizer) -> tuple[float | None, float]:
        from ..simulation.training import loss_context

        for stage in modules:
            stage.zero_grad(set_to_none=True)
        losses: list = []
        start = time.perf_counter()
        try:
            with loss_context(plan.loss_parallel):
                # return_outputs=False: the last stage keeps no microbatch's logits (the losses are what is read)
                schedule.step(*(inputs if holds_first else ()), **({"target": targets, "losses": losses} if holds_last else {}),
                              return_outputs=False)
        except Exception as exc:  # the model's forward on a stage, torch's schedule, or a peer gone
            raise _stage_failure(plan, exc, [(index, stages[index]) for index in ids]) from None
        if optimizer is not None:
            optimizer.step()
        seconds = time.perf_counter() - start
        return (float(torch.stack([loss.detach().float() for loss in losses]).mean()) if losses else None), seconds

    event("forward and backward")
    loss, ran.step_time_s = step(None)
    grads = {name: _full(p.grad) for stage in modules for name, p in stage.named_parameters() if p.grad is not None}
    if reference is not None:
        event("checking against a single device")
        ran.check = _check_step(ctx, plan, reference, inputs, targets, loss, grads)
    if options.steps:
        from ..simulation.training import OPTIMIZER_NAMES, make_optimizer

        name = options.train.optimizer_name
        event(f"{options.steps} {OPTIMIZER_NAMES[name]} steps")
        optimizer = make_optimizer(name, torch.nn.ModuleList(modules))  # this rank's stages as one, for the optimizer
        losses, times = [], []
        for _ in range(options.steps):
            loss, seconds = step(optimizer)
            losses.append(loss)
            times.append(seconds)
        from .report import StepsResult

        all_losses = [_gathered_loss(ctx, plan, value) for value in losses]
        ran.steps = StepsResult(all_losses, times, OPTIMIZER_NAMES[name])
        if reference is not None:
            trained = _check_steps(ctx, plan, modules, reference, inputs, all_losses, name, options.seed)
            ran.check = CheckResult(passed=ran.check.passed and trained.passed, max_abs_diff=ran.check.max_abs_diff,
                                    problems=ran.check.problems + trained.problems)
            ran.steps.max_abs_diff = trained.max_abs_diff
    if options.save:  # each rank its stages' keys, under the model's names: it loads under any layout
        from ..checkpoint.run import save_from

        event(f"saving to {options.save}")
        ran.saved = save_from(modules, options.save, options.save_format, plan)


def _stage_failure(plan: Plan, exc: Exception, held: list[tuple[int, list[str]]]) -> Exception:
    """A failed step as what it is: tpplan's bug (raised as it was), a collective that failed
    (a peer stage's rank crashed: TP504), or the model's forward failing on a stage (TP158)."""
    from ..core.problems import PlanError, error, first_line, raised_by_tpplan
    from ..simulation.comm import CommFailure, comm_problem, is_comm_failure

    if raised_by_tpplan(exc):
        return exc
    if is_comm_failure(exc):
        return CommFailure(comm_problem(plan, "running the pipeline's schedule", exc))
    stages = "; ".join(f"stage {index} ({', '.join(units)})" for index, units in held)
    at = plan.source.locate(("pipeline",), key=True) if plan.source is not None else (1, 1)
    return PlanError([error("TP158", f"pipeline: the model's forward fails on this rank's {stages}, run with the other "
                                     f"stages' modules removed: {first_line(exc)}. A forward that reads the sequence length "
                                     "from its input cannot take a sequence-parallel boundary, where each rank hands on its "
                                     "shard of the sequence", plan.file, *at)])


def microbatch_count(plan: Plan, inputs: tuple) -> int:
    """The plan's microbatches of the batch of `inputs` (core/stages.split_batch); a usage
    error where the batch of `--inputs` does not split into them."""
    batch = inputs[0].shape[0]
    try:
        return split_batch(plan, batch)[1]
    except ValueError as exc:
        raise ApplyOptionsError("inputs", "microbatches", str(exc), batch=batch) from None


def _schedule(name: str, stages: list, microbatches: int, loss_parallel: bool):
    """torch's schedule `name` over this rank's stages, its loss the training step's."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from ..simulation.training import training_loss

    def loss_fn(output, target):
        return training_loss(output, target, loss_parallel)

    cls = get_schedule_class(name)
    return cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def _notes(plan: Plan, ran: "Ran", checkpointed: list[str], microbatches: int) -> list[str]:
    from ..simulation.fsdp import after_rules_notes

    pipe = plan.spec.pipeline
    data = {dim: size for dim, size in ran.mesh.items() if dim != "pp"} if ran.data_parallel else None
    stages = ran.pipeline["stages"]
    cut = "; ".join(f"stage {stage['stage']} on pp {stage['pp_rank']}: " + _span(stage["modules"]) for stage in stages)
    return [f"pipeline: {pipe.schedule} over pp {ran.mesh['pp']}, {len(stages)} stages, {microbatches} microbatches per step ({cut})",
            *after_rules_notes(plan, checkpointed, data)]


def _span(units: list[str]) -> str:
    """A stage's units in a few words: all of up to three, else the first and the last."""
    return ", ".join(units) if len(units) <= 3 else f"{units[0]} … {units[-1]} ({len(units)} units)"


def _full(tensor: "torch.Tensor") -> "torch.Tensor":
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _gathered_loss(ctx: "Rank", plan: Plan, loss: float | None) -> float:
    """The step's loss, which the ranks of the last stage hold, on every rank."""

    return next(value for value in ctx.gather(loss, plan, "sharing the pipeline's loss") if value is not None)


def _check_step(ctx: "Rank", plan: Plan, reference: "nn.Module", inputs: tuple, targets, loss: float | None, grads: dict) -> CheckResult:
    """One step's loss (on the ranks of the last stage, which compute it) and the gradients
    this rank's stages hold against one device, merged over the ranks."""
    import math

    import torch

    from ..check.verify import merge_ranks
    from ..simulation.simulate import allowed_diff, max_abs_diff, tolerance
    from ..simulation.training import training_loss

    want_loss = training_loss(reference(*inputs), targets)
    want_loss.backward()
    problems, worst = [], 0.0
    rtol, atol = tolerance(torch.float32)
    if loss is not None and not abs(loss - want_loss.item()) <= atol + rtol * abs(want_loss.item()):
        problems.append(f"loss {loss:.7g}, single device {want_loss.item():.7g}")
    wanted = dict(reference.named_parameters())
    for name, got in grads.items():
        want = wanted[name].grad
        diff, limit = max_abs_diff(got, want), allowed_diff(want, *tolerance(want.dtype))
        if not diff <= limit:
            problems.append(f"{name}.grad differs by up to {diff:.3g} (allowed {limit:.3g})")
        worst = math.inf if math.isnan(diff) else max(worst, diff)
    reference.zero_grad(set_to_none=True)
    local = CheckResult(passed=not problems, max_abs_diff=worst, problems=problems[:10])
    return merge_ranks(ctx.gather(local, plan, "comparing the check results"))


def _check_steps(ctx: "Rank", plan: Plan, modules: list, reference: "nn.Module", inputs: tuple, losses: list[float],
                 optimizer: str, seed: int) -> CheckResult:
    from ..check.training import compare_training
    from ..check.verify import merge_ranks

    held = {name: p for stage in modules for name, p in stage.named_parameters()}
    return merge_ranks(ctx.gather(compare_training(held, reference, inputs, losses, optimizer, seed), plan, "comparing the training"))
