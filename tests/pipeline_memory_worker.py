"""One real rank of a pipelined training step, measured by torch's MemTracker: what
the pipeline's dry run predicts (tests/test_pipeline_dryrun.py).

    torchrun --nproc-per-node N tests/pipeline_memory_worker.py PLAN MODEL BATCH SEQ

Each rank builds the model, takes its stages (`Plan.pipeline_stages`), runs torch's
`PipelineStage`s and the plan's schedule with AdamW, one step to make the optimizer
state and the receive buffers (outside the tracker: PipelineStage's metadata
inference runs autograd.grad, which the tracker's hooks refuse), then the measured
step, the buffers tracked: the steady state, as the dry run plans it. Rank 0 prints every rank's peak and
categories as one JSON line.
"""

from __future__ import annotations

import sys

from real_rank import planned_rank, print_every_rank


def main(plan_path: str, model_ref: str, batch: int, seq: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from tpplan.memory.memory import _categories
    from tpplan.simulation.modelref import make_inputs
    from tpplan.simulation.training import make_optimizer, make_targets, training_loss

    plan, mesh, model = planned_rank(plan_path, model_ref)
    torch.manual_seed(1)
    inputs = make_inputs(None, model, "cpu", batch=batch, seq=seq)
    targets = make_targets(model, inputs, torch.Generator().manual_seed(2))
    modules = plan.pipeline_stages(model, mesh)
    ids = plan.stage_ids(mesh)
    pipe = plan.spec.pipeline
    count = pipe.virtual_stages * mesh["pp"].size() if pipe.schedule not in ("ZBVZeroBubble", "DualPipeV") else 2 * mesh["pp"].size()
    stages = [PipelineStage(stage, index, count, torch.device("cpu"), group=mesh["pp"].get_group()) for stage, index in zip(modules, ids)]
    cls = get_schedule_class(pipe.schedule)
    schedule = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], n_microbatches=pipe.microbatches,
                   loss_fn=lambda output, target: training_loss(output, target))
    first, last = 0 in ids, count - 1 in ids
    optimizer = make_optimizer("adamw", torch.nn.ModuleList(modules))

    def step() -> None:
        schedule.step(*(inputs if first else ()), **({"target": targets, "losses": []} if last else {}), return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # outside the tracker: the stages' metadata inference (autograd.grad) cannot run under it
    # PipelineStage's receive buffers, made by that step and kept: an input per microbatch, an output gradient per microbatch
    buffers = [info.buffer for stage in stages for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
               for info in infos if getattr(info, "buffer", None) is not None]
    class EveryMicrobatch(MemTracker):
        """torch's MemTracker, its totals only: a stage's forward runs once per microbatch,
        which its per-module statistics refuse as "multiple iterative calls"."""

        def _pre_fw_hook(self, module, inputs) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            again = module in self.memory_tracking and not self._mod_tracker.is_bw
            if not (again and set(self._mod_tracker.parents) - {name} == {"Global"}):
                super()._pre_fw_hook(module, inputs)

    tracker = EveryMicrobatch()
    tracker.track_external(*modules, optimizer, *buffers)
    with tracker:
        step()
    total, categories = _categories(tracker.get_tracker_snapshot("peak"))
    print_every_rank({"rank": dist.get_rank(), "pp": mesh["pp"].get_local_rank(), "peak": total, "categories": categories})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
