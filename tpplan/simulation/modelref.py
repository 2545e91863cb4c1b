"""`MOD:FN` references: import the callable, build the model on a device, make
example inputs.

A reference that cannot be resolved (bad syntax, no such module or attribute)
is a usage error (`ModelRefError`, exit 2); a factory that runs but fails or
returns something else is a problem of the model (`PlanError` with TP500,
located at the line of the user's code that raised, exit 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..core.imports import import_module
from ..core.problems import PlanError, error, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn


class ModelRefError(ValueError):
    """A `--model` / `--inputs` reference that does not name a callable."""


@contextlib.contextmanager
def default_dtype(dtype: "torch.dtype | None") -> Iterator[None]:
    """Build the model in `dtype`: parameters are born in it (`Module.to` cannot
    swap fake parameters in place)."""
    import torch

    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_callable(ref: str, option: str = "--model") -> Callable[..., Any]:
    """The callable that `ref` ("package.module:function") names; "hf:SPEC" names
    the transformers causal LM of a local config (tpplan.hf.build)."""
    if option == "--model" and ref.startswith("hf:"):
        from ..hf.build import factory
        from ..hf.config import HfConfigError

        try:
            return factory(ref)
        except HfConfigError as exc:
            raise ModelRefError(str(exc)) from None
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ModelRefError(f"{option} {ref!r} must be MODULE:FUNCTION, e.g. tpplan.models.llama:tiny")
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the module we were asked for (or a parent package) counts as "not found";
        # a missing import *inside* that module is its own error, shown with its location.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ModelRefError(f"{option} {ref!r}: no module named {exc.name!r} (not in the current directory: is it installed, or on PYTHONPATH?)") from None
        raise ModelRefError(f"{option} {ref!r}: importing {module_name!r} failed: {_raised_at(exc)}") from None
    except Exception as exc:  # user code runs at import: any error is reported with where it happened
        raise ModelRefError(f"{option} {ref!r}: importing {module_name!r} failed: {_raised_at(exc)}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            defined = [name for name, value in vars(module).items() if not name.startswith("_") and _defined_in(value, module_name)]
            # Functions (the usual factories) before classes.
            defined.sort(key=lambda name: (inspect.isclass(getattr(module, name)), name))
            hint = f"; it defines {', '.join(defined[:8])}{' ...' if len(defined) > 8 else ''}" if defined else ""
            raise ModelRefError(f"{option} {ref!r}: module {module_name!r} has no attribute {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelRefError(f"{option} {ref!r}: {attr!r} is a {type(target).__name__}, not a callable")
    return target


def _defined_in(value: Any, module_name: str) -> bool:
    return (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module_name


def _raised_at(exc: BaseException) -> str:
    """`ValueError: msg (at models.py:12)`: the innermost frame, the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{first_line(exc, with_type=True)}{where}"


def model_failure(ref: str, what: str, exc: BaseException, lead: str = "") -> PlanError:
    """TP500 for the user's model (or factory) raising `exc` while doing `what`, located at
    the line that raised."""
    torch = sys.modules.get("torch")
    here = os.path.dirname(os.path.abspath(__file__))
    engines = (here + os.sep, os.path.join(os.path.dirname(here), "sharding") + os.sep) + (
        (os.path.dirname(torch.__file__) + os.sep,) if torch is not None and torch.__file__ else ())
    # the last line of the user's (or transformers') code that ran, not torch's kernels or tpplan's runtime
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(engines)]
    file, line = (frames[-1].filename, frames[-1].lineno or 1) if frames else (ref, 1)
    return PlanError([error("TP500", f"{lead}{what} ({ref}) failed: {first_line(exc, with_type=True)}", file, line)])


def _definition(fn: Callable[..., Any], ref: str) -> tuple[str, int]:
    """Where `fn` is defined (its file and first line), for problems about what it returned."""
    try:
        return inspect.getsourcefile(fn) or ref, inspect.getsourcelines(fn)[1] or 1
    except (OSError, TypeError):  # builtins, C extensions, callable instances without source
        return ref, 1


def build_model(
    ref: str, device: "torch.device | str", factory: Callable[[], Any] | None = None, *, real_buffers: bool = False
) -> "nn.Module":
    """The model `ref` names, as the CLI's `--model` takes it (`MOD:FN`, or `hf:SPEC`,
    see `load_callable`): the factory called under `torch.device(device)` (so
    parameters are born there; "meta" costs no memory), checked to be an `nn.Module`.
    A reference that names nothing is a `ModelRefError` (a ValueError); a factory
    that fails or returns something else a `PlanError` (TP500, where it raised).
    `real_buffers` (for a model a checkpoint fills): on "meta", only the parameters
    are; buffers are computed on the CPU as the constructor writes them, since no
    checkpoint holds a non-persistent one."""
    import torch
    from torch import nn

    from ..checkpoint.meta import meta_parameters
    from ..core.torch_range import warn_once
    from ..hf.masks import real_run_masks

    warn_once()  # one line, once, for a torch outside the tested range
    factory = factory or load_callable(ref, "--model")
    where = meta_parameters() if real_buffers and torch.device(device).type == "meta" else torch.device(device)
    try:
        with where:
            model = factory()
    except Exception as exc:  # the user's factory: report where it raised, not a traceback
        raise model_failure(ref, "building the model", exc) from None
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise PlanError([error("TP500", f"--model {ref} returned {article} {kind}, not a torch.nn.Module", *_definition(factory, ref))])
    real_run_masks()  # the factory may have loaded transformers: its masks on fake tensors as on real ones
    return model


def make_inputs(ref: str | None, model: "nn.Module | None", device: "torch.device | str", batch: int = 2, seq: int = 8) -> tuple:
    """Positional example inputs: `ref`'s callable (returning a tensor or a tuple of
    them, created under `torch.device(device)`), or the SPEC default from the model's
    first module, of `batch` x `seq`. Always a tuple."""
    import torch

    from .simulate import default_inputs

    if ref is None:
        try:
            return (default_inputs(model, batch, seq),)
        except ValueError as exc:
            raise ModelRefError(str(exc)) from None
    factory = load_callable(ref, "--inputs")
    try:
        with torch.device(device):
            inputs = factory()
    except Exception as exc:  # the user's inputs factory: located, not a traceback
        raise model_failure(ref, "making the inputs", exc) from None
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args) or "an empty tuple"
        raise PlanError([error("TP500", f"--inputs {ref} must return a tensor or a tuple of tensors, got {kinds}", *_definition(factory, ref))])
    return args


def module_structure(model: "nn.Module") -> list[list]:
    """[module path, class name, [(param name, shape, dtype)...]] per module: what
    must be equal on every rank before a plan is applied."""
    return [
        [
            name,
            type(module).__qualname__,
            [[key, list(p.shape), str(p.dtype).removeprefix("torch.")] for key, p in module.named_parameters(recurse=False)],
        ]
        for name, module in model.named_modules()
    ]


def structure_hash(structure: list[list]) -> str:
    return hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16]
