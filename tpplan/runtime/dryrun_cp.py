"""`tpplan apply --dry-run` of a version 2 plan with context parallelism (`mesh.cp`
above 1 and a `context_parallel` section): one CUDA rank simulated in this process
(simulation/context_parallel.py: `Plan.apply` on fake tensors under the fake process
group, CUDA's ring attention simulated), reporting this rank's shapes, the ring's
collectives and the whole step's, count and bytes.

The world is the plan's axes multiplied (`--tp` picks among promised TP degrees); the
batch is `--batch` sequences (default: the plan's training.global_batch over
dp_replicate·dp_shard, else 2) of `--seq` tokens (default: training.seq, else 8 per chunk:
2·cp chunks with head-tail balance, cp without). With a memory option (`--dtype`,
`--optimizer`, `--memory-limit`, or the training section's dtype or optimizer) or
`--world`, the dry run plans the world's memory
instead (memory/memory_dryrun.py, context parallelism applied there too). `--check`
and `--checkpoint` of such plans are not simulated yet: refused as usage errors.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

from ..core.axes_spec import WORLD_AXES
from ..core.problems import PlanError
from ..core.quiet import simulation_remarks_off
from ..core.units import human_bytes
from ..simulation.modelref import build_model, load_callable
from .options import ApplyOptions, ApplyOptionsError, refuse_unapplied, training_note
from .report import ApplyReport

if TYPE_CHECKING:
    from ..core.plan import Plan


@simulation_remarks_off()
def context_parallel_dry_run(options: ApplyOptions, plan: "Plan") -> ApplyReport:
    from ..simulation.context_parallel import simulate_context_parallel

    for given, option in ((options.check, "check"), (options.checkpoint, "checkpoint"), (options.save, "save")):
        if given:
            raise ApplyOptionsError(option, "not-with-cp", "a dry run of context parallelism simulates shapes, collectives "
                                    "and memory (no values or checkpoints yet)")
    refuse_unapplied(plan, "api")  # it simulates what Plan.apply applies, on the step the plan's training section sizes
    world, tp, sizes = _world(plan, options.tp)
    spec, cp = plan.spec.context_parallel, plan.mesh.sizes["cp"]
    chunks = 2 * cp if spec.load_balance == "headtail" else cp
    seq, batch = options.train.seq or 8 * chunks, options.train.batch_at(sizes) or 2
    if seq % chunks:
        raise ApplyOptionsError("seq", "cp-split", f"{seq} tokens do not split into {chunks} equal chunks over cp {cp}"
                                + (" (load_balance: headtail: 2·cp chunks)" if chunks != cp else ""))
    factory = load_callable(options.model, "--model")
    report = ApplyReport(mode="dry-run", plan_file=options.plan, model=options.model, world_size=world, tp=tp,
                         plan_name=plan.name, device="fake", backend="fake")
    try:
        sim = simulate_context_parallel(plan, lambda: build_model(options.model, "cpu", factory), world, batch, seq, tp)
    except PlanError as exc:
        report.problems = exc.problems
        return report
    report.mesh = sim.mesh
    report.comms = {phase: {op: found["count"] for op, found in ops.items()} for phase, ops in sim.comms.items()}
    report.context_parallel = {"tokens": list(sim.tokens), "buffers": {k: list(v) for k, v in sim.buffers.items()},
                               "attention_q": [list(s) for s in sim.attention], "ring": sim.ring, "comms": sim.comms}
    report.notes = [
        f"context parallelism simulated as on CUDA (rank 0 of {world}, fake tensors; torch's ring attention, CUDA's rules): "
        f"this rank holds tokens {tuple(sim.tokens)} of ({batch}, {seq})"
        + "".join(f", {name} {shape}" for name, shape in sim.buffers.items()),
        "the ring's collectives (rotate: " + spec.rotate + "): " + _comms_text(sim.ring),
        "every collective of the step (TP, the ring, FSDP2 over dp_shard·cp): " + _comms_text(sim.comms),
        *training_note(options.train, sizes),
    ]
    return report


def _world(plan: "Plan", tp: int | None) -> tuple[int, int, dict[str, int]]:
    """The world the plan's sizes make (at `tp` where it promises several), its tp, and every axis's size."""
    options = list(plan.mesh.candidates())
    sizes = next((c for c in options if tp is None or c["tp"] == tp), None)
    if sizes is None:
        raise ApplyOptionsError("tp", "plan-mismatch", f"tp {tp} is not one of the plan's degrees {list(plan.mesh.tp_degrees or ())}")
    missing = [axis for axis in WORLD_AXES if sizes[axis] is None]
    if missing:
        raise ApplyOptionsError("plan", "cp-rest-axis", f"a dry run of context parallelism needs every axis sized: "
                                f"{', '.join(missing)} takes the rest of a world this run does not know; give it a size")
    return prod(sizes[axis] for axis in WORLD_AXES), sizes["tp"], sizes


def _comms_text(comms: dict) -> str:
    return "; ".join(f"{phase} " + ", ".join(f"{op} ×{found['count']} ({human_bytes(found['bytes'])})" for op, found in ops.items())
                     for phase, ops in comms.items() if ops) or "none"
