"""`tpplan fit` on the Llama-3-70B shape over 64 GPUs and the Llama-3-405B shape over
16,384 GPUs × 80 GiB (seq 8192, bf16, AdamW; 405B: a global batch of 2048 sequences,
16M tokens), each in a fresh process: wall time, peak RSS (the largest process: the
search or one of its --jobs workers, the largest so far in the bench), the layouts considered / rejected by checks /
rejected by memory / ranked out / simulated, and the top 3 with our peak beside
Megatron's formula. Then Llama-3-405B's published pretraining layout (TP 8, PP 16,
CP 1, DP 128: arXiv:2407.21783 §3.3.2) simulated and costed as fit does, and where it
ranks.

    python bench/bench_fit.py [--shapes 70b 405b] [--plan plans/llama_tp.yaml] [--jobs 2] [--check]

Goal: each shape in at most 60 s on 2 cores (`--check` exits 1 when missed).
"""

from __future__ import annotations

import sys

import _common

SHAPES = {  # model, world, global batch (sequences of 8192)
    "70b": ("tpplan.models.llama:llama3_70b", 64, 128),
    "405b": ("tpplan.models.llama:llama3_405b", 16384, 2048),
}
GOAL_S = 60.0
PUBLISHED_405B = {"pp": 16, "dp_shard": 128, "tp": 8}


def run(shape: str, plan: str, jobs: int) -> tuple[float, int, dict]:
    """(wall seconds, the largest process's peak RSS so far: the search or a worker, the JSON)."""
    import resource

    model, world, batch = SHAPES[shape]
    wall, _, _, found = _common.json_run([sys.executable, "-m", "tpplan", "fit", "--model", model, "--world", str(world),
                                            "--seq", "8192", "--batch", str(batch), "--memory", "80GiB", "--plan", plan,
                                            "--jobs", str(jobs), "--format", "json"])
    # the children's (and their waited-for workers') largest resident set: the search's workers are its children
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, found


def published(plan: str, jobs: int) -> None:
    """The published 405B layout's variants (AC off and on, 1F1B and Interleaved1F1B over its
    16 microbatches), each simulated and costed as fit does, and its place among fit's layouts."""
    from tpplan import fit
    from tpplan.fitting.space import Layout

    model, world, batch = SHAPES["405b"]
    result = fit(model, world=world, seq=8192, batch=batch, plan=plan, memory="80GiB", jobs=jobs)
    sizes = tuple({**dict.fromkeys(("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"), 1), **PUBLISHED_405B}.values())
    for checkpointing in (False, True):
        for schedule, virtual in (("1F1B", 1), ("Interleaved1F1B", 2)):
            layout = Layout(sizes, checkpointing, schedule, 16, virtual)
            found = result.evaluate(layout)
            if not hasattr(found, "step"):
                print(f"  {layout.describe()}: rejected, {found.reason}")
                continue
            faster = sum(r.step.total < found.step.total for r in result.ranked)
            unknown = sum(r.kind == "ranked out" and r.bound_seconds < found.step.total for r in result.rejected)
            print(f"  {layout.describe()}: peak {found.peak_bytes / 2**30:.2f} GiB (Megatron {found.megatron_peak_bytes / 2**30:.2f}), "
                  f"step {found.step.total:.3f} s (compute {found.step.compute:.3f}, comm {found.step.comm:.3f}, bubble "
                  f"{found.step.bubble:.3f}), {found.tokens_per_second_per_gpu:.0f} tok/s/GPU: rank {faster + 1}"
                  + (f" to {faster + unknown + 1} ({unknown} ranked-out layouts' bounds are below it)" if unknown else ""))


def main() -> int:
    parser = _common.arguments(__doc__, check="when a shape takes more than 60 s")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["70b", "405b"])
    parser.add_argument("--plan", default="plans/llama_tp.yaml")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    ok = True
    for shape in args.shapes:
        wall, rss, found = run(shape, args.plan, args.jobs)
        counts = found["counts"]
        print(f"{shape}: {wall:.1f} s wall (goal {GOAL_S:.0f} s), peak RSS {rss / 2**30:.2f} GiB; {counts['considered']} layouts: "
              f"{counts['rejected_by_search']} outside the search's rules, {counts['rejected_by_checks']} rejected by checks, "
              f"{counts['rejected_by_memory']} by memory, "
              f"{counts['ranked_out']} ranked out, {counts['simulated']} simulated, {counts['fitting']} fit")
        for index, layout in enumerate(found["layouts"][:3], 1):
            mesh = " · ".join(f"{axis} {size}" for axis, size in layout["mesh"].items() if size > 1)
            megatron = layout["megatron_peak_bytes"]
            print(f"  #{index} {mesh}{', AC' if layout['checkpointing'] else ''}"
                  f"{', ' + layout['schedule'] + ' × ' + str(layout['microbatches']) if layout['schedule'] else ''}: "
                  f"peak {layout['peak_bytes'] / 2**30:.2f} GiB, Megatron {megatron / 2**30:.2f} GiB, step {layout['step_seconds']:.3f} s "
                  f"(compute {layout['compute_seconds']:.3f}, comm {layout['comm_seconds']:.3f}, bubble {layout['bubble_seconds']:.3f}), "
                  f"{layout['tokens_per_second_per_gpu']:.0f} tok/s/GPU")
        ok = ok and _common.within(wall, GOAL_S)
    if "405b" in args.shapes:
        print("405b, the published layout (TP 8 · PP 16 · DP 128):")
        published(args.plan, args.jobs)
    return _common.exit_code(args.check, ok)


if __name__ == "__main__":
    sys.exit(main())
