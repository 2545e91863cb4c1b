"""The one-device run that decides the blame for a failing sharded forward: the
plan is at fault only if the model runs without it. Under the values limit the
unsharded model runs with real values; above it, shape-only on fake tensors
(shapes and dtypes, no storage), so the blame is decided at any size. Shared by
the dry run (`runtime/dryrun.py`) and its memory planning (`memory/memory_dryrun.py`)."""

from __future__ import annotations

from collections.abc import Callable

from ..core.problems import PlanError, raised_by_tpplan
from .modelref import build_model, default_dtype, make_inputs, model_failure


def blamed(failure: PlanError, blame: Callable[[], PlanError | None]) -> PlanError:
    """What a sharded run that failed with `failure` (located at its rule) reports: the
    model's own failure when `blame()` (a run without the plan on one device) finds it
    fails there too, else `failure`. The one rule of blame for the dry run's passes and
    its memory planning. A PlanError of the one-device run itself (the model cannot be
    built again) is the model's too."""
    try:
        own = blame()
    except PlanError as exc:
        return exc
    return failure if own is None else own


def one_device_failure(options, factory, dtype=None, batch: int = 2, seq: int = 8) -> PlanError | None:
    """Whether the model fails without the plan on one device: its TP500 at the line
    of its code that raised, else None. What decides the blame for a sharded forward
    that failed, at any size: a model under the values limit runs with real values,
    a bigger one shape-only on fake tensors (shapes and dtypes, no storage). `dtype`:
    the default dtype it is built in (memory planning's --dtype); `batch` x `seq`:
    the default inputs' size. None as well when fake tensors cannot run it (an op
    that reads a value): the one-device run cannot tell."""
    import torch

    from .ladder import values_allowed
    from .simulate import fake_tensors

    with default_dtype(dtype):
        with fake_tensors():
            model = build_model(options.model, "cpu", factory)
            if not values_allowed(model):
                inputs = make_inputs(options.inputs, model, "cpu", batch=batch, seq=seq)
                return unsharded_failure(options, model, inputs, shape_only=True, dtype=dtype)
        torch.manual_seed(options.seed)
        model = build_model(options.model, "cpu", factory)
        inputs = make_inputs(options.inputs, model, "cpu", batch=batch, seq=seq)
        return unsharded_failure(options, model, inputs, dtype=dtype)


def unsharded_failure(options, model, inputs: tuple, shape_only: bool = False, dtype=None) -> PlanError | None:
    """The TP500 of one forward and backward of the unsharded `model` (real values,
    or fake tensors when `shape_only`, run in the mode they belong to), or None when it runs."""
    from .simulate import fake_limit, forward_backward

    try:
        forward_backward(model, inputs)
        return None
    except Exception as exc:  # the user's model on one device: its own problem, never the plan's
        if raised_by_tpplan(exc):
            raise
        if shape_only and fake_limit(exc):
            return None  # fake tensors cannot run it: the one device cannot tell
        shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
        how = [f"in {str(dtype).removeprefix('torch.')}"] if dtype is not None else []
        how += ["a shape-only run on fake tensors, the model being above the values limit"] if shape_only else []
        how += [] if options.inputs else [f"on the default inputs {shapes}: a model that needs others takes --inputs MOD:FN"]
        hint = f" ({'; '.join(how)})" if how else ""
        return model_failure(options.model, "without the plan, one forward and backward on one device", exc,
                             f"the model fails on one device too{hint}, so the plan is not the cause: ")
