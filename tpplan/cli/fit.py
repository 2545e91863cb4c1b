"""`tpplan fit`: choose a training job's layout (SPEC §9). Imported whenever
`tpplan` starts: nothing heavy at import time."""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .apply import DType, Optimizer  # apply's --dtype and --optimizer choices
from .output import EXIT_OK, EXIT_PROBLEMS, exit_with, usage_error

_GPUS = ("h100", "h200", "a100", "mi300x")  # fitting/cost.py's presets (a test checks they agree)
_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")  # core.axes_spec.AXES (a test checks they agree)


class FitFormat(str, Enum):
    text = "text"
    json = "json"


Gpu = Enum("Gpu", {name: name for name in _GPUS}, type=str)


def fit(
    model: Annotated[str, typer.Option(metavar="MOD:FN", help="The model (package.module:function, or hf:CONFIG), built on the meta device and on fake tensors only.", show_default=False)],
    world: Annotated[int, typer.Option(metavar="N", min=1, help="GPUs of the job.", show_default=False)],
    seq: Annotated[int, typer.Option(metavar="S", min=1, help="Tokens per sequence (context parallelism splits it).", show_default=False)],
    batch: Annotated[int, typer.Option(metavar="GLOBAL_SEQS", min=1, help="Sequences per step over all data-parallel ranks.", show_default=False)],
    plan: Annotated[Optional[str], typer.Option(metavar="BASE.yaml", help="The TP rules (a version 1 or 2 plan); its context_parallel section names the attention for cp, its experts section the experts for ep. Default: tpplan init's, proven at the tp degrees searched (written beside -o as NAME.rules.yaml).", show_default=False)] = None,
    memory: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Memory per GPU (80GiB, 141GB); default the --gpu preset's.", show_default=False)] = None,
    gpus_per_node: Annotated[int, typer.Option(metavar="N", min=1, help="GPUs per node: tensor parallelism stays inside one; the cost model's links.")] = 8,
    gpu: Annotated[Gpu, typer.Option(help="The cost model's preset: peak bf16 FLOP/s, memory, NVLink and network bandwidths.")] = Gpu.h100,
    dtype: Annotated[DType, typer.Option(help="The training dtype.")] = DType.bf16,
    optimizer: Annotated[Optimizer, typer.Option(help="The optimizer whose state is planned for.")] = Optimizer.adamw,
    axes: Annotated[str, typer.Option(metavar="AXES", help="The axes to search, comma-separated (the others stay 1); ep where the base plan has an experts section.")] = ",".join(_AXES),
    top: Annotated[int, typer.Option(metavar="K", min=1, help="Layouts to rank and print.")] = 3,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="PLAN.yaml", help="Write the best layout's plan here.", show_default=False)] = None,
    format: Annotated[FitFormat, typer.Option(help="text, or json: {layouts (best first), rejected (each with its reason), assumptions (the cost model), plan (the best, as text)}.")] = FitFormat.text,
    efficiency: Annotated[Optional[float], typer.Option(metavar="F", min=0.01, max=1.0, help="Share of the peak FLOP/s a step reaches (preset 0.4).", show_default=False)] = None,
    peak_flops: Annotated[Optional[float], typer.Option(metavar="FLOP/S", min=1.0, help="Override the preset's peak.", show_default=False)] = None,
    intra_bandwidth: Annotated[Optional[float], typer.Option(metavar="B/S", min=1.0, help="Override the bandwidth per GPU inside a node.", show_default=False)] = None,
    inter_bandwidth: Annotated[Optional[float], typer.Option(metavar="B/S", min=1.0, help="Override the bandwidth per GPU across nodes.", show_default=False)] = None,
    jobs: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Dry runs at once, each in its own process (default: one per CPU).", show_default=False)] = None,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Simulate every layout that may fit, not only those that may rank in the top K.")] = False,
) -> None:
    """Choose the layout of a training job: every layout of --world simulated or bounded, ranked by a stated cost model.

    Layouts that break a plan check are rejected with the check's message; the rest are
    simulated exactly by the dry run (best first by a bound of their step time) and
    dropped where they do not fit --memory. The best is written as a version 2 plan
    (-o) whose `apply --dry-run` reproduces its peak.
    """
    from rich.console import Console

    chosen = tuple(axis.strip() for axis in axes.split(",") if axis.strip())
    unknown = [axis for axis in chosen if axis not in _AXES]
    if unknown or not chosen:
        usage_error(f"--axes: {', '.join(unknown) or 'none given'}: name some of {', '.join(_AXES)}")
    from ..fitting.result import FitError
    from ..fitting.search import fit as fit_layouts

    figures = {key: value for key, value in (("efficiency", efficiency), ("peak_flops", peak_flops),
               ("intra_bandwidth", intra_bandwidth), ("inter_bandwidth", inter_bandwidth)) if value is not None}
    console = Console(stderr=format is FitFormat.json)
    try:
        with console.status("fit") as status:
            result = fit_layouts(model, world=world, seq=seq, batch=batch, plan=plan, memory=memory, gpu=gpu.value,
                                 gpus_per_node=gpus_per_node, dtype=dtype.value, optimizer=optimizer.value, axes=chosen, top=top,
                                 exhaustive=exhaustive, jobs=jobs, on_event=lambda text: status.update(text), **figures)
    except FitError as exc:
        usage_error(str(exc))
    written, base = None, None
    if output is not None and result.best is not None:
        try:
            if result.rules is not None:  # init's rules, which the written plan extends, beside it
                base = result.rules_written_to(str(output))
                Path(base).write_text(result.rules)
            output.write_text(result.plan_text(output=str(output), base=base))
        except OSError as exc:
            usage_error(f"cannot write {output}: {exc.strerror or exc}")
        written = str(output)
    if format is FitFormat.json:
        import json

        found = result.to_json()
        if written is not None:  # the plan as written, its extends: relative to where it is
            found["plan"] = result.plan_text(output=written, base=base)
        sys.stdout.write(json.dumps(found, indent=2) + "\n")
    else:
        from ..render.fit_report import render_fit

        screen = Console()
        render_fit(result, screen if screen.is_terminal else Console(width=200), written)  # a log keeps the table's columns whole
    exit_with(EXIT_OK if result.best is not None else EXIT_PROBLEMS)
