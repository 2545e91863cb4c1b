"""Helpers for the tests of tpplan.lint: models built once on the meta device, and
`lint(text, model)` returning the problems of an inline plan."""

from __future__ import annotations

import functools
import importlib
import textwrap

import torch

from tpplan import load_plan
from tpplan.lint import lint_model


@functools.lru_cache(maxsize=None)
def meta_model(ref: str):
    """The model `MOD:FN` names, built once on the meta device (its trace is cached with it)."""
    module, _, fn = ref.partition(":")
    with torch.device("meta"):
        return getattr(importlib.import_module(module), fn)()


def lint(text: str, model, tp=(2,), select=None, file: str = "plan.yaml"):
    """Problems of the plan `text` (dedented) against `model` (a module or a MOD:FN) at `tp`."""
    if isinstance(model, str):
        model = meta_model(model)
    plan = load_plan(text=textwrap.dedent(text).lstrip("\n"), file=file)
    return lint_model(plan, model, list(tp), select=select)


def found(problems, code: str) -> list[tuple[int, int]]:
    """(line, column) of each problem with `code`."""
    return [(p.line, p.column) for p in problems if p.code == code]


def only(problems, code: str):
    """The one problem with `code` (fails unless there is exactly one)."""
    matching = [p for p in problems if p.code == code]
    assert len(matching) == 1, [str(p) for p in problems]
    return matching[0]
