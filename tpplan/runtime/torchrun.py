"""`tpplan apply` under torchrun, on each rank: process group, mesh, plan
consensus, sharding, one forward and backward, `--check`, `--steps`.

Small steps that return what they found; `_run` assembles the report from them.
Everything that can go wrong is data until the edge: the model and plan become
`Problem`s (located at the rule that caused them), options that cannot be run
a typed `UsageError`; the CLI words and prints them and picks the exit code.

    torchrun --nproc-per-node 2 -m tpplan apply --plan plans/llama_tp_sp.yaml \\
        --model tpplan.models.llama:tiny --check
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.axes_spec import DP_AXES
from ..core.plan import Plan
from ..core.problems import PlanError, Problem, error, first_line, raised_by_tpplan
from ..check.result import CheckResult
from .report import ApplyReport, StepsResult
from ..simulation.comm import CommFailure, comm_problem, is_comm_failure
from .consensus import disagreements, gather_states, rank_state, usage_errors
from ..check.check_problems import check_problems
from .devices import fsdp_tp, init_process_group, mesh_shape, pick_device, rank_device, synchronize, torchrun_env
from ..simulation.layouts import param_layouts
from ..simulation.locate import FailureLocator, run_located, shard_with_progress, unpromised_tp_note
from ..simulation.modelref import ModelRefError, build_model, make_inputs, module_structure
from .ranks import Ran, Rank, load_checkpoint_of
from .options import ApplyOptions, ApplyOptionsError, RanksUsageError, UsageError, input_size, refuse_unapplied

if TYPE_CHECKING:
    from torch import nn


@dataclass
class _Loaded:
    """What a rank has before consensus: the plan and model, or why not."""

    plan: Plan | None = None
    model: "nn.Module | None" = None
    structure: list | None = None
    mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None
    problems: list[Problem] = field(default_factory=list)
    usage: UsageError | ModelRefError | None = None


def run_torchrun(options: ApplyOptions, on_event: Callable[[str], None] | None = None,
                 publish: Callable[[ApplyReport], None] | None = None) -> ApplyReport:
    """`tpplan apply` on this rank of a torchrun job; every rank returns the same
    report verdict (rank 0's numbers). Raises UsageError (typed: ApplyOptionsError,
    RanksUsageError) for a run that cannot be done as asked. `publish(report)` (the
    CLI's printing) runs on every rank; where every rank stopped at the plan's checks,
    no rank goes on before all have printed: torchrun stops the other workers when the
    first one exits, so a rank that printed and left early would cut the others'
    located errors short. (A run that failed later may have a rank stuck on a dead
    peer: there the ranks leave as they finish.) The process group is destroyed on
    every path."""
    import torch.distributed as dist

    rank, world, local_rank = torchrun_env()
    device = rank_device(pick_device(options.device), local_rank)
    try:
        backend = init_process_group(device, options.timeout)
    except (RuntimeError, ValueError) as exc:  # rendezvous or backend failure: nothing to tear down
        report = ApplyReport(mode="torchrun", plan_file=options.plan, model=options.model, world_size=world, device=device.type)
        report.problems = [error("TP504", f"rank {rank}: initialising the process group failed: {first_line(exc)}", options.plan)]
        return report
    try:
        control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=options.timeout))
        report, stopped = _run(Rank(rank, world, device, backend, control), options, on_event or (lambda text: None))
        if publish is not None:
            publish(report)
            if stopped:  # every rank stopped at the same check, in step: each waits for the others' report
                _together(control, options.timeout)
        return report
    finally:
        dist.destroy_process_group()


# How long a rank that has printed its report waits for the others to print theirs: they
# end together when they do (the collectives keep them in step); a rank that never comes
# is stuck on a peer that died, which torchrun and the reports already say.
PUBLISH_WAIT_S = 30.0


def _together(control, timeout: float) -> None:
    """Wait for every rank to have published its report, at most PUBLISH_WAIT_S (or the
    run's own timeout, if shorter)."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=control, timeout=timedelta(seconds=min(timeout, PUBLISH_WAIT_S)), wait_all_ranks=True)
    except RuntimeError:  # the barrier only orders the printing: what each rank found is already out
        return


def _run(ctx: Rank, options: ApplyOptions, event: Callable[[str], None]) -> tuple[ApplyReport, bool]:
    """Load, agree across ranks, apply and run: each step returns what it found. The
    report, and whether every rank stopped before applying (the plan's checks, the
    ranks' agreement): then no collective is left pending between them."""
    loaded = _load(ctx, options, event)
    event("comparing plans across ranks")
    try:
        stopped = _agree(ctx, loaded, options.timeout)
    except CommFailure as exc:
        stopped = [exc.problem]
    if stopped:
        return _report(ctx, options, loaded, None, stopped), True
    assert loaded.plan is not None and loaded.model is not None and loaded.mesh is not None
    ran = _apply_and_run(ctx, options, loaded.plan, loaded.model, loaded.mesh, event)
    report = _report(ctx, options, loaded, ran, [])
    # under FSDP2 a rank holds a dp shard of its layout (the memory plan's figure); a pp rank its stages
    if not ran.problems and not ran.data_parallel and ran.pipeline is None:
        _assert_held(ctx, loaded.model, report)
    return report, False


def _report(ctx: Rank, options: ApplyOptions, loaded: _Loaded, ran: Ran | None, stopped: list[Problem]) -> ApplyReport:
    """The one place the report is assembled: from the problems that stopped every
    rank before sharding, or from what applying and running found."""
    plan = loaded.plan
    found = dict(mode="torchrun", plan_file=options.plan, model=options.model, world_size=ctx.world, device=ctx.device.type,
                 backend=ctx.backend, plan_name=plan.name if plan is not None else None)
    if ran is None:
        return ApplyReport(**found, problems=stopped)
    assert plan is not None
    problems = ran.problems
    if not problems and ran.check is not None and not ran.check.passed:
        problems = check_problems(ran.check, plan, ran.tp, f"--check failed: {ran.check.problems[0]}")
    notes = [*unpromised_tp_note(plan, ran.tp), *ran.notes]
    sharded = ran.sharded
    if sharded is not None and sharded.note and sharded.note not in notes:
        notes.append(sharded.note)
    return ApplyReport(**found, tp=ran.tp, dp=ran.dp, params=ran.params, comms=ran.comms, step_time_s=ran.step_time_s,
                       check=ran.check, steps=ran.steps, checkpoint=ran.checkpoint, saved=ran.saved, problems=problems, notes=notes,
                       modules=sharded.modules if sharded else {}, rule_of=sharded.rule_of if sharded else {},
                       rule_where=sharded.rule_where if sharded else {}, mesh=ran.mesh, pipeline=ran.pipeline)


def _load(ctx: Rank, options: ApplyOptions, event: Callable[[str], None]) -> _Loaded:
    import torch

    from ..core.loader import load_plan

    loaded = _Loaded()
    try:
        loaded.plan = load_plan(options.plan)
        from ..sharding.context_parallel import refuse_device

        refuse_device(loaded.plan, ctx.device.type)  # TP131 off CUDA; on CUDA, TP130 below: batches are not cut yet
        refuse_unapplied(loaded.plan)
        loaded.mesh = _mesh(ctx.world, options, loaded.plan)
        event("building the model")
        torch.manual_seed(options.seed)  # the same weights on every rank, even with src_data_rank: null
        loaded.model = build_model(options.model, "meta" if options.checkpoint else ctx.device, real_buffers=True)
        loaded.structure = module_structure(loaded.model)
        loaded.plan.match(loaded.model)
        loaded.plan.match_experts(loaded.model)  # the experts rules, as the TP rules: before any rank shards
        if options.checkpoint:  # keys, shapes, dtypes: on every rank, before any shards
            from ..checkpoint.run import preflight

            preflight(loaded.model, options.checkpoint, options.allow_missing)
    except PlanError as exc:
        loaded.problems = exc.problems
    except (UsageError, ModelRefError) as exc:
        loaded.usage = exc
    return loaded


def _mesh(world: int, options: ApplyOptions, plan: Plan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's (shape, dim names): a version 2 plan's named axes (its sizes checked
    against the world first, located), or version 1's tp with --fsdp's dp."""
    if options.world is not None and options.world != world:  # a dry run's option: under torchrun a check of torchrun's
        raise ApplyOptionsError("world", "torchrun-mismatch", f"{options.world} is not torchrun's world size ({world})",
                                world=options.world, torchrun_world=world)
    if plan.version == 1:
        return mesh_shape(world, fsdp_tp(world, options.tp, options.train.fsdp), plan.mesh_axis)
    from ..core.axes import mesh_dims, world_problems

    if options.train.fsdp:
        raise ApplyOptionsError("fsdp", "version-2", "FSDP on a dp dim is a version 1 plan's shorthand: a version 2 plan sets "
                                "mesh.dp_shard (and its fsdp section) instead")
    if problems := world_problems(plan, world):
        raise PlanError(problems)
    shape, names = mesh_dims(plan, world, options.tp)
    if options.tp is not None and shape[-1] != options.tp:
        dims = " × ".join(f"{name} {size}" for name, size in zip(names, shape))
        raise ApplyOptionsError("tp", "plan-mismatch", f"tp {options.tp}: the plan's mesh gives tp {shape[-1]} on {world} ranks ({dims})",
                                tp=options.tp, plan_tp=shape[-1], world=world, dims=dims)
    return shape, names


def _agree(ctx: Rank, loaded: _Loaded, timeout: float) -> list[Problem]:
    """The problems that stop every rank before sharding; raises the usage errors of any rank."""
    states = gather_states(rank_state(ctx.rank, loaded.plan, loaded.structure, loaded.problems, loaded.usage), ctx.control, timeout)
    if errors := usage_errors(states):
        raise RanksUsageError(errors)
    return disagreements(states)[1]


def _apply_and_run(ctx: Rank, options: ApplyOptions, plan: Plan, model: "nn.Module", mesh_spec, event) -> Ran:
    """Shard, run once counting collectives, once timed, then --check and --steps;
    a located problem stops it with what it found so far."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ..simulation.simulate import forward_backward

    shape, names = mesh_spec
    if plan.pipeline is not None:
        return _apply_pipelined(ctx, options, plan, model, dict(zip(names, shape)), event)
    if plan.version == 2:  # the named mesh, and the experts' (dp_replicate, efsdp, ep) view with it, once
        mesh = plan.build_mesh(math.prod(shape), ctx.device.type, shape[-1])
    else:
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    dp = math.prod(shape[:-1])
    # FSDP2 on a version 2 plan's data axes, or on --fsdp's dp (without --fsdp, v1's dp ranks are replicas)
    sizes = dict(zip(names, shape)) | ({"ep": plan.mesh.sizes["ep"]} if plan.version == 2 and plan.experts else {})
    # (and on the experts over efsdp, which ep may leave replicated without data axes)
    data_parallel = (dp > 1 and (plan.version == 2 or bool(options.train.fsdp))) or "ep" in sizes
    ran = Ran(tp=shape[-1], dp=dp, mesh=sizes, data_parallel=data_parallel)
    try:
        if options.check:  # both sides in eval mode: dropout would draw different masks on each
            from ..check.dropout import for_check

            ran.notes += [note] if (note := for_check(model)) else []
        reference = copy.deepcopy(model) if options.check and not options.checkpoint else None

        ran.sharded = shard_with_progress(plan, model, mesh, event)
        if options.checkpoint:
            reference = load_checkpoint_of(ctx, options, model, ran, event)
            if reference is not None:
                reference.eval()  # as the sharded side (for_check above)
        ran.params = param_layouts(model, ran.tp)  # after a load: the checkpoint's dtypes
        from ..simulation.fsdp import after_rules

        event("activation checkpointing and FSDP2" if ran.data_parallel else "activation checkpointing")
        ran.notes += after_rules(plan, model, mesh, ran.data_parallel)  # after the plan (and a load)
        torch.manual_seed(options.seed + 1)  # the same inputs on every rank: TP ranks must see one batch
        inputs = make_inputs(options.inputs, model, ctx.device, **input_size(options, plan, sizes))
        locator = FailureLocator(plan, model, ran.sharded.rules, ran.tp)

        event("forward and backward")
        from ..check.first_difference import recording

        with recording(model, tensors=False) as order:  # the call order, for the rule to blame
            output, ran.comms = run_located(locator, lambda: forward_backward(model, inputs))
        grads = {name: p.grad for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ran.step_time_s = _timed_step(ctx, locator, model, inputs)

        if reference is not None:
            event("checking against a single device")
            ran.check = _check(ctx, plan, model, reference, inputs, output, grads, order, ran.tp, copy_weights=not options.checkpoint)
        if options.steps:
            ran.steps, trained, replicas = _train(ctx, options, plan, locator, model, reference, inputs, ran.tp, event)
            if trained is not None:
                # The verdict covers the steps; max_abs_diff stays the forward and backward's (SPEC §4).
                ran.check = dataclasses.replace(ran.check, passed=ran.check.passed and trained.passed, problems=ran.check.problems + trained.problems)
                from ..check.replicas import add_to

                ran.check = add_to(ran.check, replicas, plan, model, order)
                ran.steps = dataclasses.replace(ran.steps, max_abs_diff=trained.max_abs_diff)
        if options.save:
            from ..checkpoint.run import save_from

            event(f"saving to {options.save}")
            ran.saved = save_from(model, options.save, options.save_format, plan)
    except PlanError as exc:
        ran.problems = exc.problems
    except CommFailure as exc:
        ran.problems = [exc.problem]
    return ran


def _apply_pipelined(ctx: Rank, options: ApplyOptions, plan: Plan, model: "nn.Module", sizes: dict[str, int], event) -> Ran:
    """A version 2 plan with a pipeline (runtime/pipelined.py): its stages on the pp ranks."""
    from .pipelined import apply_pipelined

    dp = math.prod(size for dim, size in sizes.items() if dim in DP_AXES)
    ran = Ran(tp=sizes[plan.mesh_axis], dp=dp, mesh=sizes, data_parallel=dp > 1)
    try:
        apply_pipelined(ctx, options, plan, model, ran, event)
    except PlanError as exc:
        ran.problems = exc.problems
    except CommFailure as exc:
        ran.problems = [exc.problem]
    return ran


def _train(ctx: Rank, options: ApplyOptions, plan: Plan, locator: FailureLocator, model, reference, inputs: tuple, tp: int, event):
    """--steps: train (AdamW unless --optimizer says), inside loss_parallel() when the
    plan asks; with --check, the same steps on one device compared (merged over ranks),
    and the replicas compared across ranks after each step."""
    from ..check.replicas import differences_across_ranks
    from ..check.training import compare_training
    from ..simulation.training import OPTIMIZER_NAMES, train_steps

    name = options.train.optimizer_name
    event(f"{options.steps} {OPTIMIZER_NAMES[name]} steps")
    replicas: list = []

    def compare_replicas(step: int) -> None:
        replicas.extend(differences_across_ranks(model, f"after step {step}", lambda value: ctx.gather(value, plan, "comparing the replicas"), tp))

    losses, times = run_located(locator, lambda: train_steps(
        model, inputs, options.steps, name, plan.loss_parallel, options.seed, lambda: synchronize(ctx.device),
        after_step=compare_replicas if reference is not None else None,
    ))
    if reference is None:
        return StepsResult(losses, times, OPTIMIZER_NAMES[name]), None, replicas
    event(f"checking {options.steps} steps against a single device")
    from ..check.verify import merge_ranks

    trained = merge_ranks(ctx.gather(compare_training(model, reference, inputs, losses, name, options.seed), plan, "comparing the training"))
    return StepsResult(losses, times, OPTIMIZER_NAMES[name]), trained, replicas


def _timed_step(ctx: Rank, locator: FailureLocator, model: "nn.Module", inputs: tuple) -> float:
    """One clean forward and backward, timed (the counted pass before is the warm-up)."""
    from ..simulation.simulate import scalar_loss

    synchronize(ctx.device)
    start = time.perf_counter()
    run_located(locator, lambda: scalar_loss(model(*inputs)).backward())
    synchronize(ctx.device)
    return time.perf_counter() - start


def _check(ctx: Rank, plan: Plan, model: "nn.Module", reference: "nn.Module", inputs: tuple, output: Any, grads: dict,
           order: list, tp: int, copy_weights: bool = True) -> CheckResult:
    """This rank's comparison with a single device, merged over the ranks; a failure
    located at its first differing tensor and then at the module whose own computation
    goes wrong (`local_culprit`: each rank reruns a module on its own chunk, that of
    its TP coordinate `rank % tp`, tp being the mesh's fastest dim), and the replicas compared across ranks (`order`: the module
    calls of the run, for the rule to blame)."""
    from ..check.first_difference import default_allowed, full_size, locate_across_ranks, record_across_ranks
    from ..check.local_culprit import real, refine
    from ..check.replicas import add_to, differences_across_ranks
    from ..check.verify import compare_with_reference, merge_ranks

    try:
        local = compare_with_reference(model, reference, inputs, output, grads, copy_weights)
    except Exception as exc:  # the single-device run of the user's model, or gathering the weights
        if raised_by_tpplan(exc):
            raise  # tpplan's own code: a bug, shown as one
        if is_comm_failure(exc):
            raise CommFailure(comm_problem(plan, "gathering the weights for --check", exc)) from None
        raise PlanError([error("TP502", f"--check: the single-device reference run fails: {first_line(exc)}", plan.file)]) from None
    result = merge_ranks(ctx.gather(local, plan, "comparing the check results"))

    def gather(value):
        return ctx.gather(value, plan, "locating the check's differences")

    if not result.passed:
        recorded = record_across_ranks(model, reference, inputs)
        result.located = locate_across_ranks(plan, model, reference, recorded, grads, gather, ctx.rank)
        if result.located is not None:  # as in the dry run: blame the module whose own computation goes wrong
            result.located = refine(result.located, model, recorded.want, recorded.want_inputs, recorded.got, recorded.got_inputs,
                                    real(tp, ctx.rank % tp, full_size, gather), default_allowed)
    return add_to(result, differences_across_ranks(model, "after backward", gather, tp, grads), plan, model, order)


def _assert_held(ctx: Rank, model: "nn.Module", report: ApplyReport) -> None:
    """The per-rank bytes come from the layouts (shard sizes as torch chunks them);
    every real rank checks that it holds what its TP coordinate predicts."""
    from torch.distributed.tensor import DTensor

    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    predicted = report.rank_bytes[ctx.rank % report.tp]  # mesh ranks are row-major: tp is the fastest dim
    assert held == predicted, f"rank {ctx.rank} holds {held} parameter bytes, its layout says {predicted}"
