"""The buffers of a model being loaded: no checkpoint holds a non-persistent
buffer (a rotary table), so it is kept when it is real, moved to the device the
model is loaded on, and recomputed by the model's own init when it was on the
meta device (`_materialize` in load.py allocates it NaN-filled, so an unset one
shows): torchtitan's `init_weights(buffer_device=)`, transformers'
`_init_weights`, a module's `reset_parameters()`; else TP607.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import fail, some

if TYPE_CHECKING:
    import torch
    from torch import nn


def moved(t: "torch.Tensor", device) -> "torch.Tensor | None":
    """A real plain buffer on `device` (None when it is there, or a DTensor, which stays on its mesh)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) or t.device == device:
        return None
    return t.to(device)


def takes_nan(t: "torch.Tensor") -> bool:
    return t.is_floating_point() or t.is_complex()  # torchtitan's freqs_cis is complex


def init_weights_with_buffers(model: "nn.Module", device) -> list[str]:
    """torchtitan's convention: a model built on meta re-creates its buffers (and
    initialises its parameters) in `init_weights(buffer_device=)`. Called only when
    some non-persistent buffer is unset (NaN), before the read overwrites the
    parameters it initialised. Returns the buffers it filled."""
    import inspect
    import warnings

    import torch

    init = getattr(model, "init_weights", None)
    unset = _unset_buffers(model)
    if not callable(init) or is_transformers(model) or not unset:
        return []
    try:
        takes_device = "buffer_device" in inspect.signature(init).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return []
    if not takes_device:
        return []
    with torch.no_grad(), warnings.catch_warnings():
        # random init of DTensors on a CPU mesh: values the read overwrites next
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
        init(buffer_device=device)
    still = {(name, k) for name, _, keys in _unset_buffers(model) for k in keys}
    return [f"{name}.{k}" if name else k for name, _, keys in unset for k in keys if (name, k) not in still]


def _unset_buffers(model: "nn.Module") -> list:
    """[(module name, module, [buffer keys])]: the non-persistent buffers still NaN
    (allocated by `_materialize` from the meta device, not computed yet)."""
    import torch

    pending = []
    for module_name, module in model.named_modules():
        names = [k for k in module._non_persistent_buffers_set if isinstance(module._buffers.get(k), torch.Tensor)]
        unset = [k for k in names if takes_nan(module._buffers[k]) and bool(torch.isnan(module._buffers[k]).all())]
        if unset:
            pending.append((module_name, module, unset))
    return pending


def is_transformers(model: "nn.Module") -> bool:
    return hasattr(model, "_init_weights") and hasattr(model, "config") and type(model).__module__.startswith("transformers.")


def recompute_buffers(model: "nn.Module", where: str) -> list[str]:
    """Fill the non-persistent buffers `_materialize` allocated (NaN-filled), by the
    module's own init: transformers' `_init_weights` (rotary `inv_freq`), else the
    module's `reset_parameters()`. Returns their names; TP607 when one stays unset."""
    import torch

    pending = _unset_buffers(model)
    done = []
    with torch.no_grad():
        for module_name, module, unset in pending:
            own_params = next(module.parameters(recurse=False), None) is not None
            if is_transformers(model) and not own_params:
                model._init_weights(module)
            elif hasattr(module, "reset_parameters") and not own_params:
                module.reset_parameters()
            still = [k for k in unset if bool(torch.isnan(module._buffers[k]).all())]
            prefix = f"{module_name}." if module_name else ""
            if still:
                raise fail(
                    "TP607",
                    f"the non-persistent buffers {some([prefix + k for k in still])} of '{module_name}' ({type(module).__name__}) "
                    "were on the meta device and cannot be recomputed (no transformers init, no reset_parameters(), "
                    "no init_weights(buffer_device=)); the parameters are loaded, these buffers are not: build the model "
                    "under tpplan.meta_parameters() (parameters on meta, buffers computed as written)",
                    where,
                )
            done += [prefix + k for k in unset]
    return done
