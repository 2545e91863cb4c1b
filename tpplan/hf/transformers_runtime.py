"""transformers' own TP runtime on a built model, for side-by-side comparisons
(bench/bench_hf_comms.py and the tests): the peer tpplan's plans are measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .importer import base_model_attr, hf_tp_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def apply_transformers_plan(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` with transformers' own TP runtime and its own plan, as
    `from_pretrained(tp_plan="auto")` does, but on an already built model: each
    planned parameter is sharded by its style, then each planned module gets the
    style's forward hooks. For benchmarks (bench/bench_hf_comms.py); uses
    transformers internals, so it may need updating with transformers.
    """
    import transformers.distributed.tensor_parallel  # noqa: F401  (registers the styles)
    from transformers.distributed.parallel_utils import (
        ALL_PARALLEL_STYLES,
        _get_parameter_plan,
        replace_layer_number_by_wildcard,
    )

    plan = hf_tp_plan(model.config, type(model), base_model_attr(model))
    config = model.config.get_text_config()
    modules = dict(model.named_modules())
    for name, _ in list(model.named_parameters()):
        style = _get_parameter_plan(name, plan)
        if style is not None:
            owner, _, pname = name.rpartition(".")
            shard = ALL_PARALLEL_STYLES[style].shard_param
            shard(modules[owner], pname, mesh, **_config_argument(shard, config))
    for name, module in modules.items():
        style = plan.get(replace_layer_number_by_wildcard(name)) if name else None
        if style is not None:
            install = ALL_PARALLEL_STYLES[style].install_forward
            if style == "mla_kv_a_proj":  # transformers <= 5.24's apply_tensor_parallelism: the style reads qk_rope_head_dim there
                module.config = config
            install(module, mesh, **_config_argument(install, config))
    return model


def _config_argument(method, config) -> dict:
    """The text config as the `config` keyword of a style's method that takes it, as transformers
    5.25's apply_tensor_parallelism passes it (mla_kv_a_proj reads qk_rope_head_dim there); none before."""
    import inspect

    return {"config": config} if "config" in inspect.signature(method).parameters else {}
