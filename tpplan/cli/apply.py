"""`tpplan apply`: the command-line edge of runtime/torchrun.py and runtime/dryrun.py.

Imported whenever `tpplan` starts (cli/commands.py lists the command), so nothing
here imports torch at import time. Prints by the contract of cli/output.py:
`print_report` prints and returns the exit code; usage errors go through
`usage_error`; under torchrun every exit goes through `_leave`.
"""

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Annotated, NoReturn, Optional

import typer

from .output import exit_with, usage_error


class ApplyFormat(str, Enum):
    text = "text"
    json = "json"


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Optimizer(str, Enum):
    adamw = "adamw"
    sgd = "sgd"
    none = "none"


class SaveFormat(str, Enum):
    dcp = "dcp"
    hf = "hf"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


def apply(
    plan: Annotated[str, typer.Option("--plan", metavar="PLAN", help="The plan file (YAML).", show_default=False)],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            metavar="MOD:FN",
            help="An importable callable returning the nn.Module, built under a torch.device context "
            "(the same on every rank; under FakeTensorMode with --dry-run), or hf:DIR, hf:CONFIG.json, hf:TYPE: the transformers "
            "causal LM of a local model directory, a config.json or a model type (built from the config; nothing is downloaded).",
            show_default=False,
        ),
    ],
    tp: Annotated[
        Optional[int],
        typer.Option(
            "--tp",
            metavar="N",
            min=1,
            help="TP degree. torchrun: default the world size; smaller makes a 2-D (dp, tp) mesh. "
            "--dry-run: the number of ranks to simulate; default the largest of the plan's mesh.sizes.",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="No torchrun, no devices: simulate --tp ranks in this process (fake process group, fake tensors: FakeTensorMode); "
                     "a version 2 plan's whole mesh (--world), one rank per distinct position, with memory and collectives per axis."),
    ] = False,
    world: Annotated[
        Optional[int],
        typer.Option(
            "--world",
            metavar="N",
            min=1,
            help="--dry-run of a version 2 plan: the world size its mesh takes (the -1 axis resolved); "
            "default the product of the plan's axes. Under torchrun it must be the world size.",
            show_default=False,
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option("--check", help="Compare outputs and every parameter gradient with a single-device reference built from the same weights."),
    ] = False,
    steps: Annotated[
        int,
        typer.Option(
            "--steps",
            metavar="N",
            min=0,
            help="Also train N steps (--optimizer, default AdamW; cross-entropy on random next tokens for a token model, "
            "inside loss_parallel() when the plan sets it); report the losses and the median step time. "
            "With --check: compare the losses and the final parameters with a single device; in a dry run, "
            "N AdamW steps on every simulated rank, each compared with one device, with the replicas checked after each.",
        ),
    ] = 0,
    inputs: Annotated[
        Optional[str],
        typer.Option(
            "--inputs",
            metavar="MOD:FN",
            help="A callable returning the example input tensor or a tuple of positional tensors; "
            "default: token ids for an Embedding first module, random floats for a Linear.",
            show_default=False,
        ),
    ] = None,
    batch: Annotated[
        Optional[int],
        typer.Option("--batch", metavar="B", min=1, help="Memory planning: batch size of the default inputs per data-parallel rank (--inputs wins). "
                     "Default: a version 2 plan's training.global_batch / (dp_replicate·dp_shard), else 2.", show_default=False),
    ] = None,
    seq: Annotated[
        Optional[int],
        typer.Option("--seq", metavar="S", min=1, help="Memory planning: sequence length of the default inputs (--inputs wins). "
                     "Default: the plan's training.seq, else 8.", show_default=False),
    ] = None,
    dtype: Annotated[
        Optional[DType],
        typer.Option("--dtype", help="Memory planning: the parameters' dtype (default: the plan's training.dtype, else the model's own).", show_default=False),
    ] = None,
    optimizer: Annotated[
        Optional[Optimizer],
        typer.Option("--optimizer", help="Optimizer of the planned training step and of --steps (none: forward and backward only). "
                     "Default: the plan's training.optimizer (in the dry run), else adamw.", show_default=False),
    ] = None,
    fsdp: Annotated[
        Optional[int],
        typer.Option(
            "--fsdp",
            metavar="N",
            min=1,
            help="FSDP2 (fully_shard per block and root) on a data-parallel mesh dim of N after the plan. "
            "--dry-run: simulate a world of N x TP; torchrun: N x --tp must be the world size.",
            show_default=False,
        ),
    ] = None,
    memory_limit: Annotated[
        Optional[str],
        typer.Option(
            "--memory-limit",
            metavar="SIZE",
            help="Memory planning: device memory per rank, e.g. 80GiB; the report says whether the step fits "
            "(without --tp: which of the plan's mesh.sizes fit).",
            show_default=False,
        ),
    ] = None,
    no_reuse: Annotated[
        bool,
        typer.Option(
            "--no-reuse",
            help="Memory planning: simulate every block, not identical repeated blocks once (the report names the blocks it reused).",
        ),
    ] = False,
    every_rank: Annotated[
        bool,
        typer.Option(
            "--every-rank",
            help="Memory planning: simulate every rank of the world, not one per distinct position (slow; the positions' check).",
        ),
    ] = False,
    jobs: Annotated[
        Optional[int],
        typer.Option(
            "--jobs",
            metavar="N",
            min=1,
            help="Memory planning: distinct positions simulated at once, each in its own forked process (default: one per CPU).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[Device, typer.Option("--device", help="Device of each rank; auto: cuda, then npu, then cpu. Picks the backend: nccl, hccl, gloo.")] = Device.auto,
    format: Annotated[ApplyFormat, typer.Option("--format", help="Output format: text (tables, for people) or json (one object; cli.md lists its keys).")] = ApplyFormat.text,
    checkpoint: Annotated[
        Optional[str],
        typer.Option(
            "--checkpoint",
            metavar="PATH",
            help="Load this HuggingFace safetensors file or directory (sharded with model.safetensors.index.json) "
            "or torch.distributed.checkpoint directory after sharding; the model is built without storage and "
            "each rank allocates and reads only its own slices. --dry-run: read only headers / metadata and check keys, "
            "shapes, dtypes (a DCP checkpoint loads under any layout: the report names the one it was saved under).",
            show_default=False,
        ),
    ] = None,
    save: Annotated[
        Optional[str],
        typer.Option("--save", metavar="PATH", help="After the run, save the sharded model to this directory (torchrun only), atomically: staged beside it and renamed into place once every rank has written its files.", show_default=False),
    ] = None,
    save_format: Annotated[
        SaveFormat,
        typer.Option("--save-format", help="dcp: every rank writes its shards, recording the plan and the mesh (loads under any layout); "
                      "hf: consolidated safetensors + config.json."),
    ] = SaveFormat.dcp,
    allow_missing: Annotated[
        Optional[list[str]],
        typer.Option(
            "--allow-missing",
            metavar="PATTERN",
            help="Keys that may be missing from --checkpoint (shell-style, e.g. '*.bias'); they are initialised as the model would.",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option("--timeout", metavar="SECONDS", min=1, help="Bound on every collective: a rank that dies or hangs fails the others after this long."),
    ] = 300.0,
) -> None:
    """Apply a plan under torchrun (or simulate it with --dry-run): shard, run a forward and backward, report."""
    from ..simulation.modelref import ModelRefError
    from ..memory.memory import parse_size
    from ..runtime.options import ApplyOptions, UsageError
    from ..simulation.training import TrainOptions

    try:
        limit = parse_size(memory_limit) if memory_limit is not None else None
    except ValueError as exc:
        usage_error(f"--memory-limit: {exc}")
    train = TrainOptions(
        batch=batch,
        seq=seq,
        dtype=dtype.value if dtype else None,
        optimizer=optimizer.value if optimizer else None,
        fsdp=fsdp,
        memory_limit=limit,
    )
    options = ApplyOptions(
        plan=plan, model=model, tp=tp, check=check, steps=steps, inputs=inputs, device=device.value, timeout=timeout,
        checkpoint=checkpoint, save=save, save_format=save_format.value, allow_missing=tuple(allow_missing or ()), train=train,
        reuse_blocks=not no_reuse, world=world, every_rank=every_rank, jobs=jobs or os.cpu_count() or 1,
    )
    under_torchrun = not dry_run and "RANK" in os.environ
    rank = int(os.environ["RANK"]) if under_torchrun and os.environ["RANK"].isdigit() else 0
    try:
        with _progress(rank == 0 and format is ApplyFormat.text) as on_event:
            try:
                if dry_run:
                    from ..runtime.dryrun import dry_run as run

                    code = print_report(run(options, on_event), format, rank)
                else:
                    from ..runtime.torchrun import run_torchrun

                    codes: list[int] = []  # each rank prints before any leaves: torchrun stops the others at the first exit
                    run_torchrun(options, on_event, publish=lambda report: codes.append(print_report(report, format, rank)))
                    code = codes[0]
            except (UsageError, ModelRefError) as exc:
                usage_error(usage_text(exc), rank=rank)
    except typer.Exit as stop:  # a usage error: under torchrun it still leaves through _leave
        code = stop.exit_code
    if under_torchrun:
        _leave(code)
    exit_with(code)


# (option, kind) of runtime.options.ApplyOptionsError -> its wording in flag names.
_WORDING = {
    ("launch", "not-torchrun"): "tpplan apply runs under torchrun ({missing_text} not set): "
    "torchrun --nproc-per-node N -m tpplan apply ..., or add --dry-run --tp N to simulate N ranks in this process",
    ("launch", "bad-env"): "RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)",
    ("device", "unknown"): "--device must be auto, cpu, cuda or npu, not {value!r}",
    ("device", "no-cuda"): "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)",
    ("device", "no-npu"): "--device npu needs torch_npu installed and an Ascend NPU visible",
    ("tp", "not-a-divisor"): "--tp ({tp}) must divide the world size ({world})",
    ("tp", "below-one"): "--tp ({tp}) must be at least 1",
    ("tp", "missing"): "--dry-run needs --tp N (the plan lists no mesh.sizes to pick from)",
    ("steps", "needs-ranks"): "--steps trains on real ranks (torchrun), or in a dry run with --check (real per-rank values, "
    "compared with one device); without --check --dry-run runs on fake tensors without values",
    ("save", "needs-ranks"): "--save writes real weights: run under torchrun (--dry-run has none)",
    ("fsdp", "not-a-divisor"): "--fsdp ({fsdp}) must divide the world size ({world})",
    ("fsdp", "world-mismatch"): "--fsdp ({fsdp}) x --tp ({tp}) must be the world size ({world})",
    ("fsdp", "version-2"): "--fsdp is a version 1 plan's shorthand: a version 2 plan sets mesh.dp_shard (and its fsdp section) instead",
    ("world", "missing"): "--dry-run: the plan's mesh.{axis} is -1 (the rest of the world): give the world size (--world N)",
    ("world", "version-1"): "--world sizes a version 2 plan's mesh: a version 1 plan's dry run simulates --tp ranks (x --fsdp)",
    ("world", "torchrun-mismatch"): "--world ({world}) is not torchrun's world size ({torchrun_world})",
    ("check", "data-axes"): "--check in a dry run compares real per-rank values of the TP axis with one device; it does not "
    "simulate the data axes (mesh.dp_replicate, mesh.dp_shard, fsdp, checkpointing) with values: run --check under torchrun",
    ("every_rank", "needs-memory"): "--every-rank simulates each rank's memory plan: add a memory option (--batch, --seq, --dtype, "
    "--optimizer, --memory-limit), or use a version 2 plan with data axes",
    ("tp", "not-promised"): "--tp {tp}: the plan's mesh.tp promises {promised}; leave --tp out, or give one of them",
    ("tp", "plan-mismatch"): "--tp {tp}: the plan's mesh gives tp {plan_tp} on {world} ranks ({dims}); leave --tp out, or change mesh.tp",
}


def usage_text(exc: BaseException) -> str:
    """A usage error of the runtime in the command line's words."""
    from ..runtime.options import ApplyOptionsError, RanksUsageError

    if isinstance(exc, RanksUsageError):
        return "\n".join(f"{ranks}: {usage_text(e)}" if ranks else usage_text(e) for ranks, e in exc.errors)
    if isinstance(exc, ApplyOptionsError):
        wording = _WORDING.get((exc.option, exc.kind))
        if wording is None:  # a check without wording of its own (the plan's mesh.axis): the library's reason
            return exc.reason
        facts = dict(exc.facts)
        facts["missing_text"] = ", ".join(facts.get("missing", ()))
        return wording.format(**facts)
    return str(exc)


@contextlib.contextmanager
def worded() -> Iterator[None]:
    """Raise the runtime's typed usage errors as a UsageError in the command line's words."""
    from ..runtime.options import ApplyOptionsError, RanksUsageError, UsageError

    try:
        yield
    except (ApplyOptionsError, RanksUsageError) as exc:
        raise UsageError(usage_text(exc)) from None


def _leave(code: int) -> NoReturn:
    """End a torchrun worker now, after its process group is destroyed.

    torch 2.13 with gloo: a worker that has run DTensor collectives aborts during
    interpreter shutdown now and then ("terminate called without an active
    exception", SIGABRT; about 1 exit in 8 here) although its work is done, and
    torchrun then reports the job failed. Nothing is left to clean up at this
    point, so skip the interpreter's teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def _progress(show: bool) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr naming the current stage (building, sharding i/n, ...),
    on a terminal only: logs and pipes get the report alone."""
    from rich.console import Console

    console = Console(stderr=True)
    if not show or not console.is_terminal:
        yield lambda text: None
        return
    with console.status("starting") as status:
        yield lambda text: status.update(text)


def print_report(report, format: ApplyFormat, rank: int) -> int:
    """Print an apply report (rank 0) or why this rank stops (the others); return the exit code."""
    from ..core.loader import read_plan_text
    from ..core.problems import PlanError
    from ..render.problems import CheckedPlan, Outcome

    checked = CheckedPlan(report.plan_file)
    with contextlib.suppress(PlanError):  # unreadable: its TP001 problem is in the report already
        checked.text = read_plan_text(report.plan_file)
    outcome = Outcome([checked], report.problems)
    if rank != 0:
        # Rank 0 prints the report; the others say only why they stop.
        for problem in outcome.ordered_problems():
            sys.stderr.write(f"rank {rank}: {problem}\n")
        return outcome.exit_code
    if format is ApplyFormat.json:
        import json

        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
        return outcome.exit_code
    from rich.console import Console

    from ..render.apply_report import render_text
    from ..render.problems import render_text as render_problems

    # a run that failed early has no report; an empty plan's run has one, and a checkpoint checked against a layout
    if report.modules or report.checkpoint is not None or not report.problems:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 200  # a pipe or log gets whole parameter names, not 80 columns
        render_text(report, console)
    if report.problems:
        render_problems(outcome)
    return outcome.exit_code
