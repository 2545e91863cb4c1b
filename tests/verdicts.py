"""Whether the lint's verdict on a plan is the dry run's: `validate --model --tp N`
against `apply --dry-run --tp N --check` on the same plan and model.

The differential test's judge (test_verdicts.py, which runs it over its cases, also
as `python tests/test_verdicts.py`; bench/spmd_types_compare.py compares spmd_types
with it). The lint promises two things, and this module tests them on one (plan,
model, TP):

- lint-clean (no error) => `--check` passes: a clean lint that fails the check is
  a *miss* (the lint let a wrong plan through);
- a TP32x error (a layout the lint follows through the forward going wrong) =>
  `--check` fails: a TP32x the check does not confirm is a *false alarm*.

Other lint errors that the check does not confirm are told apart (`unconfirmed`):
some are about what `--check` does not run (training under `loss_parallel`).
A plan the dry run cannot check as asked (no default inputs for the model, a
model that fails on one device too on them: TP500, an expert dispatch that only
torchrun can run) is `not-run`, and compared with nothing.
A miss the lint warned it could not rule out (TP328: the flow stopped at an op it
does not model; TP329: no trace) keeps those warnings in `disclosed`.

    verdict = judge("plan.yaml", "tpplan.models.llama:tiny", tp=2)
    verdict.kind  # "agree", "miss", "false-alarm", "unconfirmed" or "not-run"
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

FLOW = re.compile(r"TP32[0-8]")  # the layout-flow errors (TP329 is the warning that it could not run)
# expert_parallel's all_to_all dispatch under LocalTensorMode: torchrun checks it, the dry run cannot
_CANNOT_CHECK = "UnsimulatableDispatch"
_MODEL_FAILS = "TP500"  # the model factory, or the model on one device without the plan, fails: not the plan's verdict
_STOPPED = ("TP328", "TP329")  # the lint's warnings that part of the flow was not followed
KINDS = ("agree", "miss", "false-alarm", "unconfirmed", "not-run")


@dataclass(frozen=True)
class Verdict:
    """The lint's and the check's findings on one plan, model and degree."""

    plan: str
    model: str
    tp: int
    lint: tuple[str, ...]  # the codes of the lint's errors, in its order
    check: tuple[str, ...]  # the codes of the dry run's problems (none: --check passed)
    lint_text: str = ""
    check_text: str = ""
    disclosed: tuple[str, ...] = ()  # the lint's warnings that it could not check everything

    @property
    def flow(self) -> tuple[str, ...]:
        return tuple(code for code in self.lint if FLOW.fullmatch(code))

    @property
    def kind(self) -> str:
        if self.check == ("not run",):
            return "not-run"
        if not self.lint:
            return "agree" if not self.check else "miss"
        if self.check:
            return "agree"
        return "false-alarm" if self.flow else "unconfirmed"

    def describe(self) -> str:
        lint = ", ".join(self.lint) or "clean"
        check = ", ".join(self.check) or "passes"
        warned = f" (warned {', '.join(self.disclosed)})" if self.disclosed else ""
        text = f"{self.kind}: {self.plan} on {self.model} at TP {self.tp}: lint {lint}{warned}, --check {check}"
        detail = self.check_text if self.kind == "miss" else self.lint_text
        return text + (f"\n    {detail.splitlines()[0][:400]}" if detail and self.kind != "agree" else "")


@functools.lru_cache(maxsize=None)
def _meta_model(ref: str):
    """The model `ref` names, built once on the meta device (the lint's trace of it is cached with it)."""
    import torch

    from tpplan.simulation.modelref import load_callable

    factory = load_callable(ref, "--model")
    with torch.device("meta"):
        return factory()


def judge(plan_path: str | Path, model: str, tp: int) -> Verdict:
    """The lint (`check_model` at `tp`, every rule) and the dry run with `--check` at `tp`
    on the plan file `plan_path` and the model factory `model` (MOD:FN)."""
    from tpplan.core.loader import load_plan
    from tpplan.lint.checks import check_model
    from tpplan.runtime.dryrun import dry_run
    from tpplan.simulation.modelref import ModelRefError
    from tpplan.runtime.options import ApplyOptions, UsageError

    plan = load_plan(plan_path)  # a plan that does not load is nothing to compare: PlanError
    problems = check_model(plan, _meta_model(model), [tp])
    errors = [p for p in problems if p.severity == "error"]
    lint, lint_text = tuple(p.code for p in errors), "\n".join(map(str, errors))
    disclosed = tuple(sorted({p.code for p in problems if p.code in _STOPPED}))
    made = functools.partial(Verdict, str(plan_path), model, tp, lint, lint_text=lint_text, disclosed=disclosed)
    try:
        report = dry_run(ApplyOptions(plan=str(plan_path), model=model, tp=tp, check=True))
    except (UsageError, ModelRefError) as exc:  # the dry run cannot run as asked (no default inputs): nothing to compare
        return made(("not run",), check_text=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # the CLI's exit 3 (tpplan's bug, or a style's untyped error): the run fails
        return made((f"raised {type(exc).__name__}",), check_text=f"{type(exc).__name__}: {exc}")
    failures = [p for p in report.problems if p.severity == "error"]
    text = "\n".join(map(str, failures))
    if any(_CANNOT_CHECK in p.message for p in failures):  # the dry run says it cannot check this plan in one process
        return made(("not run",), check_text=text)
    if any(p.code == _MODEL_FAILS for p in failures):  # the model (or its factory) fails without the plan: no plan was checked
        return made(("not run",), check_text=text)
    if not failures and report.check is None:
        raise RuntimeError(f"the dry run of {plan_path} did not check")  # it always checks when asked to
    return made(tuple(p.code for p in failures), check_text=text)


def tally(verdicts: Iterable[Verdict]) -> Counter:
    """{kind: how many}, every kind present (zero included), and 'plans' for the total."""
    counts = Counter({kind: 0 for kind in KINDS})
    for verdict in verdicts:
        counts[verdict.kind] += 1
        counts["plans"] += verdict.kind != "not-run"
    return counts
