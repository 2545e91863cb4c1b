"""Turn a style spec from a plan into a fresh torch ParallelStyle object: the class
its style table entry names (core/style_table.py), called with the spec's options."""

from __future__ import annotations

import inspect
from typing import Any

from ..core.external_styles import is_external
from ..core.placements import PlacementSpec
from ..core.quiet import loggers_quiet
from ..core.style_model import StyleSpec
from .lora import for_module
from .styles import ParallelStyle, module_kind, resolve


def _to_torch(value: Any) -> Any:
    if isinstance(value, PlacementSpec):
        return value.to_torch()
    if isinstance(value, list):  # torch takes layout sequences as tuples
        return tuple(_to_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    return value


class StyleClassError(ValueError):
    """A rule's `style: PKG.MOD:Class` cannot be used: it does not import, is not a
    ParallelStyle subclass, or its constructor refuses the rule's arguments."""


def style_class(spec: StyleSpec, kind: str | None = None) -> type:
    """The ParallelStyle class a spec compiles to (for a module of `kind`, a key of
    MODULE_KINDS). For a class the plan names (external_styles.py), importing it,
    checking what it is and that its constructor takes the rule's keys;
    StyleClassError says what is wrong."""
    name = spec.torch_class(kind)
    if not is_external(getattr(spec, "style", None)):
        return resolve(name)
    try:
        with _import_logs_off(name.partition(".")[0].partition(":")[0]):
            cls = resolve(name)
    except ModuleNotFoundError as exc:
        raise StyleClassError(f"style '{name}' cannot be imported: no module named {exc.name!r} (is it installed?)") from None
    except AttributeError:
        raise StyleClassError(f"style '{name}': module '{name.partition(':')[0]}' has no attribute '{name.partition(':')[2]}'") from None
    except Exception as exc:  # the third party's module runs at import: report its error, not a traceback
        raise StyleClassError(f"style '{name}' cannot be imported: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, ParallelStyle)):
        raise StyleClassError(f"style '{name}' is {_what(cls)}, not a subclass of torch's ParallelStyle")
    unknown = _refused_arguments(cls, spec.torch_options())
    if unknown:
        raise StyleClassError(
            f"{name.rpartition(':')[2]} takes no argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(_arguments(cls)) or 'none'})"
        )
    return cls


def _import_logs_off(package: str):
    """The package's and torch's log records while importing it (torchao logs every
    optional CUDA kernel it cannot load on a CPU machine): not the user's concern,
    and an import that fails says why by its exception."""
    return loggers_quiet(package, "torch")


def _what(value: Any) -> str:
    return f"the class {value.__qualname__}" if isinstance(value, type) else f"a {type(value).__name__}"


def _arguments(cls: type) -> list[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _refused_arguments(cls: type, options: dict) -> list[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the constructor decides
        return []
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return []
    return [key for key in options if key not in _arguments(cls)]


def compile_style(spec: StyleSpec, src_data_rank: int | None = 0, kind: str | None = None) -> ParallelStyle:
    """A new style object for one module (of `kind`): styles hold per-module state, so never share one."""
    options = {name: _to_torch(value) for name, value in spec.torch_options().items()}
    cls = style_class(spec, kind)
    if is_external(getattr(spec, "style", None)):
        try:
            style = cls(**options)
        except Exception as exc:  # the third party's constructor refuses the rule's values: at the rule
            raise StyleClassError(f"{cls.__name__}(...) raised {type(exc).__name__}: {exc}") from None
    else:
        style = cls(**options)
    style.src_data_rank = src_data_rank
    return style


def compile_for(spec: StyleSpec, module: Any, src_data_rank: int | None = 0) -> ParallelStyle:
    """The style object for `module`: `compile_style`'s, or for a peft LoRA-wrapped
    Linear the one that shards its base layer and derives its adapters (lora.py)."""
    style = compile_style(spec, src_data_rank, module_kind(module) if module is not None else None)
    return for_module(style, spec, module, lambda adapter: compile_style(adapter, src_data_rank))
