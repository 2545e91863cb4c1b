"""`tpplan init`: the command-line edge of tpplan.init.

The plan goes to standard output (or `-o`), the report of what was proven to
standard error (standard output with `-o`), so `tpplan init ... > plan.yaml` works.
"""

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .output import EXIT_OK, EXIT_PROBLEMS, Format, exit_with, usage_error


def init(
    model: Annotated[
        str,
        typer.Option(metavar="MOD:FN", help="The model: an importable callable returning an nn.Module, or hf:NAME "
                     "(a transformers model type, config.json or model directory).", show_default=False),
    ],
    tp: Annotated[
        Optional[list[str]],
        typer.Option(metavar="N", help="Degrees to prove the plan at (repeat, or 2,4,8); default: the degrees in "
                     "2..8 that divide the sizes of all the model can shard (features, heads, KV heads, vocabulary, "
                     "experts). A degree given that shards under half of that is warned of.", show_default=False),
    ] = None,
    sp: Annotated[bool, typer.Option("--sp", help="Sequence parallelism: norms on the residual stream sharded on the sequence.")] = False,
    ep: Annotated[bool, typer.Option("--ep", help="Experts whole per rank (expert_parallel) instead of each sharded (expert_tp).")] = False,
    loss_parallel: Annotated[bool, typer.Option("--loss-parallel", help="Keep the head's logits sharded on the vocabulary (loss_parallel).")] = False,
    shard_more: Annotated[bool, typer.Option("--shard-more", help="Shard every group the proof keeps, also where the model's own plan "
                                             "(transformers' tp_plan) leaves it whole and sharding it runs more backward collectives.")] = False,
    from_plan: Annotated[
        Optional[Path],
        typer.Option("--from", metavar="PLAN", help="Start from this plan: apply the fixes the lint is sure of "
                     "(TP311 heads, TP325 local_params, TP321/TP322 a parameter sharded with the shard it meets, "
                     "TP326 packed, TP340 shared input) and write the fixed plan.",
                     show_default=False),
    ] = None,
    compare: Annotated[
        Optional[Path],
        typer.Option("--compare", metavar="PLAN", help="Also dry-run this plan at the same degrees and report its figures "
                     "beside the inferred plan's (transformers' own plan is compared without asking).", show_default=False),
    ] = None,
    inputs: Annotated[
        Optional[str],
        typer.Option(metavar="MOD:FN", help="Example inputs for the model (as apply's --inputs).", show_default=False),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", metavar="PLAN", help="Write the plan here instead of standard output.", show_default=False),
    ] = None,
    format: Annotated[Format, typer.Option(help="Output format of the report: text, or json (one object: plan, degrees, compare, warnings, lint_warnings, dropped).")] = Format.text,
) -> None:
    """Infer a tensor-parallel plan from the model's traced data flow, prove it, write it.

    Column -> row pairs (through heads, attention and elementwise ops), the token
    embedding, the output head, experts by shape and, with --sp, the norms on the
    residual stream. The plan is written only as proven: the lint and
    `apply --dry-run --check` at every degree of its mesh.sizes; a rule that fails is
    dropped and the plan says why. A model with its own plan (transformers' tp_plan): where
    sharding more would run more backward collectives than it, what it leaves whole stays
    whole (a trade its authors chose) unless --shard-more. Exit 0 when a plan is written
    (an empty plan is one, and so is one at a --tp degree warned of for sharding little),
    1 when the model cannot be built or traced.
    """
    from ..core.problems import PlanError
    from ..simulation.modelref import load_callable

    degrees = _degrees(tp)
    factory = load_callable(model, "--model")
    compare_text = {}
    if compare is not None:
        from ..core.loader import read_plan_text

        compare_text[str(compare)] = read_plan_text(compare)
    try:
        if from_plan is not None:
            from ..init.fix import fix_plan

            inferred = fix_plan(from_plan, factory, ref=model, tp=degrees, inputs=inputs, output=str(output) if output else None,
                                compare=compare_text)
        else:
            from ..init import run_init

            inferred = run_init(factory, ref=model, tp=degrees, sp=sp, ep=ep, loss_parallel=loss_parallel, inputs=inputs,
                                output=str(output) if output else None, compare=compare_text, auto_compare=True,
                                shard_more=shard_more)
    except PlanError:
        raise  # the app prints the problems (TP500: the model does not build; TP329: no trace), exit 1
    if output is not None:
        try:
            output.write_text(inferred.text)
        except OSError as exc:
            usage_error(f"cannot write {output}: {exc.strerror or exc}")
    if format is Format.json:
        import json

        sys.stdout.write(json.dumps(inferred.to_json(), indent=2) + "\n")
    else:
        if output is None:
            sys.stdout.write(inferred.text)
        from ..render.init_report import render_report

        typer.echo(render_report(inferred), err=output is None)
    exit_with(EXIT_OK if inferred.ok else EXIT_PROBLEMS)


def _degrees(values: "Optional[list[str]]") -> "Optional[list[int]]":
    if not values:
        return None
    out = []
    for value in values:
        for part in value.replace(" ", ",").split(","):
            if not part:
                continue
            if not part.isdecimal() or int(part) < 1:
                usage_error(f"--tp takes degrees (whole numbers from 1), not {part!r}")
            out.append(int(part))
    return out
