"""What every lint rule sees: the plan, the model, the TP degrees, and facts
computed once and shared (resolution, the traced forward, the layout flow).

The trace depends only on the model, so it is kept per model object: checking
several plans (or, in the tests, many mutated plans) against one model traces
it once.
"""

from __future__ import annotations

import weakref
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from ..core.plan import Plan, Rule
from ..core.problems import Problem

if TYPE_CHECKING:
    from torch import nn

    from .flow import FlowReport
    from .trace import Trace

# model -> (trace or None, the mode it ran in, or the error that stopped every mode)
_TRACES: "weakref.WeakKeyDictionary[nn.Module, tuple[Trace | None, str]]" = weakref.WeakKeyDictionary()


class LintContext:
    def __init__(self, plan: Plan, model: "nn.Module", tp_sizes: Sequence[int]):
        self.plan = plan
        self.model = model
        self.tp_sizes = list(tp_sizes)
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.matched, self.resolution_problems = resolve(plan, self.modules)
        self.problems_so_far: list[Problem] = []

    # -- locations -----------------------------------------------------------------

    def plan_location(self) -> tuple:
        """Where plan-wide findings point: the `rules:` key of the plan file."""
        source = getattr(self.plan, "source", None)
        if source is not None:
            return (self.plan.file, *source.locate(("rules",), key=True))
        first = self.plan.rules[0] if self.plan.rules else None
        return (first.file, first.line, first.column) if first else (self.plan.file, 1, 1)

    @staticmethod
    def at(rule: Rule) -> tuple:
        return (rule.file, rule.line, rule.column)

    # -- the traced forward ------------------------------------------------------------

    @cached_property
    def _traced(self) -> "tuple[Trace | None, str]":
        cached = _TRACES.get(self.model)
        if cached is None:
            cached = _TRACES[self.model] = _trace(self.model)
        return cached

    @property
    def trace(self) -> "Trace | None":
        return self._traced[0]

    @property
    def trace_mode(self) -> str | None:
        """How the model ran ('meta', 'fake' or 'values', see simulation.py)."""
        return self._traced[1] if self.trace is not None else None

    @property
    def trace_error(self) -> str | None:
        return self._traced[1] if self.trace is None else None

    @cached_property
    def flow(self) -> "FlowReport | None":
        if self.trace is None:
            return None
        from .flow import analyze

        return analyze(self.trace, self.matched, self.modules)


def resolve(plan: Plan, modules: dict[str, "nn.Module"]) -> tuple[dict[str, Rule], list[Problem]]:
    """{fqn: rule} and the strict-resolution problems (TP200, TP201).

    When resolution fails, the model checks still run on what does resolve
    (each module claimed by the first rule that matches it), so one typo in a
    glob does not hide every other finding.
    """
    return plan.claim(modules)


def _trace(model: "nn.Module") -> "tuple[Trace | None, str]":
    from ..runtime.simulate import default_inputs
    from .simulation import available, prepared, running
    from .trace import TraceError, trace_model

    failures = []
    for mode in available(model):
        runnable = prepared(model, mode)
        try:
            with running(mode, runnable):
                inputs = default_inputs(runnable)  # on the model's device: meta for `validate --model`
                return trace_model(runnable, (inputs,)), mode
        except ValueError as exc:  # no default inputs: no mode helps
            return None, str(exc)
        except TraceError as exc:
            failures.append(f"{mode}: {exc}")
    return None, f"the forward of {type(model).__name__} fails on meta, fake{' and random' if len(failures) > 2 else ''} tensors ({failures[0]})"
