"""The same figures (per-rank bytes, collectives, the check) for another plan of the model:
transformers' own TP plan, or a plan given with `--compare`, dry-run as the inferred one is."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.loader import load_plan
from .prove import Degree, Target, _degree


def figures(target: Target, plan_text: str, degrees: Sequence[int], event: Callable[[str], None]) -> dict:
    """{degree: Degree} of `plan_text` at each degree, from the dry run on fake tensors (its
    bytes and collectives; values are the inferred plan's proof, not the compared one's): a
    degree where it fails has check {"passed": false, "error": its first problem}."""
    from ..runtime.dryrun import dry_run_with
    from ..runtime.options import ApplyOptions

    plan = load_plan(text=plan_text, file="<compare>")
    out = {}
    for degree in degrees:
        event(f"dry run of the compared plan at TP {degree}")
        options = ApplyOptions(plan="<compare>", model=target.ref, tp=degree, check=False, inputs=target.inputs)
        report = dry_run_with(options, plan, target.factory, event)
        result = _degree(report, degree)
        errors = [p for p in report.problems if p.severity == "error"]
        if errors:
            result.check = {"passed": False, "max_abs_diff": None, "error": f"{errors[0].code}: {errors[0].message}"}
        out[degree] = result
    return out


def transformers_plan(model) -> str | None:
    """transformers' own TP plan of an HF model, imported as tpplan YAML; None when it has none."""
    import tempfile

    from ..hf.importer import HfImportError, import_hf
    from ..lint.fixes import partial_gradient_rules

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return None
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        try:
            return import_hf(directory, fix_partial_gradients=partial_gradient_rules).text
        except HfImportError:
            return None
