"""spmd_types (Meta's SPMD type checker, torchtitan 0.3's default) beside tpplan's layout flow.

    python bench/spmd_types_compare.py [--families N] [--no-examples] [--tp N] [--markdown FILE]

For each (model, plan, degree): tpplan's lint (`validate --model --tp N`: its
error and warning codes, and the ops its layout flow stopped at, TP328), the dry
run's `--check` on the same plan (tests/verdicts.py's judge: the ground truth
both are compared with), and spmd_types' checker on the model with the plan
applied (bench/_spmd_glue.py: the types come from the plan's DTensor placements
at to_local/from_local; its verdict, the ops it typed by its default rule only,
and its time). Cases: the shipped plans (plans/*.yaml, plans/hf/, plans/titan/
when torchtitan is installed), torchtitan's DeepSeek-V3 MoE plan without and
with its router fix (`layers.*.moe.router.gate: sum_output_grad`), the
torchtitan MoE cases again with spmd_types run on the MoE edited so that it can
type it (bench/_titan_moe_edit.py: six lines of the model), each lint
rule's failing and passing example (--no-examples: not those), and the
first N transformers families that build and have a TP plan (transformers' own
plan via import-hf, and its --minimal plan where that differs, as the family
sweep does). Prints one line per case as it goes, then a markdown table and the
totals (written to FILE with --markdown).

spmd_types is not a tpplan dependency: without it (pip install spmd_types==0.3.1,
in a separate environment) the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from _common import ROOT, arguments

sys.path.insert(0, str(ROOT / "tests"))  # the differential test's case lists and judge (verdict_cases.py, verdicts.py): one truth for both

FIX = "  layers.*.moe.router.gate: sum_output_grad\n"
LINT_FLOW = ["tpplan/lint/flow.py", "tpplan/lint/ops.py", "tpplan/lint/grad_sums.py"]


@dataclass
class Case:
    name: str
    plan: str
    model: str
    tp: int
    lint: str = ""  # "clean", or the error codes (then the warnings in brackets)
    lint_error: bool = False
    stops: set[str] = field(default_factory=set)  # ops the layout flow stopped at (TP328)
    lint_s: float = 0.0
    check: str = ""  # "passes", the failing codes, or "not run"
    spmd: str = ""  # "clean", "error" (a type error), "no-rule" (what it has no type for), "raised" (the run itself did)
    spmd_message: str = ""
    default_ops: set[str] = field(default_factory=set)
    spmd_s: float = 0.0
    edited_moe: bool = False  # spmd_types run on torchtitan's MoE edited for it (bench/_titan_moe_edit.py)

    @property
    def agree(self) -> str:
        if self.spmd not in ("clean", "error"):
            return "n/a"
        return "yes" if self.lint_error == (self.spmd == "error") else "no"

    @property
    def check_fails(self) -> bool | None:
        return None if self.check == "not run" else self.check != "passes"


def shipped_cases(tp: int | None) -> list[tuple[str, str, str, int]]:
    from verdict_cases import degrees, shipped

    cases = [(name.removeprefix("shipped:"), path, model, tp or degrees(path)[0]) for name, path, model in shipped()]
    if importlib.util.find_spec("torchtitan") is not None:
        for path in sorted((ROOT / "plans" / "titan").glob("*.yaml")):
            plan = str(path.relative_to(ROOT))
            cases.append((plan, str(path), f"tpplan.models.titan:{path.stem.removesuffix('_tp')}", tp or degrees(path)[0]))
    return cases


def edited_moe_cases(specs: list[tuple[str, str, str, int]]) -> list[Case]:
    """The torchtitan MoE cases again, spmd_types on the MoE edited so that it can type it."""
    return [Case(f"{name}, MoE edited for spmd_types", plan, model, tp, edited_moe=True)
            for name, plan, model, tp in specs if model.endswith(("models.titan:deepseek_v3_moe", "models.titan:llama4"))]


def example_cases(directory: Path, tp: int | None) -> list[tuple[str, str, str, int]]:
    """Each lint rule's failing and passing example with its model (the rule docs'; the
    differential test judges them too): plans made to be wrong, and their fixes."""
    from verdict_cases import degrees, rule_examples

    return [(name, path, model, tp or degrees(path)[0]) for name, path, model in rule_examples(directory)]


def unfixed_deepseek(directory: Path, tp: int | None) -> list[tuple[str, str, str, int]]:
    """torchtitan 0.2.2's DeepSeek-V3 MoE plan as torchtitan ships it: the router gate's
    gradient left unsummed (the shipped plan's one fix removed)."""
    if importlib.util.find_spec("torchtitan") is None:
        return []
    shipped = ROOT / "plans" / "titan" / "deepseek_v3_moe_tp.yaml"
    text = shipped.read_text()
    if FIX not in text:
        raise SystemExit(f"{shipped} no longer has the rule {FIX.strip()!r}: update FIX")
    text = text.replace(FIX, "").replace("extends: deepseek_v3_tp.yaml", f"extends: {shipped.parent / 'deepseek_v3_tp.yaml'}")
    path = directory / "deepseek_v3_moe_tp_unfixed.yaml"
    path.write_text(text)
    return [("titan deepseek_v3_moe unfixed (no router sum_output_grad)", str(path), "tpplan.models.titan:deepseek_v3_moe", tp or 2)]


def family_cases(count: int, directory: Path, tp: int | None) -> tuple[list[tuple[str, str, str, int]], list[str]]:
    """The first `count` causal-LM families that build and have a TP plan; the ones skipped, with why."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from verdict_cases import swept

    cases, skipped = [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if len({c[0].split(":")[1] for c in cases}) >= count:
            break
        found = swept(model_type, Path(tempfile.mkdtemp(dir=directory)))
        if isinstance(found, str):
            skipped.append(f"{model_type}: {found.splitlines()[0][:120]}")
            continue
        cases += [(name, path, model, tp or 2) for name, path, model in found]
    return cases, skipped


def run_tpplan(case: Case) -> None:
    from tpplan import load_plan
    from tpplan.lint.checks import check_model
    from tpplan.lint.context import LintContext
    from verdicts import _meta_model, judge  # tests/verdicts.py, on sys.path above

    plan, model = load_plan(case.plan), _meta_model(case.model)
    start = time.perf_counter()
    problems = check_model(plan, model, [case.tp])
    case.lint_s = time.perf_counter() - start
    errors = sorted({p.code for p in problems if p.severity == "error"})
    warned = sorted({p.code for p in problems if p.severity != "error"})
    case.lint_error = bool(errors)
    case.lint = (", ".join(errors) or "clean") + (f" [{', '.join(warned)}]" if warned else "")
    flow = LintContext(plan, model, [case.tp]).flow
    case.stops = {stop.op for stop in flow.stops} if flow is not None else {"(no trace)"}
    verdict = judge(case.plan, case.model, case.tp)
    case.check = "not run" if verdict.kind == "not-run" else (", ".join(verdict.check) or "passes")


def run_spmd(case: Case) -> None:
    import contextlib

    from _spmd_glue import typecheck_plan
    from _titan_moe_edit import edited_titan_moe

    from tpplan import load_plan

    try:
        with edited_titan_moe() if case.edited_moe else contextlib.nullcontext():
            result = typecheck_plan(load_plan(case.plan), case.model, case.tp)
    except Exception as exc:  # the plan does not apply, or the model raises with it (torch's error): no type verdict
        case.spmd, case.spmd_message = "raised", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return
    case.spmd, case.spmd_message, case.default_ops, case.spmd_s = result.verdict, result.message, result.default_ops, result.seconds


def code_lines(path: Path) -> int:
    """Lines of `path` that are neither blank, comments nor docstrings."""
    import ast

    text = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1) if line.strip() and not line.strip().startswith("#") and i not in docs)


def table(cases: list[Case]) -> str:
    rows = ["| case | TP | tpplan lint | --check | spmd_types | agree | flow stopped at (tpplan) | default-rule ops (spmd_types) | lint s | spmd s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        spmd = c.spmd + (f": {c.spmd_message}" if c.spmd != "clean" else "")
        rows.append(f"| {c.name} | {c.tp} | {c.lint} | {c.check} | {spmd.replace('|', '/')} | {c.agree} | "
                    f"{', '.join(sorted(c.stops)) or '-'} | {len(c.default_ops)} | {c.lint_s:.2f} | {c.spmd_s:.2f} |")
    return "\n".join(rows)


def totals(cases: list[Case]) -> str:
    ran = [c for c in cases if c.spmd in ("clean", "error")]
    checked = [c for c in ran if c.check_fails is not None]
    lint_right = sum(c.lint_error == c.check_fails for c in checked)
    spmd_right = sum((c.spmd == "error") == c.check_fails for c in checked)
    default_ops = sorted(set().union(*(c.default_ops for c in cases)))
    glue = ROOT / "bench" / "_spmd_glue.py"
    flow = {name: code_lines(ROOT / name) for name in LINT_FLOW}
    return "\n".join([
        f"- cases: {len(cases)}; spmd_types ran on {len(ran)} (agree {sum(c.agree == 'yes' for c in ran)}, "
        f"disagree {sum(c.agree == 'no' for c in ran)}), could not run on {len(cases) - len(ran)} "
        f"({', '.join(f'{kind} {sum(c.spmd == kind for c in cases)}' for kind in ('no-rule', 'raised'))}; "
        f"of the raised, the lint found an error in {sum(c.spmd == 'raised' and c.lint_error for c in cases)})",
        f"- against --check (where both ran and --check ran, {len(checked)} cases): tpplan's lint right on {lint_right}, "
        f"spmd_types right on {spmd_right}",
        f"- ops the layout flow stopped at (TP328), all cases: {', '.join(sorted(set().union(*(c.stops for c in cases)))) or 'none'}",
        f"- ops spmd_types typed by its default (non-linear) rule only, all cases ({len(default_ops)}): {', '.join(default_ops)}",
        f"- code lines (no blanks, comments, docstrings): tpplan's layout flow {sum(flow.values())} "
        f"({', '.join(f'{Path(k).name} {v}' for k, v in flow.items())}); spmd_types glue {code_lines(glue)} (bench/_spmd_glue.py)",
        f"- seconds: tpplan lint {sum(c.lint_s for c in cases):.1f}, spmd_types checked forward+backward {sum(c.spmd_s for c in ran):.1f}",
    ])


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--families", type=int, default=5, help="how many transformers families (default 5; 0: none)")
    parser.add_argument("--examples", action=argparse.BooleanOptionalAction, default=True,
                        help="the lint rules' failing and passing examples (default: yes)")
    parser.add_argument("--tp", type=int, default=None, help="one degree for every case (default: each plan's first)")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table and totals to this file")
    args = parser.parse_args()
    if importlib.util.find_spec("spmd_types") is None:
        print("spmd_types is not installed: nothing to compare (pip install spmd_types==0.3.1 into a separate venv "
              "created with --system-site-packages, and run this script with its python)")
        return 0
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        specs = shipped_cases(args.tp) + unfixed_deepseek(directory, args.tp)
        if args.examples:
            specs += example_cases(directory, args.tp)
        skipped: list[str] = []
        if args.families:
            found, skipped = family_cases(args.families, directory, args.tp)
            specs += found
        cases = []
        for case in [Case(*spec) for spec in specs] + edited_moe_cases(specs):
            run_tpplan(case)
            run_spmd(case)
            print(f"{case.name} @{case.tp}: lint {case.lint}; --check {case.check}; spmd_types {case.spmd} "
                  f"{case.spmd_message}; agree {case.agree}", flush=True)
            cases.append(case)
    text = table(cases) + "\n\n" + totals(cases) + ("\n- families skipped: " + "; ".join(skipped) if skipped else "") + "\n"
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
