"""The plans the differential test (test_verdicts.py) judges, lint against
`--check` (tests/verdicts.py): the shipped plans with their models, the rule
docs' examples, fuzzed plans (test_lint_fuzz.py's generator) and the family
sweep's tiny models with transformers' plans (test_hf_sweep.py).

KNOWN lists the disagreements that are not fixed, each with its reason: a
disagreement that is fixed must leave the list (the test checks both ways).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from tpplan import load_plan
from tpplan.lint import RULES

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = [
    ("plans/llama_tp.yaml", "tpplan.models.llama:tiny"),
    ("plans/llama_tp_sp.yaml", "tpplan.models.llama:tiny"),
    ("plans/llama_tp_sp_loss_parallel.yaml", "tpplan.models.llama:tiny"),
    ("plans/mlp_tp.yaml", "tpplan.models.mlp:tiny"),
]

# case id -> (the kind the differential finds, why it is not "agree")
KNOWN: dict[str, tuple[str, str]] = {
    "shipped:plans/hf/qwen3_moe_ep_sp.yaml@2": ("not-run", (
        "expert_parallel's all_to_all dispatch has per-rank split sizes, which LocalTensorMode cannot run in one "
        "process (UnsimulatableDispatch): torchrun's --check checks it"
    )),
    "shipped:plans/hf/qwen3_moe_ep_sp.yaml@4": ("not-run", "the same all_to_all dispatch as at TP 2: only torchrun's --check runs it"),
    "rules:TP327:failing@2": ("false-alarm", (
        "the dry run's blind spot, not the lint's: with nothing else sharded the gate's output is a plain tensor, "
        "and under the fake process group its gradient's all-reduce is a no-op; torchrun's --check on 2 ranks fails "
        "it (TP505, gate.weight grad twice one device's)"
    )),
    "rules:TP329:failing@2": ("not-run", (
        "the example's model starts with a Conv1d, for which there are no default inputs: the dry run needs "
        "--inputs (the lint's TP329 says the same)"
    )),
    "rules:TP370:failing@2": ("unconfirmed", (
        "TP370 is about training under loss_parallel() (the loss needs vocabulary-sharded logits); --check "
        "compares a plain scalar loss of the outputs, which a replicated head passes"
    )),
}


def degrees(path: str | Path) -> list[int]:
    return load_plan(path).mesh_sizes or [2]


def shipped() -> list[tuple[str, str, str]]:
    """(case id, plan path, model) of every shipped plan and the models it is for (test_lint_shipped.py)."""
    cases = [(f"shipped:{plan}", str(ROOT / plan), model) for plan, model in REFERENCE]
    for path in sorted((ROOT / "plans" / "hf").glob("*.yaml")):
        family = re.sub(r"_(tp|ep)(_sp)?$", "", path.stem)
        plan = str(path.relative_to(ROOT))
        cases.append((f"shipped:{plan}", str(path), f"tpplan.models.hf:{family}"))
        if family == "llama":
            cases.append((f"shipped:{plan}:tied", str(path), "tpplan.models.hf:llama_tied"))
    return cases


def rule_examples(directory: Path) -> list[tuple[str, str, str]]:
    """(case id, plan path, model) of each rule's failing and passing example, written to `directory`."""
    cases = []
    for code, rule in RULES.items():
        for which, text, model in (("failing", rule.failing, rule.failing_model or rule.model), ("passing", rule.passing, rule.model)):
            path = directory / f"{code}_{which}.yaml"
            path.write_text(textwrap.dedent(text).lstrip("\n"))
            cases.append((f"rules:{code}:{which}", str(path), model))
    return cases


def swept(model_type: str, directory: Path) -> list[tuple[str, str, str]] | str:
    """(case id, plan path, model) of transformers' own plan for a tiny `model_type`
    (import-hf, as the family sweep does) and of its `--minimal` plan (as the CLI
    writes it, with the lint's TP325 fixes) where that differs; why not, when the
    family does not build or has no plan."""
    import torch

    from tpplan.hf.importer import import_hf
    from tpplan.models.hf_any import build, tiny_config
    from tpplan.lint.fixes import added_rules

    try:  # transformers' own config checks and constructor on a shrunk config: not tpplan's to judge
        tiny_config(model_type).save_pretrained(directory)
        with torch.device("meta"):
            build(model_type)
    except Exception as exc:  # the sweep records these as "does not build"
        return f"does not build: {type(exc).__name__}: {exc}"
    model = f"tpplan.models.hf_any:{model_type.replace('-', '_')}"
    cases, bodies = [], set()
    for minimal in (False, True):
        path = directory / ("minimal.yaml" if minimal else "hf.yaml")
        try:  # the CLI's import-hf [--minimal]
            text = import_hf(directory, minimal=minimal, lint_fixes=added_rules, output=path).text
        except ValueError as exc:  # no TP plan, or one import-hf cannot read (the sweep's "no TP plan" / "import")
            return f"no plan: {exc}"
        body = text.split("\nrules:\n", 1)[1]
        if body in bodies:
            continue  # nothing to share: the same rules as without --minimal
        bodies.add(body)
        path.write_text(text)
        cases.append((f"sweep:{model_type}" + (":minimal" if minimal else ""), str(path), model))
    return cases
