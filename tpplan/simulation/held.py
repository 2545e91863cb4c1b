"""The modules a model's modules hold outside their children, for torch's module tracker
(memory/memory.py names them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def held_modules(model: "nn.Module") -> Iterator[tuple[str, "nn.Module"]]:
    """(path, module) for each module that a module of `model` holds in an attribute, or in a
    dict, list or tuple there, without it being a module of `model`: the `kernels` package's
    per-instance function modules (`use_kernelized_func`: `self_attn._kernel_funcs
    ["rotary_pos_emb"]`, which transformers uses from 5.25 when kernels >= 0.19.1 is installed).

    Named for torch's ModTracker, which otherwise names a module outside the hierarchy by its
    class: the global function module (class `Func`) forwards into the attention's own copy (also
    `Func`), which reads as a module entering itself, and torch warns "The module hierarchy
    tracking maybe be messed up" on every call, once per layer."""
    from torch import nn

    internals = set(vars(nn.Module()))
    registered = {id(m) for _, m in model.named_modules(remove_duplicate=False)}
    for fqn, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in internals:
                continue
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for key, item in items:
                if isinstance(item, nn.Module) and id(item) not in registered:
                    yield ".".join(str(part) for part in (fqn, attribute, key) if part not in ("", None)), item
