"""A pipeline's step composed from its stages (SPEC §8): each stage's one microbatch
measured on fake tensors (memory.measure_training_step with a `StageIO`: torch's
`PipelineStage` backward and gradient reduction), then the step walked in the
order torch's own schedule gives each pp rank (`schedule_orders`), holding the
microbatches in flight.

What a pp rank holds at each action of its order (`compose`):

- throughout the step: its stages' parameters and optimizer state, and the receive
  buffers `PipelineStage` keeps for every microbatch (the input of each, on a stage
  after the first; the gradient of each output, on a stage before the last);
- after a stage's first backward: what that backward leaves until the step ends
  (the gradients; with FSDP2 unsharded and unsynced between microbatches, as
  PipelineStage asks); a backward's input gradient until it is sent (through the
  next action: PipelineStage takes it off the receive buffer, `val.grad = None`);
- with FSDP2, from a stage's backward to its next forward: the weights that
  backward left gathered (the forward uses them, then reshards them);
- each microbatch in flight (forward run, backward not yet): the activations its
  forward saved, its output included;
- the action's own transients, as measured: a forward's peak above its start, a
  backward's (the first backward measured; later ones with what an earlier
  backward left held already).

Then the gradient reduction and the optimizer step, as measured. A zero-bubble
schedule's input backward (I) is composed as a backward whose microbatch stays in
flight until its weight backward (W).

The bubble (`bubble`) is the idle share of the step when a stage's forward takes 1
and its backward 2 (input and weight backward 1 each), every action starting once
its own rank is free and the stage before it (forward) or after it (backward) has
done the same microbatch: (p − 1)/(m + p − 1) for GPipe and 1F1B, (p − 1)/(v·m + p − 1)
for the interleaved 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .memory import StepMemory


@dataclass(frozen=True)
class StageMemory:
    """One stage's microbatch, measured (bytes; "above" the static part held across the
    step). With FSDP2, PipelineStage leaves a backward's weights unsharded (and its
    gradients unsynced) until the next forward of the stage reshards them."""

    stage: int
    modules: tuple[str, ...]
    static: int  # parameters, buffers and optimizer state
    activations: int  # what one microbatch's forward keeps for its backward, its output included
    forward: int  # the forward's peak above static
    forward_parameters: int  # the weights it had gathered at that peak (FSDP2's): held already after a backward
    backward: int  # the first backward's peak above static, its own activations included
    backward_gradients: int  # the gradients it had made at that peak: held already after an earlier backward
    backward_parameters: int  # the weights it had gathered at that peak: held already right after a backward
    held: int  # what a backward leaves until the step ends: the gradients (its input's gradient not counted)
    held_parameters: int  # what it leaves until the stage's next forward: FSDP2's unsharded weights
    reduced: int  # what stays from the reduction to the optimizer step (the gradients, sharded by FSDP2)
    reduce: int  # the reduction's peak above static
    optimizer: int  # the optimizer step's peak above static + reduced
    input_bytes: int  # one microbatch's received input (0: the first stage)
    output_bytes: int  # one microbatch's output sent on (0: the last stage)
    start: dict[str, int]  # the static part by category (parameters, optimizer)

    @classmethod
    def measured(cls, stage: int, modules: list[str], step: "StepMemory", input_bytes: int, output_bytes: int) -> "StageMemory":
        """From a stage step's parts (`StepMemory.phase_*`). The step's output gradient was
        made for its backward and freed after it: not counted here (it is a receive
        buffer, counted once by the composition)."""
        peaks, ends, at_peak, at_end = step.phase_peaks, step.phase_ends, step.phase_categories, step.phase_end_categories
        static, start = ends["start"], at_end["start"]

        def grown(categories: dict[str, int], name: str) -> int:
            return max(0, categories[name] - start[name])

        held_parameters = grown(at_end["backward"], "parameters")
        return cls(
            stage=stage,
            modules=tuple(modules),
            static=static,
            activations=ends["forward"] - static,
            forward=peaks["forward"] - static,
            forward_parameters=grown(at_peak["forward"], "parameters"),
            backward=peaks["backward"] - static - output_bytes,
            backward_gradients=grown(at_peak["backward"], "gradients"),
            backward_parameters=grown(at_peak["backward"], "parameters"),
            held=ends["backward"] - static - input_bytes - held_parameters,
            held_parameters=held_parameters,
            reduced=ends["reduce"] - static - input_bytes,
            reduce=peaks.get("reduce", ends["reduce"]) - static - input_bytes,
            optimizer=peaks.get("optimizer", ends["optimizer"]) - ends["reduce"],
            input_bytes=input_bytes,
            output_bytes=output_bytes,
            start=dict(start),
        )

    def buffers(self, microbatches: int) -> int:
        """PipelineStage's receive buffers: an input per microbatch (after the first
        stage), an output gradient per microbatch (before the last)."""
        return microbatches * (self.input_bytes + self.output_bytes)

    @property
    def p2p_bytes(self) -> int:
        """What the stage sends per microbatch: its output forward, its input's gradient backward."""
        return self.output_bytes + self.input_bytes


@dataclass(frozen=True)
class RankStep:
    """One pp rank's composed step: its peak, where it happens, and each stage's most microbatches in flight."""

    pp_rank: int
    stages: tuple[int, ...]
    peak_bytes: int
    peak_action: str  # "backward of microbatch 0 on stage 1", "gradient reduction of stage 0", "optimizer step"
    in_flight: dict[int, int]
    categories: dict[str, int]  # at the peak: parameters and optimizer state, gradients held, activations
    # (the microbatches in flight, the receive buffers, the input gradients), temporaries (the action's own)


def schedule_orders(schedule: str, pp: int, microbatches: int, stage_ids: list[list[int]]) -> dict[int, list[Any]]:
    """{pp rank: its actions, in the order torch runs them} (`stage_ids[r]`: the stage
    indices of rank r). A multi-stage schedule runs torch's own `pipeline_order`, read
    from the schedule class built over stand-ins of each rank's stages (it needs only
    their indices, no process group); a fused action (DualPipeV's overlapped forward
    and backward) is its parts in order. A one-stage schedule runs its own loop
    (`_step_microbatches`), which its `pipeline_order` does not match in torch 2.13
    (1F1B's last rank starts at microbatch 1 there), so its order is that loop's."""
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return {rank: _single_stage_order(schedule, rank, pp, microbatches) for rank in range(pp)}
    count = sum(len(ids) for ids in stage_ids)
    orders = {}
    for rank, ids in enumerate(stage_ids):
        stand_ins = [SimpleNamespace(num_stages=count, stage_index=i, group_size=pp, group_rank=rank, is_first=i == 0,
                                     is_last=i == count - 1, submod=torch.nn.Identity()) for i in ids]
        built = cls(stand_ins, microbatches)
        orders[rank] = [part for action in built.pipeline_order[rank] if action is not None
                        for part in (action.sub_actions or (action,))]
    return orders


def _single_stage_order(schedule: str, stage: int, pp: int, microbatches: int) -> list[Any]:
    """GPipe: every forward, then every backward; 1F1B: min(m, pp − stage) forwards,
    then a backward and a forward in turn, then the remaining backwards."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    def forward(mb: int) -> Any:
        return _Action(stage, _ComputationType.FORWARD, mb)

    def backward(mb: int) -> Any:
        return _Action(stage, _ComputationType.FULL_BACKWARD, mb)

    if schedule == "GPipe":
        return [*map(forward, range(microbatches)), *map(backward, range(microbatches))]
    warmup = min(microbatches, pp - stage)
    order = [forward(mb) for mb in range(warmup)]
    for mb in range(microbatches):
        order.append(backward(mb))
        if warmup + mb < microbatches:
            order.append(forward(warmup + mb))
    return order


def _kind(action: Any) -> str:
    """F, B (full backward), I (input backward), W (weight backward), or "" (the reduction)."""
    return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(action.computation_type.name, "")


def compose(pp_rank: int, order: list[Any], stages: dict[int, StageMemory], microbatches: int) -> RankStep:
    """The rank's peak over its step in `order` (module docstring), by category."""
    mine = sorted({action.stage_index for action in order if _kind(action)})
    static = sum(stages[j].static for j in mine)
    buffers = sum(stages[j].buffers(microbatches) for j in mine)
    in_flight = dict.fromkeys(mine, 0)
    most = dict.fromkeys(mine, 0)
    backwards = dict.fromkeys(mine, 0)
    unsharded = dict.fromkeys(mine, False)  # FSDP2's weights left gathered by the stage's last backward
    sending = 0  # the input gradient the last backward made, held until its send is done (the next action)
    peak: tuple[int, str, dict[str, int]] = (-1, "", {})

    def held(but: int | None = None) -> int:
        return sum((stages[k].held if backwards[k] else 0) + (stages[k].held_parameters if unsharded[k] else 0)
                   for k in mine if k != but)

    def consider(transient: int, where: str, gradients: int, activations: int) -> None:
        nonlocal peak
        total = static + buffers + sending + gradients + activations + transient
        if total > peak[0]:
            parameters = sum(stages[k].start.get("parameters", 0) for k in mine)
            optimizer = sum(stages[k].start.get("optimizer", 0) for k in mine)
            peak = (total, where, {"parameters": parameters, "gradients": gradients, "optimizer": optimizer,
                                   "activations": buffers + sending + activations,
                                   "temporaries": total - parameters - optimizer - gradients - buffers - sending - activations})

    consider(0, "step start", 0, 0)
    for action in order:
        kind, j, mb = _kind(action), action.stage_index, action.microbatch_index
        if kind not in ("F", "B", "I", "W"):
            continue
        stage = stages[j]
        activations = sum(in_flight[k] * stages[k].activations for k in mine)
        if kind == "F":
            # weights a backward left gathered are not gathered again; the forward reshards them after
            consider(stage.forward - (min(stage.forward_parameters, stage.held_parameters) if unsharded[j] else 0),
                     f"forward of microbatch {mb} on stage {j}", held(), activations)
            in_flight[j] += 1
            most[j] = max(most[j], in_flight[j])
            unsharded[j] = False
        elif kind in ("B", "I"):
            # its own activations are in the measured backward; what an earlier backward left held is not new
            again = (min(stage.backward_gradients, stage.held) if backwards[j] else 0) + \
                    (min(stage.backward_parameters, stage.held_parameters) if unsharded[j] else 0)
            consider(stage.backward - again, f"backward of microbatch {mb} on stage {j}", held(), activations - stage.activations)
            backwards[j] += 1
            unsharded[j] = stage.held_parameters > 0
            in_flight[j] -= kind == "B"
        else:  # W: the microbatch's weight gradients done, its activations freed
            in_flight[j] -= 1
        # PipelineStage takes the input's gradient off its buffer and holds it until it is sent
        sending = stage.input_bytes if kind in ("B", "I") else 0
    for j in mine:  # the gradient reduction, stage by stage, then one optimizer step over them all
        consider(stages[j].reduce, f"gradient reduction of stage {j}", held(but=j), 0)
    consider(sum(stages[j].optimizer for j in mine), "optimizer step", sum(stages[j].reduced for j in mine), 0)
    total, where, categories = peak
    return RankStep(pp_rank, tuple(mine), total, where, most, categories)


def bubble(orders: dict[int, list[Any]]) -> float:
    """The idle share of the step (module docstring): 1 − busy / (ranks × makespan)."""
    cost = {"F": 1, "B": 2, "I": 1, "W": 1}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> when it ends
    queues = {rank: [a for a in order if _kind(a)] for rank, order in orders.items()}
    free = dict.fromkeys(orders, 0.0)
    last_stage = max(a.stage_index for order in queues.values() for a in order)
    while any(queues.values()):
        moved = False
        for rank, queue in queues.items():
            while queue:
                action = queue[0]
                kind, j, mb = _kind(action), action.stage_index, action.microbatch_index
                needs = [("F", j, mb)] if kind != "F" else []
                if kind == "F" and j > 0:
                    needs.append(("F", j - 1, mb))
                if kind in ("B", "I") and j < last_stage:
                    needs.append(("B", j + 1, mb) if ("B", j + 1, mb) in done else ("I", j + 1, mb))
                if kind == "W":
                    needs = [("I", j, mb)]
                if any(need not in done for need in needs):
                    break
                start = max([free[rank], *(done[need] for need in needs)])
                free[rank] = done[(kind, j, mb)] = start + cost[kind]
                queue.pop(0)
                moved = True
        if not moved:
            raise ValueError("the schedule's order waits on an action no rank runs")
    span = max(free.values())
    busy = sum(cost[_kind(a)] for order in orders.values() for a in order if _kind(a))
    return 1 - busy / (len(orders) * span) if span else 0.0


_CLOSED_FORMS = ("GPipe", "1F1B", "Interleaved1F1B")  # (p − 1)/(v·m + p − 1): tests/test_pipeline_dryrun.py checks them against `bubble`


def schedule_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble of `schedule` over `pp` ranks: `bubble` of its action order, read in closed
    form where the two agree (GPipe, 1F1B, Interleaved1F1B: torch's order for m microbatches
    takes O(pp·m) actions, and `tpplan fit` asks for thousands of (pp, m))."""
    from ..core.stages import rank_stages

    if schedule in _CLOSED_FORMS:
        return (pp - 1) / (virtual_stages * microbatches + pp - 1)
    return bubble(schedule_orders(schedule, pp, microbatches, [rank_stages(r, pp, virtual_stages, schedule) for r in range(pp)]))
