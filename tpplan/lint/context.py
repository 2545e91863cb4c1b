"""What every lint rule sees: the plan, the model, the TP degrees, and facts
computed once per context and shared (cached properties: resolution, the
traced forward, the layout flow, head counts, parameter placements, the blocks
the dry run keeps).

The trace depends only on the model, so checking several plans (or, in the
tests, many mutated plans) against one model should trace it once: a
`TraceCache` keeps each model's trace while the model lives, with a
fingerprint of the model (its modules, their classes, parameters, buffers and
plain attributes) that must still match for the trace to be reused; a model
changed between two calls is traced again.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from ..core.plan import Plan, Rule
from ..core.problems import Problem

if TYPE_CHECKING:
    from torch import nn

    from .facts import HeadIndex, Placed
    from .flow import FlowReport
    from .trace import Trace

# (trace or None, the mode it ran in, or the error that stopped every mode)
Traced = tuple["Trace | None", str]
_PLAIN_ATTRS = (int, float, bool, str, type(None))


def fingerprint(model: "nn.Module") -> tuple:
    """What a trace of `model` depends on, short of its forward's code: every module
    (identity, class, a patched forward), its plain attributes, and its parameters'
    and buffers' identity, shape, dtype and device.

    Not block identity (simulation/blocks.py): that asks whether two blocks compute
    alike, so that one stands for the other; this asks whether one model is still the
    model it was when traced, so it keeps what identity leaves out on purpose: the
    objects' own identity, devices, a patched forward, the config, and names."""
    parts: list[Any] = []
    for fqn, module in model.named_modules():
        state = module.__dict__
        parts.append((
            fqn, id(module), type(module), state.get("forward"),
            tuple((k, v) for k, v in state.items() if k[0] != "_" and type(v) in _PLAIN_ATTRS),
            tuple((k, id(p), p.shape, p.dtype, p.device, p.requires_grad) for k, p in module._parameters.items() if p is not None),
            tuple((k, id(b), b.shape, b.dtype, b.device) for k, b in module._buffers.items() if b is not None),
        ))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        parts.append(tuple(sorted((k, v) for k, v in vars(config).items() if type(v) in _PLAIN_ATTRS)))
    return tuple(parts)


class TraceCache:
    """model -> its trace, while the model lives and is unchanged (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Traced]]" = weakref.WeakKeyDictionary()

    def get(self, model: "nn.Module", compute: "Callable[[nn.Module], Traced]") -> Traced:
        entry = self._entries.get(model)
        key = fingerprint(model)  # ~50 ms for 12,000 modules (a 1,000-layer Llama), a few % of a trace
        if entry is not None and entry[0] == key:
            return entry[1]
        traced = compute(model)
        self._entries[model] = (key, traced)
        return traced


# What `lint_model` uses unless given a cache of its own.
TRACES = TraceCache()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for one block, restoring its state after.

    The trace and the flow analysis allocate a few objects per tensor op and free
    none until they end: the collector would rescan them all, over and over, which
    makes deep models superlinear (bench/bench_lint_gc.py: x1.3-1.5 slower at 1,000
    layers with it on).
    Nothing they allocate makes cycles worth collecting. Only these two blocks are
    paused, not the dry run (torch's fake tensors do make cycles)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LintContext:
    def __init__(self, plan: Plan, model: "nn.Module", tp_sizes: Sequence[int], traces: TraceCache | None = None,
                 inputs: str | None = None):
        self.inputs = inputs  # MOD:FN of the example inputs to trace with (default: from the first module)
        self.plan = plan
        self.model = model
        self.tp_sizes = list(tp_sizes)
        self.traces = TRACES if traces is None else traces
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.matched, self.resolution_problems = resolve(plan, self.modules)

    @property
    def splits(self) -> bool:
        """Whether a checked degree splits tensors. At TP 1 a shard or a partial sum is
        the whole tensor, so a layout the flow finds wrong (TP320-TP322, TP324, TP325)
        still computes one device's values there; mixing a DTensor with a plain tensor
        (TP323) fails at any degree."""
        return any(tp > 1 for tp in self.tp_sizes)

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
    def _traced(self) -> Traced:
        with collector_paused():
            return self.traces.get(self.model, lambda model: _trace(model, self.inputs))

    @property
    def trace(self) -> "Trace | None":
        return self._traced[0]

    @property
    def trace_mode(self) -> str | None:
        """How the model ran ('meta', 'fake' or 'values', see simulation/ladder.py)."""
        return self._traced[1] if self.trace is not None else None

    @property
    def trace_error(self) -> str | None:
        return self._traced[1] if self.trace is None else None

    @cached_property
    def flow(self) -> "FlowReport | None":
        if self.trace is None:
            return None
        from .flow import analyze

        with collector_paused():
            return analyze(self.trace, self.matched, self.modules)

    # -- facts several rules read ----------------------------------------------------------

    @cached_property
    def heads(self) -> "HeadIndex":
        """The head counts inside each module (`ctx.heads.of(fqn)`, `ctx.heads.split(fqn, rule)`)."""
        from .facts import HeadIndex

        return HeadIndex(self.modules)

    @cached_property
    def placements(self) -> "dict[str, Placed]":
        """{parameter name: its placement under the plan} (facts.parameter_placements)."""
        from .facts import parameter_placements

        return parameter_placements(self.modules, self.matched)

    @cached_property
    def kept_blocks(self) -> list:
        """(container, the children the dry run keeps) for each run of identical blocks."""
        from .collapse import kept_blocks

        return kept_blocks(self.trace, self.matched, self.modules)


def resolve(plan: Plan, modules: dict[str, "nn.Module"]) -> tuple[dict[str, Rule], list[Problem]]:
    """{fqn: rule} and the strict-resolution problems (TP200, TP201).

    When resolution fails, the model checks still run on what does resolve
    (each module claimed by the first rule that matches it), so one typo in a
    glob does not hide every other finding.
    """
    return plan.claim(modules)


def _trace(model: "nn.Module", inputs_ref: str | None = None) -> "tuple[Trace | None, str]":
    from ..simulation.simulate import default_inputs
    from ..simulation.ladder import available, prepared, running
    from .trace import TraceError, trace_model

    failures = []
    for mode in available(model):
        runnable = prepared(model, mode)
        try:
            with running(mode, runnable):
                if inputs_ref is None:
                    inputs = (default_inputs(runnable),)  # on the model's device: meta for `validate --model`
                else:
                    from ..simulation.modelref import make_inputs

                    device = next((t.device for t in runnable.parameters()), "cpu")
                    inputs = make_inputs(inputs_ref, runnable, device)
                return trace_model(runnable, inputs), mode
        except ValueError as exc:  # no default inputs: no mode helps
            return None, str(exc)
        except TraceError as exc:
            failures.append(f"{mode}: {exc}")
    return None, f"the forward of {type(model).__name__} fails on {'meta, fake and random' if len(failures) > 2 else 'meta and fake'} tensors ({failures[0]})"
