"""The same figures (per-rank bytes, collectives, the check) for another plan of the model:
transformers' own TP plan, or a plan given with `--compare`, dry-run as the inferred one is."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.loader import load_plan
from .prove import Degree, Target, _degree


TRANSFORMERS = "transformers"  # the label of transformers' own plan among the compared ones


def plan_file(label: str) -> str:
    """The file name a compared plan's problems are located in: the path given to
    `--compare` (its label), or transformers' plan, which has no file."""
    return "<transformers' tp_plan>" if label == TRANSFORMERS else label


def figures(target: Target, plan_text: str, degrees: Sequence[int], event: Callable[[str], None], *, file: str = "<compare>") -> dict:
    """{degree: Degree} of `plan_text` (read from `file`) at each degree, from the dry run on
    fake tensors (its bytes and collectives; values are the inferred plan's proof, not the
    compared one's): a degree where it fails has check {"passed": false, "error": its first
    problem, "summary": what failed and where, in one short line}."""
    from ..runtime.dryrun import dry_run_with
    from ..runtime.options import ApplyOptions

    plan = load_plan(text=plan_text, file=file)
    out = {}
    for degree in degrees:
        event(f"dry run of the compared plan at TP {degree}")
        options = ApplyOptions(plan=file, model=target.ref, tp=degree, check=False, inputs=target.inputs)
        report = dry_run_with(options, plan, target.factory, event)
        result = _degree(report, degree)
        errors = [p for p in report.problems if p.severity == "error"]
        if errors:
            result.check = {"passed": False, "max_abs_diff": None, "error": f"{errors[0].code}: {errors[0].message}",
                            "summary": summary(errors[0], plan)}
        out[degree] = result
    return out


def summary(problem, plan) -> str:
    """`TP502 at plans/mlp_tp.yaml:15 (rule 'blocks.*.out_proj'): the forward of 'blocks.0.out_proj'
    (Linear, input (2, 8, 43)) fails at TP 3`: the code, the place, the rule there and the
    message's first clause (what failed, without torch's words for why)."""
    where = f"{problem.file}:{problem.line}"
    rule = next((r.pattern for r in plan.rules if r.line == problem.line), None) if problem.file == plan.file else None
    what = problem.message.split("; ")[0].split(": ")[0].strip().rstrip(".")
    if len(what) > 120:
        what = what[:117] + "..."
    return f"{problem.code} at {where}{f' (rule {rule!r})' if rule else ''}: {what}"


def transformers_plan(model) -> str | None:
    """transformers' own TP plan of an HF model, imported as tpplan YAML; None when it has none."""
    import tempfile

    from ..hf.config import HfConfigError
    from ..hf.importer import import_hf
    from ..lint.fixes import added_rules

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return None
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        try:
            return import_hf(directory, lint_fixes=added_rules).text
        except HfConfigError:  # no plan to import (HfImportError), or a config it cannot read back
            return None
